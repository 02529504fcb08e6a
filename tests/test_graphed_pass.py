"""The update's CUDA graphs (`training/graphed_pass.py`): bucket shapes, the padding a graph's fixed shape needs (the
padded pass equals the unpadded one within rounding: loss, log-probs, gradients), the static gradients, when
`actor.cuda_graphs` turns graphs on, and (GPU) graphed updates against eager ones."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_actor

from hybridrl.config.loading import load_config
from hybridrl.rollout.base import Generation
from hybridrl.training import graphed_pass
from hybridrl.training.batch import build_rollout_batch
from hybridrl.training.graphed_pass import (
    GraphedPass,
    bucket_shape,
    bucket_width,
    build_graphed_pass,
    capture_problem,
    normalizers,
    pad_micro_batch,
    too_large_for_auto,
)
from hybridrl.training.update import actor_pass, mini_batch_normalizers


def test_bucket_widths_are_powers_of_two_and_one_and_a_half_times_them():
    assert [bucket_width(n) for n in (1, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 33, 49, 100)] == \
        [4, 6, 6, 8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 64, 128]
    # response columns to their bucket first, then the whole width (at least 8)
    assert bucket_shape(256, 6, 6) == (256, 12, 6)  # the time-to-accuracy batch: no padding
    assert bucket_shape(256, 7, 5) == (256, 16, 6)
    assert bucket_shape(4, 1, 1) == (4, 8, 4)
    assert bucket_shape(64, 30, 20) == (64, 64, 24)


def random_batch(seed: int, num_prompts: int = 3, samples: int = 2, max_new_tokens: int = 5, max_prompt: int = 5):
    """Prompts of 2 to `max_prompt` tokens, responses of 1 to `max_new_tokens` (the first prompt and the first
    response of those lengths, so the batch's width is known; other rows shorter): a padded batch as a rollout builds
    it, with advantages, a loss mask with holes, sampler and reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max_prompt] + torch.randint(2, max_prompt + 1, (num_prompts - 1,), generator=g).tolist()
    prompts = [torch.randint(3, 60, (length,), generator=g).tolist() for length in lengths]
    generations = []
    for index in range(num_prompts):
        for sample in range(samples):
            length = int(torch.randint(1, max_new_tokens + 1, (1,), generator=g))
            length = max_new_tokens if index == sample == 0 else length
            tokens = torch.randint(3, 60, (length,), generator=g).tolist()
            generations.append(Generation(index, tokens, (-torch.rand(length, generator=g)).tolist(), "stop"))
    batch = build_rollout_batch(prompts, generations, pad_token_id=0, max_new_tokens=max_new_tokens)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.loss_mask = batch.response_mask * (torch.rand(batch.response_mask.shape, generator=g) > 0.2)
    batch.ref_logp = batch.sampler_logp - 0.05 * torch.rand(batch.response_mask.shape, generator=g)
    batch.old_logp = batch.sampler_logp + 0.01
    return batch


def test_padding_puts_the_rows_values_in_place_and_masks_the_rest():
    batch = random_batch(0)
    rows, width = batch.input_ids.shape
    response = batch.response_length
    padded = pad_micro_batch(batch, rows + 2, width + 7, response + 3)
    left = 7 - 3
    assert padded.input_ids.shape == (rows + 2, width + 7) and padded.response_length == response + 3
    assert torch.equal(padded.input_ids[:rows, left:left + width], batch.input_ids)
    assert torch.equal(padded.position_ids[:rows, left:left + width], batch.position_ids)
    assert torch.equal(padded.attention_mask[:rows, left:left + width], batch.attention_mask)
    assert padded.attention_mask[:rows].sum() == batch.attention_mask.sum()  # no real token added
    assert torch.equal(padded.advantages[:rows, :response], batch.advantages)
    assert padded.loss_mask[:, response:].abs().sum() == 0 and padded.loss_mask[rows:].abs().sum() == 0
    assert padded.response_mask[rows:].abs().sum() == 0
    assert torch.equal(padded.input_ids[rows:], padded.input_ids[:1].expand(2, -1))  # added rows attend to something
    assert (padded.position_ids[:rows, width + left:] == batch.position_ids[:, -1:]).all()
    with pytest.raises(ValueError, match="cannot pad a micro-batch"):
        pad_micro_batch(batch, rows, width - 1, response)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("reuse", [True, False])
