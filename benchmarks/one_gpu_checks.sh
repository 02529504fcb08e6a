#!/usr/bin/env bash
# The one-GPU checks of issues 3 and 4 in one device call (nvidia-h200, under 10 minutes): the GPU tests
# of the kernels and the engine, the rollout table (the engine variants below, HF generate, greedy agreement with HF bf16 and float32, a profile
# per engine), where the default engine's GPU idle time goes (decode_gaps.py), then the GRPO step table with
# TRL beside it (5 steps, the fused mode). Each part has its own time limit, so a hang in one still leaves
# the others' logs; every log goes to $OUT.
#   OUT=/tmp/out bash benchmarks/one_gpu_checks.sh [grpo_step modes]
# TRL runs when its wheels and script are in .bench/ (see docs/benchmarks.md); otherwise it is skipped.
set -u -o pipefail
OUT=${OUT:-/tmp/hybridrl-one-gpu}; mkdir -p "$OUT"
MODES=${1:-grpo-0.5b-fused}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

timeout 200 python3 -m pytest -q -m gpu tests/test_fused_head.py tests/test_decode_attention.py \
    tests/test_stacked_attention.py tests/test_builtin_engine.py tests/test_optim.py tests/test_shared_prompt.py > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests: exit $? after $(elapsed)"; tail -2 "$OUT/gpu_tests.log"

# The engine variants: sdpa, fused q/k/v with a RoPE kernel and with RoPE in the attention kernel, + fused gate/up.
# Skipped: plain triton (unfused q/k/v) and triton-stacked, slower in earlier runs (its launch sweep:
# decode_attention.py --no-sweep --stacked).
timeout 190 python3 benchmarks/rollout.py --no-eager-baseline --no-triton --no-triton-stacked --agreement-sequences 32 --profile \
    > "$OUT/rollout.log" 2>&1
echo "== rollout: exit $? after $(elapsed)"; grep -A11 "tokens  seconds" "$OUT/rollout.log" | head -14

timeout 90 python3 benchmarks/decode_gaps.py --sync-every 16 > "$OUT/decode_gaps.log" 2>&1
echo "== decode_gaps: exit $? after $(elapsed)"; grep -A8 "^idle between" "$OUT/decode_gaps.log"; tail -3 "$OUT/decode_gaps.log"

if ls .bench/trl-*.whl > /dev/null 2>&1 && [ -f .bench/trl_grpo_gpu.py ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/hybridrl-site .bench/*.whl > /dev/null 2>&1
    export PYTHONPATH=$PWD:/tmp/hybridrl-site
    MODES="$MODES,trl"
fi
left=$(( 585 - $(date +%s) + start ))  # what the device call's 600 s leave
timeout $left python3 benchmarks/grpo_step.py --modes "$MODES" --steps 5 --trl-script .bench/trl_grpo_gpu.py \
    --timeout 200 > "$OUT/grpo_step.log" 2>&1
echo "== grpo_step: exit $? after $(elapsed)"; tail -8 "$OUT/grpo_step.log"
# From the rollout run's profiles (one per engine): kernels per decode step, and whether the per-layer
# device-to-device copy of the old o_proj addmm is gone. (The GRPO step profile, with host activity per idle
# gap: grpo_step.py --modes grpo-0.5b-fast --profile --steps 3.)
grep -E "^profile:|Memcpy DtoD|Memset|badd|_decode_attention_kernel|_stacked" "$OUT/rollout.log" | cut -c1-60,150-230 | head -30
