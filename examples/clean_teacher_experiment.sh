#!/usr/bin/env bash
# The demo without the period style: a clean SFT teacher, then GRPO at several learning rates.
# Measured on 2026-11-30 (docs/benchmarks.md): held-out accuracy did not rise for this tiny model.
set -euo pipefail
out=${1:-runs/clean}
hybridrl make-data "$out/data" --period-rate 0
hybridrl sft examples/arithmetic_sft.yaml data.train_path="$out/data/train.jsonl" trainer.output_dir="$out/sft" \
    sft.max_steps=2000
for lr in 1e-5 3e-5 1e-4 3e-4; do
  hybridrl train examples/arithmetic_grpo.yaml data.train_path="$out/data/train.jsonl" \
      data.eval_path="$out/data/eval.jsonl" model.path="$out/sft/model" trainer.output_dir="$out/grpo_$lr" \
      trainer.total_steps=80 actor.lr=$lr logging.sinks=[jsonl] trainer.save_model=false
  grep -o '"eval/accuracy": [0-9.]*' "$out/grpo_$lr/metrics.jsonl" | tr '\n' ' '; echo " <- lr=$lr"
done