def test_padded_pass_equals_the_unpadded_one_in_loss_logprobs_and_gradients(aggregation, reuse):
    """float32 on CPU: the padded pass (normalisers as tensors, the mask always kept) gives the unpadded pass's loss,
    log-probs, stats and every parameter's gradient within rounding, with the KL term, the rollout corrections and
    the aggregation's normalisers in play."""
    model, _ = tiny_actor("qwen2")
    config = load_config(None, algorithm__loss_aggregation=aggregation, algorithm__kl_coef=0.1,
                         algorithm__rollout_correction_cap=2.0, algorithm__rollout_sequence_mask_threshold=1.5,
                         algorithm__entropy_coef=0.01)
    batch = random_batch(1)
    norm = mini_batch_normalizers(batch, torch.arange(len(batch)), batch.loss_mask)
    if reuse:
        batch.old_logp = None
    results = []
    for padded in (False, True):
        model.zero_grad(set_to_none=True)
        if padded:
            response = batch.response_length
            shape = bucket_shape(len(batch) + 3, batch.input_ids.shape[1] - response, response)
            part = pad_micro_batch(batch, *shape)
            loss, stats, logp = actor_pass(model, part, normalizers(graphed_pass.normalizer_tensor(norm, "cpu")), 1.0,
                                           config.algorithm, reuse, fixed_shape=True)
            logp = logp[:len(batch), :batch.response_length]
        else:
            loss, stats, logp = actor_pass(model, batch, norm, 1.0, config.algorithm, reuse)
        loss.backward()
        results.append((loss.detach(), stats, logp, [p.grad.clone() for p in model.parameters()]))
    (loss, stats, logp, grads), (padded_loss, padded_stats, padded_logp, padded_grads) = results
    assert torch.allclose(loss, padded_loss, rtol=1e-5, atol=1e-7)
    assert torch.allclose(logp, padded_logp, atol=1e-5)
    assert stats.keys() == padded_stats.keys()
    for key in stats:
        assert torch.allclose(stats[key], padded_stats[key], atol=1e-6), key
    assert any(grad.abs().max() > 0 for grad in grads)
    for grad, padded_grad in zip(grads, padded_grads):
        assert torch.allclose(grad, padded_grad, rtol=1e-4, atol=1e-7)


def test_static_gradients_are_views_of_one_buffer_zeroed_for_a_new_mini_batch_and_keep_eager_ones():
    model, _ = tiny_actor()
    params = list(model.parameters())
    runner = GraphedPass(params, auto=False)
    params[0].grad = torch.full_like(params[0], 3.0)  # an eager micro-batch's gradient, before any graph ran
    runner.attach_gradients()
    assert all(p.grad is g for p, g in zip(params, runner.grads))
    flat = runner.grads[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == flat for g in runner.grads)  # one buffer, parameter order
    assert (params[0].grad == 3.0).all() and all((p.grad == 0).all() for p in params[1:])
    for p in params:
        p.grad.add_(1.0)  # what a pass accumulates
    runner.attach_gradients()  # the same mini-batch: kept
    assert (params[1].grad == 1.0).all()
    model.zero_grad(set_to_none=True)  # the optimizer step ended the mini-batch
    runner.attach_gradients()
    assert all(p.grad is g for p, g in zip(params, runner.grads)) and all((p.grad == 0).all() for p in params)


def test_cuda_graphs_setting_and_the_reasons_it_falls_back(caplog, monkeypatch):
    model, _ = tiny_actor()
    cuda = torch.device("cuda")
    assert capture_problem(load_config(None), model, cuda, 1) is None
    assert "not CUDA" in capture_problem(load_config(None), model, torch.device("cpu"), 1)
    assert "several training processes" in capture_problem(load_config(None), model, cuda, 2)
    for overrides, reason in [({"model__lora_rank": 4}, "LoRA"), ({"model__gradient_checkpointing": True}, "checkpoint"),
                              ({"model__compile": True}, "model.compile"),
                              ({"actor__max_tokens_per_micro_batch": 64}, "packing by tokens"),
                              ({"actor__share_prompt_tokens": True}, "shared prompts")]:
        assert reason in capture_problem(load_config(None, **overrides), model, cuda, 1)
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in capture_problem(load_config(None), model, cuda, 1)
    model.config._attn_implementation = "sdpa"
    assert build_graphed_pass(load_config(None, actor__cuda_graphs=False), model, cuda, 1) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**40))
    assert isinstance(build_graphed_pass(load_config(None, actor__cuda_graphs="auto"), model, cuda, 1), GraphedPass)
    numel = sum(p.numel() for p in model.parameters())
    assert too_large_for_auto(list(model.parameters()), 16 * 4 * numel) is None  # float32 gradients: 1/16 exactly
    assert "would stay allocated through the rollout" in too_large_for_auto(list(model.parameters()), 16 * 4 * numel - 1)
    with caplog.at_level(logging.INFO):
        assert build_graphed_pass(load_config(None, actor__cuda_graphs=True), model, torch.device("cpu"), 1) is None
    assert "the update runs eagerly: the device is not CUDA" in caplog.text
    assert [r.levelname for r in caplog.records if "runs eagerly" in r.message] == ["WARNING"]  # asked for: a warning


