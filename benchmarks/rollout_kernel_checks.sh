#!/usr/bin/env bash
# The rollout kernels' checks in one device call (nvidia-h200, ~6 minutes): the GPU tests of the engine, the sampling
# kernels and the split-K projection kernels (bf16 against cuBLAS, inside CUDA graphs), then
# benchmarks/decode_projections.py (o and SwiGLU + down projections against cuBLAS over launch configurations, and
# rollouts with split_k_o_proj / fuse_mlp_down alternating in one process) and benchmarks/sampling_kernels.py.
# Each part has its own time limit, so a hang in one still leaves the others' logs; every log goes to $OUT.
#   OUT=/tmp/out bash benchmarks/rollout_kernel_checks.sh
set -u -o pipefail
OUT=${OUT:-/tmp/hybridrl-rollout-kernels}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

timeout 200 python3 -m pytest -q -m gpu tests/test_builtin_engine_gpu.py tests/test_projection_kernels.py \
    > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests: exit $? after $(elapsed)"; tail -2 "$OUT/gpu_tests.log"
timeout 60 python3 -m pytest -q tests/test_sampling_kernels.py tests/test_projection_kernels.py \
    > "$OUT/kernel_tests.log" 2>&1
echo "== kernel tests (interpreter, lowering): exit $? after $(elapsed)"; tail -1 "$OUT/kernel_tests.log"
timeout 380 python3 benchmarks/decode_projections.py --rows 512 > "$OUT/decode_projections.log" 2>&1
echo "== decode_projections: exit $? after $(elapsed)"; grep -v Warn "$OUT/decode_projections.log" | tail -60
timeout 60 python3 benchmarks/sampling_kernels.py > "$OUT/sampling_kernels.log" 2>&1
echo "== sampling_kernels: exit $? after $(elapsed)"; tail -9 "$OUT/sampling_kernels.log"
