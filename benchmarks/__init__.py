"""Benchmarks: scripts that print a table (run them as modules from the repository root, `python -m benchmarks.X`).

- `rollout`, `grpo_step`, `scaling`: the headline figures (rollout throughput, a full GRPO step beside TRL,
  data-parallel scaling).
- `kernels/`: micro-benchmarks of single kernels and the optimizer step.
- `profiling/`: where time goes (idle gaps, host time, saved traces, A/B runs of engine options).
- `gpu_checks.sh`, `two_gpu_runs.sh`, `node_runs.sh`: the device-call recipes for one GPU, two GPUs and a node.
"""