def test_auto_leaves_micro_batches_large_enough_to_keep_the_gpu_busy_eager(monkeypatch, caplog):
    model, _ = tiny_actor()
    batch = random_batch(2)
    numel = sum(p.numel() for p in model.parameters())
    rows, width, _ = bucket_shape(8, batch.input_ids.shape[1] - batch.response_length, batch.response_length)
    monkeypatch.setattr(graphed_pass, "AUTO_MAX_PARAMETER_TOKENS", numel * rows * width - 1)  # just below the bucket
    with caplog.at_level(logging.INFO):
        assert GraphedPass(list(model.parameters()), auto=True).run(batch, {}, 8, None) is None
    assert "large enough to keep the GPU busy" in caplog.text


def updates(tmp_path, dtype: torch.dtype, mode: str, num_updates: int = 6, device: str = "cuda"):
    """`num_updates` updates of a tiny Qwen2 over batches of 12 rows (micro-batches of 8 and 4, so the second
    is padded by rows) whose widths differ from update to update, alternating between two buckets (prompts of 3-5
    tokens and responses of 5-6: 12 columns, 6 of response; then 2-4 and 9-10: 16 and 12); `mode`: eager (no graphs),
    graphs, or padded (the graphs' padded pass, never captured). Returns the trainer, the parameters before and after,
    and each update's metrics."""
    from conftest import toy_prompts

    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    actor = tiny_actor("qwen2", hidden_size=64)
    actor.model.to(dtype)
    trainer = RLTrainer(actor=actor, reward_fn=lambda prompts, completions, **_: [0.0] * len(completions),
                        dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16), trainer__device=device,
                        trainer__output_dir=str(tmp_path / mode), logging__sinks=["jsonl"], actor__lr=1e-3,
                        actor__micro_batch_size=8, actor__cuda_graphs=mode != "eager", rollout__backend="hf")
    if device == "cpu" and mode == "padded":  # the setting refuses CPU; the runner's eager padded pass runs there
        trainer.parts.actor_graphs = GraphedPass([p for p in trainer.parts.actor.parameters()], auto=False)
    runner = trainer.parts.actor_graphs
    assert (runner is None) == (mode == "eager")
    if mode == "padded":
        runner.capture = False
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    history = []
    for seed in range(num_updates):
        batch = random_batch(100 + seed, num_prompts=6, samples=2, max_new_tokens=(6, 10)[seed % 2] - seed // 2 % 2,
                             max_prompt=(5, 4)[seed % 2] - seed // 2 % 3).to(device)  # widths vary in a bucket
        batch.old_logp = batch.ref_logp = None  # on-policy: the update's own log-probs are the old ones
        trainer.step_count += 1
        if mode == "graphs" and seed == num_updates - 1:  # captured by now: a replay makes no host sync
            run = runner.run

            def run_without_syncs(*args):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return run(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            runner.run = run_without_syncs
        history.append(trainer.update(batch))
    if device == "cuda":
        torch.cuda.synchronize()
    return trainer, before, [p.detach().clone() for p in trainer.parts.actor.parameters()], history


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_updates_equal_the_padded_eager_ones_bitwise_and_the_eager_ones_within_rounding(tmp_path, dtype):
    """6 updates (optimizer steps between them; two buckets, each met with other true widths): the graphs give the
    padded eager pass's parameters, bit for bit where the capture runs the eager pass's kernels (printed); against the
    unpadded eager update (other matmul shapes, normalisers divided as tensors) the parameters' change agrees within
    rounding, and so do each update's loss, entropy and gradient norm."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runs = {mode: updates(tmp_path, dtype, mode) for mode in ("eager", "graphs", "padded")}
    runner = runs["graphs"][0].parts.actor_graphs
    assert len(runner.graphs) == 2 and list(runner.uses.values()) == [2, 2]  # warm-up, then captured; replays after
    (_, start, eager, eager_history), (_, _, graphs, graph_history), (_, _, padded, _) = (
        runs["eager"], runs["graphs"], runs["padded"])
    bound = 1e-3 if dtype == torch.float32 else 0.1

    def relative_gap(params):  # |params - eager| against the eager update's own size
        change = torch.cat([(a - s).float().flatten() for a, s in zip(eager, start)])
        gap = torch.cat([(a - b).float().flatten() for a, b in zip(params, eager)])
        assert change.norm() > 0
        return (gap.norm() / change.norm()).item(), (gap != 0).float().mean().item()
    bitwise = all(torch.equal(a, b) for a, b in zip(graphs, padded))
    (relative, differing), (padded_relative, _) = relative_gap(graphs), relative_gap(padded)
    print(f"{dtype}: graphs = padded eager bit for bit: {bitwise} (their gaps to eager {relative:.2e} and "
          f"{padded_relative:.2e}); |graphs - eager| / |eager - start| = {relative:.2e}, elements differing {differing:.3f}")
    # bit for bit is expected (the same kernels, printed above); should a capture pick other kernels than the eager
    # pass at that shape, both must still be as close to the eager update as rounding leaves them
    assert relative < bound and (bitwise or padded_relative < bound)
    for eager_row, graph_row in zip(eager_history, graph_history):
        for key in ("actor/grad_norm", "actor/policy_loss", "actor/entropy"):
            assert graph_row[key] == pytest.approx(eager_row[key], rel=1e-3 if dtype == torch.float32 else 2e-2,
                                                   abs=1e-5 if dtype == torch.float32 else 1e-3), key


def test_updates_through_the_padded_pass_equal_eager_ones_within_rounding_on_cpu(tmp_path):
    """The runner's path without capture (padding, static gradients over two micro-batches, unpadding, the reused
    old log-probs) in the real update, float32 on CPU: the parameters after 3 updates and each update's metrics."""
    (_, start, eager, eager_history), (trainer, _, padded, padded_history) = (
        updates(tmp_path, torch.float32, mode, num_updates=3, device="cpu") for mode in ("eager", "padded"))
    change = torch.cat([(a - s).flatten() for a, s in zip(eager, start)])
    gap = torch.cat([(a - b).flatten() for a, b in zip(padded, eager)])
    assert change.norm() > 0 and gap.norm() / change.norm() < 1e-4
    runner = trainer.parts.actor_graphs
    assert sum(runner.uses.values()) == 6 and not runner.graphs  # 3 updates x 2 micro-batches, all eager
    for eager_row, padded_row in zip(eager_history, padded_history):
        for key in ("actor/grad_norm", "actor/policy_loss", "actor/entropy", "actor/clipfrac"):
            assert padded_row[key] == pytest.approx(eager_row[key], rel=1e-4, abs=1e-7), key


def test_a_failed_capture_is_logged_once_and_the_pass_runs_eagerly_from_then_on(monkeypatch, caplog):
    model, _ = tiny_actor()
    config = load_config(None)
    batch = random_batch(3)
    norm = mini_batch_normalizers(batch, torch.arange(len(batch)), batch.loss_mask)
    runner = GraphedPass(list(model.parameters()), auto=False)

    def refuse(*args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(runner, "_capture", refuse)

    def compute(part, norm_values):
        return actor_pass(model, part, norm_values, 1.0, config.algorithm, False, fixed_shape=True)
    with caplog.at_level(logging.WARNING):
        results = [runner.run(batch, norm, 8, compute) for _ in range(3)]
    assert all(result is not None for result in results) and not runner.graphs and not runner.capture
    assert caplog.text.count("capturing the update's pass failed (CUDA error: operation not permitted") == 1
    assert results[0][2].shape == batch.response_mask.shape
    assert torch.equal(results[0][0], results[2][0])  # the same pass, eagerly (the weights did not move)
