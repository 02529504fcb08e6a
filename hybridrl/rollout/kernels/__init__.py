"""Triton kernels of the built-in engine, each beside the PyTorch reference its tests compare it with."""
