#!/usr/bin/env bash
# Longer GRPO on the demo's SFT model (docs/benchmarks.md, "The CPU demo"): held-out accuracy every 50
# steps for 200 steps at two learning rates. Run after `hybridrl demo` in the same directory (it reuses
# runs/demo/sft/model and runs/demo/data); about 2 minutes per learning rate on 2 CPU cores.
set -euo pipefail
for lr in 3e-5 1e-4; do
  out=runs/demo_long_grpo/lr_$lr
  hybridrl train examples/arithmetic_grpo.yaml trainer.total_steps=200 trainer.eval_every=50 actor.lr=$lr \
      trainer.output_dir=$out logging.sinks=[jsonl] logging.num_samples_to_print=0 trainer.save_model=false >/dev/null
  python3 - "$out/metrics.jsonl" "$lr" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"lr {sys.argv[2]}: held-out accuracy by step", [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r])
PY
done
