"""Supervised fine-tuning on prompt/response pairs, or on conversations with tool calls (a `messages` column,
tokenized as rollouts are: `data/conversations.py`); the loss is on response (assistant) tokens only.

A policy has to start somewhere: `hybridrl sft` turns a base (or tiny random) model into one that
answers in the task's format, which RL then improves. Same config file format as `train`. With
`data.eval_path` set, the held-out loss (where the data has responses) and greedy exact-match accuracy
(where it has `data.answer_key`) are logged every `trainer.eval_every` steps and at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridrl.checkpoint.run_lock import lock_owner, output_dir_lock
from hybridrl.config.schema import Config, ConfigError
from hybridrl.data.conversations import MESSAGES_KEY, sft_dataset
from hybridrl.data.datasets import DataError, PromptDataset, collate_sft, read_records
from hybridrl.metrics.sinks import MetricsLogger
from hybridrl.metrics.summary import run_summary
from hybridrl.models.loading import enable_activation_checkpointing, load_hf_model, save_hf_model
from hybridrl.training.components import resolve_device, seed_everything
from hybridrl.training.evaluation import greedy_accuracy, sft_eval_loss
from hybridrl.training.optim import build_optimizer, build_scheduler


def run_sft(config: Config) -> Path:
    """Train with cross-entropy on responses; saves a Hugging Face directory and returns its path. The output
    directory is locked for the run (`checkpoint/run_lock.py`)."""
    with output_dir_lock(config.trainer.output_dir, enabled=lock_owner()):
        return _train(config)


def _train(config: Config) -> Path:
    device = resolve_device(config.trainer.device)
    seed_everything(config.trainer.seed)
    if not config.data.train_path:
        raise ConfigError("data.train_path is empty; point it at a .jsonl/.csv/.parquet file with prompt and response columns.")
    m, s = config.model, config.sft
    model, tokenizer = load_hf_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                                     trust_remote_code=m.trust_remote_code, device=device,
                                     tokenizer_path=m.tokenizer_path, seed=config.trainer.seed)
    if m.gradient_checkpointing:
        enable_activation_checkpointing(model)
    dataset = sft_dataset(config, tokenizer, config.data.train_path)
    steps_per_epoch = len(dataset) // s.batch_size or 1
    total = steps_per_epoch * s.num_epochs if not s.max_steps else min(s.max_steps, steps_per_epoch * s.num_epochs)
    optimizer = build_optimizer(model.parameters(), s.lr, weight_decay=0.0,
                                master_weights=config.actor.master_weights == "float32")
    scheduler = build_scheduler(optimizer, "cosine", s.warmup_steps, total)
    output_dir = Path(config.trainer.output_dir)
    logger = MetricsLogger(output_dir, config.logging.sinks, total, log_every=max(1, total // 20))
    generator = torch.Generator().manual_seed(config.trainer.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    evaluate = held_out_evaluation(config, model, tokenizer, pad_id)
    if evaluate:
        logger.log(0, evaluate())  # the start of the summary's before -> after
    model.train()
    step, start = 0, time.time()
    while step < total:
        for indices in torch.randperm(len(dataset), generator=generator).split(s.batch_size):
            if step >= total or len(indices) < s.batch_size:
                break
            batch = {k: v.to(device) for k, v in collate_sft([dataset[i] for i in indices.tolist()], pad_id).items()}
            loss = model(**batch).loss
            if not torch.isfinite(loss):
                raise ConfigError(f"the SFT loss became {loss.item()} at step {step + 1}; lower sft.lr.")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            logger.log(step, {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/lr": scheduler.get_last_lr()[0],
                              "timing/elapsed_s": time.time() - start})
            if evaluate and config.trainer.eval_every and step % config.trainer.eval_every == 0 and step < total:
                logger.log(step, evaluate())
    if evaluate:
        logger.log(step, evaluate())
    logger.close()
    save_hf_model(model, tokenizer, output_dir / "model")
    print(run_summary(logger.history, time.time() - start, output_dir, output_dir / "model", "SFT"), flush=True)
    return output_dir / "model"


def held_out_evaluation(config: Config, model: torch.nn.Module, tokenizer, pad_id: int):
    """A function returning the held-out metrics of `data.eval_path` for the model as it is now, or None
    without an eval set. The loss needs a response column, the accuracy `data.answer_key`; each is left out
    where the data lacks its column, and data with neither is refused before training starts. Conversations (a
    `messages` column) get the loss only: one greedy turn is not how a multi-turn episode answers."""
    if not config.data.eval_path:
        return None
    d, s = config.data, config.sft
    columns = {key for row in read_records(d.eval_path) for key in row}
    losses = sft_dataset(config, tokenizer, d.eval_path) if columns & {d.response_key, MESSAGES_KEY} else None
    prompts = None if MESSAGES_KEY in columns else PromptDataset(
        d.eval_path, tokenizer, prompt_key=d.prompt_key, max_length=d.max_prompt_length,
        prompt_template=d.prompt_template, use_chat_template=d.use_chat_template, shuffle=False)
    if losses is None and d.answer_key not in columns:
        raise DataError(f"data.eval_path {d.eval_path!r} has neither a '{d.response_key}' column (for the held-out "
                        f"loss) nor a '{d.answer_key}' column (for accuracy); add one, or set data.response_key / "
                        "data.answer_key to the columns it has.")
    shortest = min((len(item["prompt_ids"]) for item in prompts), default=0) if prompts is not None else 0
    max_new_tokens = max(1, s.max_length - shortest)

    def evaluate() -> dict[str, float]:
        was_training = model.training
        model.eval()
        metrics = {}
        if losses is not None:
            metrics["eval/loss"] = sft_eval_loss(model, losses, pad_id, s.batch_size)
        accuracy = greedy_accuracy(model, tokenizer, prompts, d.answer_key, max_new_tokens,
                                   d.max_eval_samples) if prompts is not None else None
        if accuracy is not None:
            metrics["eval/accuracy"] = accuracy
        model.train(was_training)
        return metrics

    return evaluate

