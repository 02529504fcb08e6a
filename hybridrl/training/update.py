"""PPO-style update epochs: shuffled mini-batches (one optimizer step each), split into micro-batches.

Micro-batch losses are normalised by the whole mini-batch (its token count, its number of sequences,
the rollout's response length), so accumulating their gradients gives exactly the mini-batch's loss,
however the mini-batch is split. That is what lets `actor.max_tokens_per_micro_batch` regroup a
mini-batch by real (unpadded) tokens, first-fit decreasing, instead of a fixed sequence count; the
log-prob pass then packs each micro-batch's sequences into rows (`packing.py`).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from hybridrl import algorithms
from hybridrl.config.schema import Config
from hybridrl.devices import host_to_device
from hybridrl.parallel import fsdp, process_group, sharding
from hybridrl.training.batch import RolloutBatch
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.optim import LeanAdamW
from hybridrl.training.packing import group_by_tokens
from hybridrl.training.shared_prompt import PromptLayout, prompt_groups


class TrainingError(RuntimeError):
    """The run cannot continue safely (e.g. a NaN loss); weights were left as they were."""


def mini_batches(batch_size: int, mini_size: int, micro_size: int, epochs: int, generator: torch.Generator,
                 groups: list[list[int]] | None = None) -> Iterator[list[torch.Tensor]]:
    """For each epoch, a fresh permutation cut into mini-batches, each a list of micro-batch indices.
    `groups` (the rows of each prompt) are permuted as wholes, so mini-batches hold whole prompts where
    mini_size allows (as verl's GRPO mini-batches do): shared prompts then save in every mini-batch."""
    for _ in range(epochs):
        if groups is None:
            order = torch.randperm(batch_size, generator=generator)
        else:
            order = torch.tensor([row for g in torch.randperm(len(groups), generator=generator).tolist()
                                  for row in groups[g]], dtype=torch.long)
        for mini in order.split(mini_size):
            yield list(mini.split(micro_size))


def prompt_units(batch: RolloutBatch, rows: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """`rows` grouped by the prompt they answer (positions into `rows`) and each group's tokens with the
    prompt counted once: what one shared-prompt pass computes for it (`shared_prompt.py`)."""
    mask = batch.attention_mask[rows.to(batch.attention_mask.device)]
    lengths = mask.sum(1).tolist()
    prompt_lengths = mask[:, :mask.shape[1] - batch.response_length].sum(1).tolist()
    units = prompt_groups(batch.prompt_index[rows.to(batch.prompt_index.device)].tolist())
    return units, [sum(lengths[i] for i in unit) - (len(unit) - 1) * prompt_lengths[unit[0]] for unit in units]


def shard_by_prompt(batch: RolloutBatch, rows: torch.Tensor, setup, equal_rows: bool = False) -> torch.Tensor:
    """This rank's share of `rows` with each prompt's rows on one rank (balanced by shared-prompt tokens),
    so no prompt is computed on two ranks. Row sharding (`sharding.shard_rows`) where there are fewer
    prompts than ranks, or where `equal_rows` (fixed micro-batch counts) and the prompts do not split evenly."""
    if not setup.is_distributed:
        return rows
    units, costs = prompt_units(batch, rows)
    if len(units) >= setup.world_size:
        parts = [[i for u in part for i in units[u]] for part in sharding.balanced_partition(costs, setup.world_size)]
        if not equal_rows or len({len(part) for part in parts}) == 1:
            return rows[sorted(parts[setup.rank])]
    return sharding.shard_rows(rows, batch.attention_mask.sum(1), setup)


def regroup_by_tokens(batch: RolloutBatch, micros: list[torch.Tensor], max_tokens: int,
                      share_prompts: bool = False) -> list[torch.Tensor]:
    """The mini-batch's micro-batches as given, or (max_tokens > 0) regrouped to at most max_tokens real tokens.
    `share_prompts`: the rows of one prompt stay together and count its tokens once (`shared_prompt.py`)."""
    if max_tokens <= 0:
        return micros
    mini = torch.cat(micros)
    if not share_prompts:
        lengths = batch.attention_mask[mini.to(batch.attention_mask.device)].sum(1).tolist()
        return [mini[group] for group in group_by_tokens(lengths, max_tokens)]
    units, costs = prompt_units(batch, mini)
    return [mini[sorted(i for u in group for i in units[u])] for group in group_by_tokens(costs, max_tokens)]


def mini_batch_normalizers(batch: RolloutBatch, mini: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What `algorithms.aggregate_loss` divides by, taken from the whole mini-batch; `mask` (B, R) is the
    loss's token mask. At least one token, so a mini-batch whose tokens are all masked adds zero, not NaN."""
    return {"num_tokens": max(1.0, mask[mini].sum().item()), "num_sequences": len(mini),
            "max_length": batch.response_length}


def check_finite(loss: float, what: str, step: int, hint: str) -> None:
    if not math.isfinite(loss):
        raise TrainingError(f"the {what} became {loss} at step {step}, so the update was skipped and the "
                            f"weights are unchanged; {hint}")


def clip_and_step(parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float,
                  loss: torch.Tensor) -> tuple[float, float]:
    """Clip, then step unless the gradient norm or `loss` is not finite (the weights then stay as they were);
    returns the norm and the loss. With `LeanAdamW` the skip is a flag on the device, so the host queues the step
    behind the backward pass instead of waiting for it (the GPU otherwise idled through the optimizer's set-up),
    and both values come back in one read once the step is queued."""
    limit = max_norm if max_norm > 0 else float("inf")
    lean = isinstance(optimizer, LeanAdamW)
    if lean:  # clip_grad_norm_ in two halves: the norm, and its coefficient applied inside the optimizer's update
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, limit)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor
    loss = loss.detach().to(device=norm.device, dtype=torch.float32)
    finite = torch.isfinite(norm) & torch.isfinite(loss)
    if lean:  # clip_grads_with_norm_'s coefficient, without a pass of its own over every gradient
        optimizer.step(apply=finite, grad_scale=torch.clamp(limit / (norm + 1e-6), max=1.0))
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    norm_value, loss_value = torch.stack([norm.float(), loss]).tolist()
    if lean and not (math.isfinite(norm_value) and math.isfinite(loss_value)):
        optimizer.uncount_step()
    return norm_value, loss_value


def with_backward(micro_loss):
    """`micro_loss(part, norm, rows) -> (loss, stats)` as a micro-step for `run_epochs`: the loss's backward, then
    the loss detached and the stats."""
    def micro_step(part: RolloutBatch, norm: dict[str, float], rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss, stats = micro_loss(part, norm, rows)
        loss.backward()
        return loss.detach(), stats
    return micro_step


def run_epochs(parts, config: Config, batch: RolloutBatch, generator: torch.Generator, micro_step,
               model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
               loss_name: str, check_loss, loss_mask: torch.Tensor | None = None,
               share_prompts: bool = False) -> dict[str, float]:
    """Shuffled mini-batches (one optimizer step each) over `ppo_epochs`, gradients accumulated over
    micro-batches. `micro_step(part, norm, rows) -> (detached loss, stats)` runs a micro-batch's forward and
    backward (`with_backward`), with stats that are means over the loss's tokens; returns them averaged over every rank's loss tokens (so they do not depend on how the batch was
    cut into micro-batches or ranks), and the loss and gradient norm summed within a mini-batch and averaged
    over mini-batches.

    Nothing here waits for the device inside a mini-batch: losses and stats are summed as tensors and
    `check_loss(mini-batch loss)` (which raises on NaN/inf) runs once, on the loss read back with the gradient
    norm after the optimizer step is queued; that step is a no-op when the loss is not finite, so a bad loss
    still leaves the weights unchanged."""
    act = config.actor
    params = [p for p in model.parameters() if p.requires_grad]
    gather_once = not config.trainer.fsdp_reshard_every_micro_batch
    sums: dict[str, torch.Tensor] = {}  # stat * loss tokens, summed over micro-batches
    per_mini: dict[str, float] = {}
    num_minis = 0
    token_mask = batch.response_mask if loss_mask is None else loss_mask
    tokens = torch.zeros((), dtype=torch.float32, device=token_mask.device)
    groups = prompt_groups(batch.prompt_index.tolist()) if share_prompts else None
    for micros in mini_batches(len(batch), act.mini_batch_size or len(batch), act.micro_batch_size,
                               act.ppo_epochs, generator, groups):
        mini = torch.cat(micros)
        norm = mini_batch_normalizers(batch, mini, token_mask)
        if share_prompts:  # then regrouped by tokens, and the micro-batch counts matched below
            micros = list(shard_by_prompt(batch, mini, parts.setup).split(len(micros[0])))
        else:
            micros = sharding.shard_micro_batches(micros, batch.attention_mask.sum(1), parts.setup)
        micros = regroup_by_tokens(batch, micros, act.max_tokens_per_micro_batch, share_prompts)
        micros = sharding.match_micro_batch_count(micros, parts.setup)
        mini_loss = None
        with fsdp.gathered_for_micro_batches(model, gather_once):
            for index, micro in enumerate(micros):
                fsdp.sync_gradients(model, index == len(micros) - 1, gather_once)
                loss_value, stats = micro_step(batch.select(micro), norm, micro)
                loss_value = loss_value.float()
                mini_loss = loss_value if mini_loss is None else mini_loss + loss_value.to(mini_loss.device)
                weight = token_mask[host_to_device(micro, token_mask.device)].sum().float()
                tokens = tokens + weight
                for key, value in stats.items():
                    value = torch.as_tensor(value, dtype=torch.float32, device=tokens.device).detach() * weight
                    sums[key] = sums[key] + value if key in sums else value
        grad_norm, loss_value = clip_and_step(params, optimizer, max_grad_norm, mini_loss)  # no-op if not finite
        check_loss(loss_value)
        per_mini[loss_name] = per_mini.get(loss_name, 0.0) + loss_value
        per_mini["grad_norm"] = per_mini.get("grad_norm", 0.0) + grad_norm
        num_minis += 1
    totals = process_group.all_reduce(torch.stack([*sums.values(), tokens]), parts.setup).tolist()
    return {**{key: total / max(totals[-1], 1e-8) for key, total in zip(sums, totals)},
            **{key: value / num_minis for key, value in per_mini.items()}}


def actor_pass(actor: torch.nn.Module, part: RolloutBatch, norm: dict, temperature: float, a, reuse_old_logp: bool,
               **logprob_options) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The policy loss of a micro-batch (`a`: `config.algorithm`), its detached stats and the detached log-probs
    (B, R). `reuse_old_logp`: the old log-probs are these log-probs (on-policy, `actor.reuse_logprobs_on_policy`).
    `logprob_options` go to `response_logprobs`. Free of host syncs with `fixed_shape=True`: what a CUDA graph of the
    pass captures (`graphed_pass.py`)."""
    logp, entropy = response_logprobs(actor, part.input_ids, part.attention_mask, part.position_ids,
                                      part.response_length, temperature, with_entropy=True, **logprob_options)
    mask = part.response_mask if part.loss_mask is None else part.loss_mask
    old_logp = logp.detach() if reuse_old_logp else part.old_logp
    loss, stats = algorithms.policy_loss(
        logp, old_logp, part.advantages, mask, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high,
        dual_clip=a.dual_clip, aggregation=a.loss_aggregation, ratio_level=a.ratio_level,
        sampler_logp=part.sampler_logp, correction_cap=a.rollout_correction_cap, loss_type=a.policy_loss,
        sapo_temperatures=(a.sapo_temperature_positive, a.sapo_temperature_negative),
        sequence_mask_threshold=a.rollout_sequence_mask_threshold, **norm)
    entropy_term = algorithms.aggregate_loss(entropy, mask, a.loss_aggregation, **norm)
    loss = loss - a.entropy_coef * entropy_term
    stats = {**stats, "entropy": algorithms.masked_mean(entropy.detach(), mask)}
    if part.ref_logp is not None and not a.kl_in_reward:
        kl = algorithms.kl_penalty(logp, part.ref_logp, a.kl_estimator)
        loss = loss + a.kl_coef * algorithms.aggregate_loss(kl, mask, a.loss_aggregation, **norm)
    if part.ref_logp is not None:
        stats["kl"] = algorithms.masked_mean(algorithms.kl_penalty(logp.detach(), part.ref_logp, a.kl_estimator), mask)
    return loss, stats, logp.detach()


def update_actor(parts, config: Config, batch: RolloutBatch, generator: torch.Generator, step: int) -> dict[str, float]:
    """Policy-gradient epochs over the rollout batch; returns averaged `actor/*` metrics. Micro-batches run through
    the actor's CUDA graphs where `actor.cuda_graphs` built them (`parts.actor_graphs`), else eagerly."""
    a = config.algorithm
    # On-policy (compute_logprobs skipped the old-policy pass): each row's old log-probs are its own
    # detached log-probs in the one update pass; kept to fill batch.old_logp for the rollout metrics.
    reused = torch.zeros_like(batch.response_mask, dtype=torch.float32) if batch.old_logp is None else None
    lengths = batch.attention_mask.sum(1).tolist()  # on the host once, so micro-batches need no device sync
    share = config.actor.share_prompt_tokens
    layout = PromptLayout.of(batch.attention_mask, batch.input_ids.shape[1] - batch.response_length,
                             batch.prompt_index.tolist()) if share else None
    temperature, graphs = batch.sampling.temperature, getattr(parts, "actor_graphs", None)
    rows_per_micro = min(config.actor.micro_batch_size, config.actor.mini_batch_size or len(batch))

    def graphed(part: RolloutBatch, norm: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
        return actor_pass(parts.actor, part, norm, temperature, a, reused is not None, fixed_shape=True)

    def micro_step(part: RolloutBatch, norm: dict[str, float], rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        result = graphs.run(part, norm, rows_per_micro, graphed) if graphs is not None else None
        if result is None:
            loss, stats, logp = actor_pass(parts.actor, part, norm, temperature, a, reused is not None,
                                           real_tokens=sum(lengths[row] for row in rows.tolist()),
                                           prompt_layout=layout.select(rows.tolist()) if share else None)
            loss.backward()
            result = loss.detach(), stats, logp
        loss, stats, logp = result
        if reused is not None:
            reused[host_to_device(rows, reused.device)] = logp.float()
        return loss, stats

    def check_loss(loss: float) -> None:
        check_finite(loss, "actor loss", step, "lower actor.lr, check rewards, or raise actor.max_grad_norm clipping.")

    metrics = run_epochs(parts, config, batch, generator, micro_step, parts.actor, parts.actor_optimizer,
                         config.actor.max_grad_norm, "policy_loss", check_loss, batch.loss_mask, share_prompts=share)
    if reused is not None:
        batch.old_logp = process_group.all_reduce(reused, parts.setup)  # ranks hold disjoint rows
    parts.actor_scheduler.step()
    metrics = {f"actor/{key}": value for key, value in metrics.items()}
    metrics["actor/lr"] = parts.actor_scheduler.get_last_lr()[0]
    return process_group.reduce_metrics(metrics, parts.setup, sum_keys=["actor/policy_loss"])


def update_critic(parts, config: Config, batch: RolloutBatch, generator: torch.Generator) -> dict[str, float]:
    """Clipped value regression towards the GAE returns, with the actor's batch shapes."""
    a = config.algorithm

    def micro_loss(part: RolloutBatch, norm: dict[str, float], rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        values = parts.critic(part.input_ids, part.attention_mask, part.position_ids)[:, -part.response_length - 1:-1]
        loss, stats = algorithms.value_loss(values, part.old_values, part.returns, part.response_mask,
                                            clip_range=a.value_clip, aggregation=a.loss_aggregation, **norm)
        return loss, {**stats, "values_mean": algorithms.masked_mean(values.detach(), part.response_mask)}

    def check_loss(loss: float) -> None:
        check_finite(loss, "critic loss", 0, "lower critic.lr or check rewards.")

    metrics = run_epochs(parts, config, batch, generator, with_backward(micro_loss), parts.critic,
                         parts.critic_optimizer, config.critic.max_grad_norm, "value_loss", check_loss)
    parts.critic_scheduler.step()
    metrics = {f"critic/{key}": value for key, value in metrics.items()}
    return process_group.reduce_metrics(metrics, parts.setup, sum_keys=["critic/value_loss"])
