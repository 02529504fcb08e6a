"""Kernel micro-benchmarks: decode attention and its launch configurations, the sampler kernels, the optimizer
step and FlexAttention at the update's layouts, each checked against a reference before it is timed."""
