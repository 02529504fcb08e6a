"""Packing: sequences into rows without padding, micro-batches by a token budget; same loss and gradients."""

import pytest
import torch
from conftest import tiny_actor
from test_logprobs import padded_batch

from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.packing import first_fit_decreasing, group_by_tokens, pack_rows


def test_first_fit_decreasing_respects_capacity_and_keeps_every_item():
    lengths = [7, 3, 5, 2, 9, 1, 4]
    bins = first_fit_decreasing(lengths, capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 31 tokens need at least 4 bins of 10
    assert group_by_tokens([12, 3], 10) == [[0], [1]]  # an over-long sequence gets its own micro-batch


def test_pack_rows_layout():
    ids, mask, _, response = padded_batch()
    prompt = ids.shape[1] - response
    packed = pack_rows(ids, mask, prompt, capacity=20)
    assert packed.input_ids.shape == (2, 20)  # 37 real tokens of 44: two rows of 20 instead of four of 11
    for row in range(len(ids)):  # every real token appears once, with positions 0.. in its sequence
        assert (packed.input_ids == ids[row][mask[row].bool()][0]).any()
    real_targets = ids[:, prompt:][mask[:, prompt:].bool()]
    assert torch.equal(packed.targets, real_targets)
    flat = packed.input_ids.flatten()
    assert torch.equal(flat[packed.logit_positions + 1], packed.targets)  # each position predicts the next token
    assert (packed.position_ids.flatten()[packed.logit_positions + 1] > 0).all()


def test_packed_rows_do_not_attend_across_sequences():
    """Changing one sequence must not change another's log-probs when they share a packed row."""
    model, _ = tiny_actor()
    ids, mask, positions, response = padded_batch(rows=3, prompt=6, response=6)
    mask[0] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])  # 4 tokens
    mask[1] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0])  # 6 tokens: shares a 12-wide row with row 0
    mask[2] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    assert pack_rows(ids, mask, 6, capacity=12).input_ids.shape[0] == 2
    with torch.no_grad():
        base, _ = response_logprobs(model, ids, mask, positions, response, pack=True)
        changed = ids.clone()
        changed[0][mask[0].bool()] = (changed[0][mask[0].bool()] + 1) % 80 + 3
        other, _ = response_logprobs(model, changed, mask, positions, response, pack=True)
    assert not torch.allclose(base[0], other[0])
    assert torch.allclose(base[1:], other[1:], atol=1e-6)


def test_token_budget_update_matches_padded_micro_batches(tmp_path):
    """Same parameters after one update: micro_batch_size=4 padded vs a token budget with packing (float32,
    atol 1e-6 on parameters after an lr 1e-3 step; loss normalisation comes from the mini-batch)."""
    from test_trainer import make_trainer

    params = []
    for extra in ({"actor__micro_batch_size": 4}, {"actor__max_tokens_per_micro_batch": 40}):
        trainer = make_trainer(tmp_path / str(len(params)), trainer__total_steps=1, actor__lr=1e-3,
                               actor__max_grad_norm=0.0, rollout__max_new_tokens=6, **extra)
        history = trainer.train()
        params.append(torch.cat([p.detach().flatten() for p in trainer.parts.actor.parameters()]))
        assert history[-1]["actor/policy_loss"] == history[-1]["actor/policy_loss"]
    assert torch.allclose(params[0], params[1], atol=1e-6)



def test_host_to_device_on_cpu_is_a_plain_copy():
    from hybridrl.devices import host_to_device

    index = torch.tensor([3, 0, 2])
    assert torch.equal(host_to_device(index, "cpu"), index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_to_device_on_cuda_gives_the_values_after_later_host_writes():
    """The non-blocking copy reads a pinned copy of the source, so changing the source afterwards is safe."""
    from hybridrl.devices import host_to_device

    index = torch.arange(1 << 20)
    moved = host_to_device(index, "cuda")
    index.zero_()
    assert moved.is_cuda and torch.equal(moved.cpu(), torch.arange(1 << 20))
