#!/usr/bin/env bash
# The one-GPU checks (nvidia-h200), in parts chosen by argument; each part has its own time limit, so a hang in one
# still leaves the others' logs, and every log goes to $OUT. One device call allows 600 s: pick parts that fit.
#
#   OUT=/tmp/out bash benchmarks/gpu_checks.sh [PART ...]        (no PART: optimizer grpo)
#
# Parts (limit in seconds):
#   tests      every GPU test (`pytest -m gpu tests/`)                                          300
#   engine     the engine's GPU tests, the sampler kernels' tests (Triton's interpreter and lowering) and
#              benchmarks/kernels/sampling_kernels.py                                            320
#   optimizer  LeanAdamW's step resident, half and fully offloaded (benchmarks/kernels/optimizer_step.py);
#              beside another version when benchmarks/_baseline_optim.py exists (untracked, e.g.
#              `git show BASE:hybridrl/training/optim.py > benchmarks/_baseline_optim.py`)      90
#   flex       FlexAttention at the update's two layouts (benchmarks/kernels/flex_layouts.py)      150
#   rollout    the rollout table (benchmarks/rollout.py: engine variants, HF generate, greedy agreement) 190
#   paged      the paged KV cache's GPU tests (`pytest -m gpu tests/test_paged_kv.py`, 240) and the long-tail rollout,
#              paged against contiguous (benchmarks/long_tail.py)                                 300
#   new        the GPU tests written but never run on a GPU: the thread worker on CUDA (tests/test_async_gpu.py), paged
#              multi-turn episodes (tests/test_paged_multiturn.py) and the paged engine with forced preemption   240
#   pagedauto  the input for kv_cache=auto: the grpo-0.5b rollout (every response 256 tokens, the step's 3.2 GiB KV
#              budget), paged against contiguous, best of 3 alternating (100), then the same model on uneven lengths
#              (median 256, cap 2048, 45) (benchmarks/long_tail.py --shape grpo-0.5b)                   150
#   splitkv    split-KV against one program per (slot, head) (benchmarks/kernels/split_kv.py, 80) and the long-tail
#              rollout, paged against contiguous now that both split (benchmarks/long_tail.py, 220)           300
#   7b         full-parameter GRPO of the 7B shape on one GPU (benchmarks/full_7b_one_gpu.py)                  330
#   tta        time to accuracy against TRL (benchmarks/time_to_accuracy.py: a 0.5B-shape model taught the demo task by
#              SFT once, then per seed TRL for a budget and each hybridrl arm until that seed's TRL final accuracy);
#              TRL from .bench/ as in grpo; $TTA_BUDGET seconds (default 465: two seeds) and more arguments from
#              $TTA_ARGS (e.g. --hybridrl-variants default,master32)                        TTA_BUDGET + 25
#   grpo       the GRPO step table (benchmarks/grpo_step.py) with TRL beside it, TRL first; 6 steps, the 6th
#              profiled and left out of the mean, its Chrome trace saved to $OUT as trace_<mode>.json.gz
#              (read it with benchmarks/profiling/trace_report.py); modes from $MODES     what the call has left
#
# TRL runs when its wheels and script are in .bench/ (see docs/benchmarks.md); otherwise it is skipped with a line
# saying so. .bench/ is git-ignored: with the device tool, pass carry [".bench"].
# The limits are `timeout -k 20`: the trainer takes a first SIGTERM as "finish the step, save, stop" (and the signal
# also reaches torch.compile's worker processes), so without a KILL after it a part can outlive its limit.
set -u -o pipefail
OUT=${OUT:-/tmp/hybridrl-gpu-checks}; mkdir -p "$OUT"
MODES=${MODES:-grpo-0.5b-fused-shared-offload50,grpo-0.5b-fused-shared}
PARTS=("$@"); [ ${#PARTS[@]} -gt 0 ] || PARTS=(optimizer grpo)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }
with_trl() {  # TRL's wheels from .bench/ importable (returns 1 when they are not here)
    ls .bench/trl-*.whl > /dev/null 2>&1 || return 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/hybridrl-site .bench/*.whl > /dev/null 2>&1
    export PYTHONPATH=$PWD:/tmp/hybridrl-site
}

for part in "${PARTS[@]}"; do
    case "$part" in
    tests)
        timeout -k 20 300 python3 -m pytest -q -m gpu tests/ > "$OUT/gpu_tests.log" 2>&1
        echo "== gpu tests: exit $? after $(elapsed)"; tail -2 "$OUT/gpu_tests.log" ;;
    engine)
        timeout -k 20 200 python3 -m pytest -q -m gpu tests/test_builtin_engine_gpu.py > "$OUT/engine_gpu_tests.log" 2>&1
        echo "== engine gpu tests: exit $? after $(elapsed)"; tail -2 "$OUT/engine_gpu_tests.log"
        timeout -k 20 60 python3 -m pytest -q tests/test_sampling_kernels.py > "$OUT/kernel_tests.log" 2>&1
        echo "== sampler kernel tests (interpreter, lowering): exit $? after $(elapsed)"; tail -1 "$OUT/kernel_tests.log"
        timeout -k 20 60 python3 -m benchmarks.kernels.sampling_kernels > "$OUT/sampling_kernels.log" 2>&1
        echo "== sampling_kernels: exit $? after $(elapsed)"; tail -9 "$OUT/sampling_kernels.log" ;;
    optimizer)
        baseline=(); [ -f benchmarks/_baseline_optim.py ] && baseline=(--baseline benchmarks/_baseline_optim.py)
        timeout -k 20 90 python3 -m benchmarks.kernels.optimizer_step "${baseline[@]}" > "$OUT/optimizer_step.log" 2>&1
        echo "== optimizer_step: exit $? after $(elapsed)"; tail -7 "$OUT/optimizer_step.log" ;;
    flex)
        timeout -k 20 150 python3 -m benchmarks.kernels.flex_layouts > "$OUT/flex_layouts.log" 2>&1
        echo "== flex_layouts: exit $? after $(elapsed)"; tail -9 "$OUT/flex_layouts.log" ;;
    rollout)
        timeout -k 20 190 python3 -m benchmarks.rollout --no-eager-baseline --no-triton --agreement-sequences 32 \
            > "$OUT/rollout.log" 2>&1
        echo "== rollout: exit $? after $(elapsed)"; grep -A11 "tokens  seconds" "$OUT/rollout.log" | head -14 ;;
    paged)
        timeout -k 20 240 python3 -m pytest -v -m gpu tests/test_paged_kv.py > "$OUT/paged_gpu_tests.log" 2>&1
        echo "== paged KV gpu tests: exit $? after $(elapsed)"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/paged_gpu_tests.log" | tail -8
        timeout -k 20 300 python3 -m benchmarks.long_tail > "$OUT/long_tail.log" 2>&1
        echo "== long_tail: exit $? after $(elapsed)"; tail -7 "$OUT/long_tail.log" ;;
    new)
        timeout -k 20 240 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_async_gpu.py \
            tests/test_paged_multiturn.py "tests/test_paged_kv.py::test_paged_engine_on_cuda" > "$OUT/new_gpu_tests.log" 2>&1
        echo "== new gpu tests: exit $? after $(elapsed)"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/new_gpu_tests.log" | tail -8 ;;
    pagedauto)
        timeout -k 20 100 python3 -m benchmarks.long_tail --shape grpo-0.5b --prompt-len 256 --median 256 --sigma 0 \
            --cap 256 --kv-cache-memory 3.2 --repeats 3 > "$OUT/paged_grpo05b.log" 2>&1
        echo "== long_tail grpo-0.5b: exit $? after $(elapsed)"; tail -7 "$OUT/paged_grpo05b.log"
        mkdir -p "$OUT/uneven"
        OUT="$OUT/uneven" timeout -k 20 45 python3 -m benchmarks.long_tail --shape grpo-0.5b --prompt-len 256 \
            --median 256 --sigma 1 --cap 2048 --kv-cache-memory 3.2 > "$OUT/paged_grpo05b_uneven.log" 2>&1
        echo "== long_tail grpo-0.5b uneven: exit $? after $(elapsed)"; tail -7 "$OUT/paged_grpo05b_uneven.log" ;;
    splitkv)
        timeout -k 20 80 python3 -m benchmarks.kernels.split_kv > "$OUT/split_kv.log" 2>&1
        echo "== split_kv: exit $? after $(elapsed)"; tail -10 "$OUT/split_kv.log"
        timeout -k 20 220 python3 -m benchmarks.long_tail > "$OUT/long_tail.log" 2>&1
        echo "== long_tail: exit $? after $(elapsed)"; tail -7 "$OUT/long_tail.log" ;;
    7b)
        timeout -k 20 330 python3 -m benchmarks.full_7b_one_gpu --budget 300 > "$OUT/full_7b_one_gpu.log" 2>&1
        echo "== full_7b_one_gpu: exit $? after $(elapsed)"; tail -12 "$OUT/full_7b_one_gpu.log" ;;
    tta)
        with_trl || echo "== TRL skipped: no .bench/trl-*.whl here (git-ignored: carry .bench)"
        budget=${TTA_BUDGET:-465}
        timeout -k 20 $(( budget + 25 )) python3 -m benchmarks.time_to_accuracy --budget "$budget" ${TTA_ARGS:-} \
            > "$OUT/time_to_accuracy.log" 2>&1
        echo "== time_to_accuracy: exit $? after $(elapsed)"  # below: progress lines, then the summary without curves
        grep -E "^\[|^-- |^(trl|hybridrl[-a-z0-9]*)(:|'s) |^to |^median|^TRL|^no TRL" "$OUT/time_to_accuracy.log" \
            | grep -vE "^[a-z0-9-]+: step 0 " | tail -70 ;;
    grpo)
        modes=$MODES
        if [ -f .bench/trl_grpo_gpu.py ] && with_trl; then
            modes="trl,$modes"
        else
            echo "== TRL skipped: no .bench/trl-*.whl or .bench/trl_grpo_gpu.py here (git-ignored: carry .bench)"
        fi
        left=$(( 585 - $(date +%s) + start ))  # what the device call's 600 s leave
        timeout -k 20 $left python3 -m benchmarks.grpo_step --modes "$modes" --steps 6 --profile \
            --trl-script .bench/trl_grpo_gpu.py --timeout 200 > "$OUT/grpo_step.log" 2>&1
        echo "== grpo_step: exit $? after $(elapsed)"; tail -8 "$OUT/grpo_step.log" ;;
    *) echo "unknown part $part: tests, engine, optimizer, flex, rollout, paged, pagedauto, new, splitkv, 7b, tta or grpo"
       exit 2 ;;
    esac
done
