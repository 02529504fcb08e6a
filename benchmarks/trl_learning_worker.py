"""TRL's side of `learning_vs_trl.py`: `GRPOTrainer` on the exported SFT model, one seed, held-out accuracy at
each evaluation point. Run by the driver in TRL's own virtual environment (hybridrl is not installed there):

    /tmp/trl-venv/bin/python -m benchmarks.trl_learning_worker --spec '{...}' --out result.json

The spec (JSON, written by the driver) holds the same settings the hybridrl side gets. TRL's knobs set to match
hybridrl's GRPO: one optimizer step per rollout (per_device_train_batch_size = prompts x group, one accumulation
step, one generation per step), loss_type "dapo" (token mean over the batch, as hybridrl's token-mean), rewards
scaled by the group std, clip 0.2, no KL (beta 0), constant learning rate without warm-up, AdamW with no weight
decay, gradient norm clipped at 1, float32 on CPU (with `"device": "cuda"` in the spec, TRL's GPU default: float32
master weights under bf16 autocast, where hybridrl's GPU default keeps bf16 weights). Differences left: TRL divides
by std + 1e-4 where hybridrl adds 1e-6, and its prompt order and sampling noise come from its own seeded sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true", TOKENIZERS_PARALLELISM="false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from benchmarks.greedy_accuracy import greedy_accuracy, read_rows, sampled_pass_rates  # noqa: E402


def exact_match(prompts, completions, answer, **columns):
    """hybridrl's built-in `exact_match`: 1 where the stripped completion equals the stripped answer."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def synchronize() -> None:
    """Wait for the GPU's queued work, so a step's wall-clock includes it (nothing on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Evaluate(TrainerCallback):
    """Held-out accuracy before the first step and every `eval_every` steps (and after the last); the training
    wall-clock counts the steps only, not these evaluations; `eval_steps` in the spec are evaluated too. With
    `max_seconds` in the spec (time_to_accuracy.py),
    training stops after that much training wall-clock, the last step evaluated; with `partial_path`, the result so
    far is written there after each evaluation (a run cut short keeps its curve)."""

    def __init__(self, spec: dict, tokenizer, rows: list[dict]):
        self.spec, self.tokenizer, self.rows = spec, tokenizer, rows
        self.accuracy: dict[int, float] = {}
        self.sampled: dict[int, dict[str, float]] = {}  # at the first and last evaluation
        self.train_seconds, self.started = 0.0, 0.0
        self.seconds_at_eval: dict[int, float] = {}
        self.step_seconds: list[float] = []
        self.rewards: list[float] = []

    def evaluate(self, model, step: int, last: bool = False) -> None:
        self.accuracy[step] = greedy_accuracy(model, self.tokenizer, self.rows, self.spec["max_new_tokens"])
        self.seconds_at_eval[step] = self.train_seconds
        if (step == 0 or last) and self.spec["pass_k"]:
            self.sampled[step] = sampled_pass_rates(model, self.tokenizer, self.rows, self.spec["max_new_tokens"],
                                                    self.spec["pass_k"], self.spec["temperature"], self.spec["seed"])
        print(f"trl seed {self.spec['seed']} step {step} ({self.train_seconds:.1f} s): held-out accuracy "
              f"{self.accuracy[step]:.3f} {self.sampled.get(step, '')}", flush=True)
        if self.spec.get("partial_path"):
            with open(self.spec["partial_path"], "w") as file:
                json.dump(self.result(), file)

    def result(self) -> dict:
        return {"side": "trl", "seed": self.spec["seed"], "accuracy": self.accuracy, "sampled": self.sampled,
                "train_seconds": self.train_seconds, "reward_per_step": self.rewards,
                "seconds_at_eval": self.seconds_at_eval, "step_seconds": self.step_seconds}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        synchronize()
        self.step_seconds.append(time.perf_counter() - self.started)
        self.train_seconds += self.step_seconds[-1]
        step, every = state.global_step, self.spec["eval_every"]
        last = step == self.spec["steps"] or self.train_seconds >= self.spec.get("max_seconds", float("inf"))
        if (every and step % every == 0) or step in self.spec.get("eval_steps", ()) or last:
            self.evaluate(model, step, last)
        control.should_training_stop = control.should_training_stop or last

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])


def grpo_trainer(spec: dict, tokenizer, callbacks: list) -> GRPOTrainer:
    """TRL's trainer on the spec's model and data, with the settings matched to hybridrl's (module docstring)."""
    cuda = spec.get("device", "cpu") == "cuda"  # on a GPU TRL's own default: float32 master weights, bf16 autocast
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = read_rows(spec["train_path"])
    train = Dataset.from_dict({"prompt": [row["prompt"] for row in rows], "answer": [row["answer"] for row in rows]})
    batch = spec["prompts_per_step"] * spec["group_size"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"],
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group", temperature=spec["temperature"], top_p=1.0, top_k=0, seed=spec["seed"],
        data_seed=spec["seed"], use_cpu=not cuda, bf16=cuda, logging_steps=1, report_to="none", save_strategy="no",
        use_vllm=False, dataloader_num_workers=0, disable_tqdm=True)
    return GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=train,
                       processing_class=tokenizer, callbacks=callbacks)


def run(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    callback = Evaluate(spec, tokenizer, read_rows(spec["eval_path"])[:spec["max_eval_samples"]])
    grpo_trainer(spec, tokenizer, [callback]).train()
    return callback.result()


def step_check(spec: dict, batch_path: str) -> dict:
    """`learning_step_check.py`'s TRL side: TRL's group advantages (its formula: (r - group mean) / (group std +
    1e-4)), `compute_loss` on hybridrl's batch, and the gradient it back-propagates (no clipping); again with
    hybridrl's 1e-6 in place of 1e-4, so that what remains of the difference is not the epsilon."""
    torch.set_num_threads(spec["threads"])
    batch = torch.load(batch_path)
    trainer = grpo_trainer(spec, AutoTokenizer.from_pretrained(spec["model"]), [])
    scores = batch["scores"].float().view(-1, batch["group_size"])
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this call skips
    trainer.model.train()
    results = {}
    for name, epsilon in (("trl", 1e-4), ("trl_with_hybridrl_epsilon", 1e-6)):  # the second isolates the epsilon
        advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + epsilon)).view(-1)
        inputs = {key: batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        inputs.update(advantages=advantages, num_items_in_batch=batch["completion_mask"].sum())
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results[name] = {"advantages": advantages, "loss": loss.item(), "gradients": {
            key: p.grad.detach().clone() for key, p in trainer.model.named_parameters() if p.grad is not None}}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the run's settings as JSON (written by learning_vs_trl.py)")
    parser.add_argument("--out", required=True, help="where the result JSON (or, with --step-check, .pt) goes")
    parser.add_argument("--step-check", metavar="BATCH", help="learning_step_check.py's batch: one loss and gradient")
    args = parser.parse_args()
    if args.step_check:
        torch.save(step_check(json.loads(args.spec), args.step_check), args.out)
        return
    result = run(json.loads(args.spec))
    with open(args.out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
