#!/usr/bin/env bash
# The 2-GPU checks in one go (nvidia-h200-x2): the trainer itself on 2 GPUs with sharded
# checkpoints (save on 2, resume on 2, resume on 1), a split placement (actor on GPU 0, a reward model
# on GPU 1) with per-GPU memory/utilisation sampled by nvidia-smi, then `python3 -m benchmarks.scaling --compare`.
#   OUT=/tmp/out bash benchmarks/two_gpu_runs.sh [shapes|none]      (none: skip the scaling benchmark)
set -u -o pipefail
OUT=${OUT:-/tmp/hybridrl-two-gpu}; mkdir -p "$OUT"
SHAPES=${1:-grpo-0.5b,qwen2.5-1.5b}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=$(mktemp -d)
run() { echo "== $*"; "$@"; echo "== exit $?"; }

python3 -m hybridrl.cli make-data "$WORK/data" >/dev/null
python3 -m benchmarks.tiny_reward_model "$WORK/reward_model"
DEVICE=${DEVICE:-cuda}
COMMON=(model.path=tiny:qwen2 trainer.device=$DEVICE "data.train_path=$WORK/data/train.jsonl"
        "data.eval_path=$WORK/data/eval.jsonl" trainer.eval_every=0 logging.sinks=[jsonl] trainer.save_model=false)
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -lms 250 > "$OUT/nvidia_smi.csv" &
SMI=$!
T=$WORK/run2
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=2 \
    trainer.total_steps=4 trainer.save_every=2 "trainer.output_dir=$T"
ls "$T/checkpoints" "$T/checkpoints/step_000004"
cp -r "$T" "$WORK/run1"
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=2 \
    trainer.total_steps=6 trainer.save_every=2 "trainer.output_dir=$T"
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=1 \
    trainer.total_steps=6 trainer.save_every=2 "trainer.output_dir=$WORK/run1"
python3 -c "import json,sys; [print(r['step'], round(r['timing/step_s'],3), r.get('perf/weight_sync_s')) for r in map(json.loads, open(sys.argv[1]))]" "$T/metrics.jsonl"
# Offloaded optimizer moments with 2 processes (sharded_offload.py: gathered over NCCL, cut back on resume):
# stop at step 2, resume to 4, and compare steps 3-4 with a run that never stopped.
O=$WORK/offload
VARIED=("reward.functions=[{fn: length_penalty, kwargs: {scale: 10}}]")  # rewards that differ, so gradients are not 0
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=2 \
    actor.optimizer_offload=true model.dtype=bfloat16 trainer.total_steps=4 trainer.save_every=0 "${VARIED[@]}" \
    "trainer.output_dir=$O-straight"
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=2 \
    actor.optimizer_offload=true model.dtype=bfloat16 trainer.total_steps=2 trainer.save_every=2 "${VARIED[@]}" \
    "trainer.output_dir=$O"
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=2 \
    actor.optimizer_offload=true model.dtype=bfloat16 trainer.total_steps=4 trainer.save_every=2 "${VARIED[@]}" \
    "trainer.output_dir=$O"
python3 -c "
import json, sys
rows = lambda path: [json.loads(line) for line in open(path)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
keys = ('actor/policy_loss', 'actor/grad_norm', 'actor/entropy')
for x, y in zip(a[2:], b[2:]):
    same = all(x[k] == y[k] for k in keys)
    print('offload resume step', x['step'], 'equal' if same else 'DIFFERENT', [(x[k], y[k]) for k in keys])" "$O-straight/metrics.jsonl" "$O/metrics.jsonl"
echo "split-start $(date +%T.%N)"
run timeout -k 20 240 python3 -m hybridrl.cli train examples/arithmetic_grpo.yaml "${COMMON[@]}" trainer.num_gpus=1 \
    "trainer.device_mesh={actor: [0], reward: [1]}" "reward.reward_model=$WORK/reward_model" \
    trainer.total_steps=5 "trainer.output_dir=$WORK/split"
echo "split-end $(date +%T.%N)"
tail -1 "$WORK/split/metrics.jsonl" | tr ',' '\n' | grep -E "reward|step_s|peak"
kill $SMI
[ "$SHAPES" = none ] || run timeout -k 20 420 python3 -m benchmarks.scaling --compare --shapes "$SHAPES" --steps 2
