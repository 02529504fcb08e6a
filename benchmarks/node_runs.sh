#!/usr/bin/env bash
# Multi-GPU scaling and placement on one node of 4 or 8 GPUs (nvidia-h200-x4 / -x8), one part per device call (each under 10 minutes):
#   OUT=/tmp/out bash benchmarks/node_runs.sh scaling-0.5b   # 0.5B, shared prompts, resident moments, on 1/2/4/8 GPUs
#   OUT=/tmp/out bash benchmarks/node_runs.sh scaling-1.5b   # 1.5b-full on 1, 2, 4, 8 GPUs (scaling efficiency per count)
#   OUT=/tmp/out bash benchmarks/node_runs.sh 7b             # 7b-full on 8 GPUs: step, tokens/s per GPU, peak, switch
#   OUT=/tmp/out bash benchmarks/node_runs.sh split          # 6 training processes + a reward model on GPUs 6 and 7
#   OUT=/tmp/out bash benchmarks/node_runs.sh profile-0.5b   # why 0.5B scales poorly: its largest GPU count, 5 steps,
#        the 5th profiled (rank 0's trace_*.json.gz, read with benchmarks/profiling/trace_report.py) and
#        TORCH_LOGS=recompiles in stderr_*.log (which frames compile again after step 1)
# GPU counts above the machine's are dropped (GPUS=1,2,4 on an x4). grpo_step.py prints step time, speed-up,
# scaling efficiency, tokens/s per GPU and the train->generate switch time; `split` adds each role's mean
# GPU utilisation and memory from nvidia-smi samples. `7b` and `split` need 8 GPUs.
set -u -o pipefail
PART=${1:?"name a part: scaling-0.5b, scaling-1.5b, 7b, split or profile-0.5b"}
OUT=${OUT:-/tmp/hybridrl-node}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VISIBLE=$(nvidia-smi -L | wc -l)
GPUS=${GPUS:-$(for g in 1 2 4 8; do [ "$g" -le "$VISIBLE" ] && printf '%s,' "$g"; done | sed 's/,$//')}
echo "== $VISIBLE GPUs visible; GPU counts $GPUS"

case "$PART" in
scaling-0.5b)
    timeout -k 20 570 python3 -m benchmarks.grpo_step --modes grpo-0.5b-fused-shared-resident --gpus "$GPUS" --timeout 140 \
        > "$OUT/scaling_0.5b.log" 2>&1; echo "== exit $?"; tail -12 "$OUT/scaling_0.5b.log" ;;
scaling-1.5b)
    timeout -k 20 570 python3 -m benchmarks.grpo_step --modes 1.5b-full --gpus "$GPUS" --timeout 140 \
        > "$OUT/scaling_1.5b.log" 2>&1; echo "== exit $?"; tail -12 "$OUT/scaling_1.5b.log" ;;
profile-0.5b)
    TORCH_LOGS=recompiles timeout -k 20 570 python3 -m benchmarks.grpo_step --modes grpo-0.5b-fused-shared-resident \
        --gpus "${GPUS##*,}" --steps 5 --profile --timeout 300 > "$OUT/profile_0.5b.log" 2>&1
    echo "== exit $?"; tail -4 "$OUT/profile_0.5b.log"
    for trace in "$OUT"/trace_*.json.gz; do python3 -m benchmarks.profiling.trace_report "$trace" --gap-ms 2 --wait-ms 5 | grep -v "^    "; done
    grep -h -i "recompil" "$OUT"/stderr_*.log | head -20 ;;
7b)
    timeout -k 20 570 python3 -m benchmarks.grpo_step --modes 7b-full --gpus "${GPUS##*,}" --timeout 560 \
        > "$OUT/7b_full.log" 2>&1; echo "== exit $?"; tail -6 "$OUT/7b_full.log" ;;
split)
    [ "$VISIBLE" -ge 8 ] || { echo "split needs 8 GPUs; $VISIBLE visible"; exit 1; }
    WORK=$(mktemp -d)
    python3 -m hybridrl.cli make-data "$WORK/data" > /dev/null
    python3 -m benchmarks.tiny_reward_model "$WORK/reward_model"
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 250 \
        > "$OUT/nvidia_smi.csv" &
    SMI=$!
    timeout -k 20 400 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml model.path=tiny:qwen2 trainer.device=cuda \
        "data.train_path=$WORK/data/train.jsonl" "data.eval_path=$WORK/data/eval.jsonl" trainer.eval_every=0 \
        logging.sinks=[jsonl] trainer.save_model=false trainer.num_gpus=6 trainer.total_steps=6 \
        "trainer.device_mesh={actor: [0, 1, 2, 3, 4, 5], reward: [6, 7]}" "reward.reward_model=$WORK/reward_model" \
        "trainer.output_dir=$WORK/split" > "$OUT/split.log" 2>&1
    echo "== split exit $?"; kill $SMI
    tail -1 "$WORK/split/metrics.jsonl" | tr ',' '\n' | grep -E "reward|step_s|peak|weight_sync"
    python3 - "$OUT/nvidia_smi.csv" <<'PY'
import collections, sys
used, busy = collections.defaultdict(list), collections.defaultdict(list)
for line in open(sys.argv[1]):
    index, memory, utilisation = (int(v) for v in line.split(","))
    used[index].append(memory); busy[index].append(utilisation)
for role, gpus in (("actor/rollout", range(6)), ("reward model", range(6, 8))):
    samples = [u for g in gpus for u in busy[g]]
    print(f"{role} GPUs {list(gpus)}: mean utilisation {sum(samples) / max(1, len(samples)):.0f}%, "
          f"peak memory used {max((max(used[g]) for g in gpus if used[g]), default=0)} MiB")
PY
    ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
