# Device call 2 of 2026-11-30 12:12 UTC (nvidia-h200), as run: GPU tests, the launch sweep, the engine with
# the swept launch, then the max-autotune compile mode.  OUT=... bash benchmarks/norm_linear_call.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 130 python3 -m pytest -q -m gpu tests/test_builtin_engine.py tests/test_norm_linear.py > $OUT/gpu_tests.log 2>&1
echo "== tests exit $? $(( $(date +%s) - start )) s"; tail -3 $OUT/gpu_tests.log
timeout 200 python3 benchmarks/norm_linear.py --budget-s 75 --out $OUT/norm_linear_best.json > $OUT/norm_linear.log 2>&1
echo "== sweep exit $? $(( $(date +%s) - start )) s"; grep -v "^{" $OUT/norm_linear.log | tail -32
timeout 170 python3 benchmarks/rollout.py --no-eager-baseline --no-triton --no-triton-stacked --hf-sequences 0 \
  --agreement-sequences 4 --norm-linear-launch $OUT/norm_linear_best.json > $OUT/rollout.log 2>&1
echo "== rollout exit $? $(( $(date +%s) - start )) s"; grep -A9 "tokens  seconds" $OUT/rollout.log | cut -c1-140
left=$(( 560 - ($(date +%s) - start) ))
if [ $left -gt 60 ]; then
timeout $left python3 benchmarks/rollout.py --no-eager-baseline --no-triton --no-triton-stacked --no-fused-qkv \
  --hf-sequences 0 --agreement-sequences 4 --autotune > $OUT/rollout_autotune.log 2>&1
echo "== autotune exit $? $(( $(date +%s) - start )) s"; grep -A6 "tokens  seconds" $OUT/rollout_autotune.log | cut -c1-140; tail -3 $OUT/rollout_autotune.log
fi
