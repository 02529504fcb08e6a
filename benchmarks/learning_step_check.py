"""One GRPO step of hybridrl and of TRL on the very same batch: advantages, loss and gradient side by side.

    python -m benchmarks.learning_step_check --sft-model /tmp/lvt/demo/sft/model --data /tmp/lvt/demo/data

hybridrl rolls out and scores one step's prompts (the settings of `learning_vs_trl.py`, gradient clipping off so
the raw gradient is compared), computes its advantages and its update's gradient; the batch (prompt and completion
ids with their masks, and the scores) goes to TRL's worker (`trl_learning_worker.py --step-check`), which computes
TRL's group advantages and `GRPOTrainer.compute_loss` on it and back-propagates. Printed: the largest advantage
difference, both losses, and the relative L2 difference of the gradients (overall and the worst tensor), against
TRL as it is and against TRL with hybridrl's std epsilon (1e-6 where TRL adds 1e-4). A difference far above
float32 rounding in the second is a defect to find.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.learning_vs_trl import ROOT, TRL_VENV_HINT, check_trl, hybridrl_trainer


def hybridrl_step(spec: dict) -> dict:
    """hybridrl's batch, advantages (B,), policy loss and gradient (name -> tensor) for one step."""
    trainer = hybridrl_trainer({**spec, "hybridrl_overrides": ["actor.max_grad_norm=0"]})
    prompts = trainer.parts.dataset.batch(next(trainer.sampler))
    batch, _ = trainer.rollout(prompts)
    trainer.score(batch, prompts)
    trainer.compute_logprobs(batch)
    trainer.compute_advantages(batch)
    gradients, optimizer = {}, trainer.parts.actor_optimizer
    step = optimizer.step

    def capture(*args, **kwargs):
        gradients.update({name: p.grad.detach().clone() for name, p in trainer.parts.actor.named_parameters()
                          if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = capture
    metrics = trainer.update(batch)
    prompt_width = batch.input_ids.shape[1] - batch.response_length
    first_token = batch.response_mask.argmax(1)  # an advantage is constant over a row's tokens
    return {"prompt_ids": batch.input_ids[:, :prompt_width], "prompt_mask": batch.attention_mask[:, :prompt_width],
            "completion_ids": batch.input_ids[:, prompt_width:], "completion_mask": batch.response_mask.long(),
            "scores": batch.scores, "group_size": spec["group_size"],
            "advantages": batch.advantages.gather(1, first_token[:, None])[:, 0],
            "loss": float(metrics["actor/policy_loss"]), "gradients": gradients}


def compare(ours: dict, theirs: dict) -> list[str]:
    names = sorted(set(ours["gradients"]) & set(theirs["gradients"]))
    differences = {name: (ours["gradients"][name] - theirs["gradients"][name]).norm().item() for name in names}
    overall = sum(d ** 2 for d in differences.values()) ** 0.5 / sum(
        theirs["gradients"][n].norm().item() ** 2 for n in names) ** 0.5
    worst = max(names, key=lambda n: differences[n] / max(theirs["gradients"][n].norm().item(), 1e-12))
    worst_relative = differences[worst] / max(theirs["gradients"][worst].norm().item(), 1e-12)
    return [f"rows {len(ours['scores'])}, mean reward {ours['scores'].mean().item():.4f}, "
            f"{int(ours['completion_mask'].sum())} completion tokens; {len(names)} gradient tensors compared",
            f"advantages: largest |hybridrl - TRL| {(ours['advantages'] - theirs['advantages']).abs().max().item():.3e}",
            f"policy loss: hybridrl {ours['loss']:.6e}, TRL {theirs['loss']:.6e}",
            f"gradient: relative L2 difference {overall:.3e} overall, {worst_relative:.3e} at worst ({worst})"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", required=True)
    parser.add_argument("--data", required=True, help="the task's data directory (train.jsonl)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help=f"made by: {TRL_VENV_HINT}")
    args = parser.parse_args(argv)
    check_trl(args.trl_python)
    torch.set_num_threads(1)
    spec = {"seed": args.seed, "model": args.sft_model, "train_path": str(Path(args.data) / "train.jsonl"),
            "eval_path": str(Path(args.data) / "eval.jsonl"), "steps": 1, "prompts_per_step": 32, "group_size": 8,
            "lr": 3e-5, "temperature": 1.0, "max_new_tokens": 6, "threads": 1}
    with tempfile.TemporaryDirectory() as directory:
        spec["out_dir"] = directory
        ours = hybridrl_step(spec)
        batch, result = Path(directory) / "batch.pt", Path(directory) / "trl.pt"
        torch.save({key: value for key, value in ours.items() if key != "gradients"}, batch)
        subprocess.run([args.trl_python, "-m", "benchmarks.trl_learning_worker", "--step-check", str(batch),
                        "--spec", json.dumps(spec), "--out", str(result)], cwd=ROOT, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        theirs = torch.load(result)
    for name, label in (("trl", "TRL as it is"), ("trl_with_hybridrl_epsilon", "TRL with hybridrl's std epsilon")):
        print(f"-- against {label}")
        print("\n".join(compare(ours, theirs[name])))


if __name__ == "__main__":
    main()
