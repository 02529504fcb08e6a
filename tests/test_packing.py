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


def test_first_fit_decreasing_equals_the_full_scan():
    """Skipping bins too full for the shortest item changes no assignment: the same bins as scanning every bin."""
    def full_scan(lengths, capacity):
        bins, room = [], []
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            slot = next((s for s, free in enumerate(room) if lengths[index] <= free), None)
            if slot is None:
                bins.append([index])
                room.append(capacity - lengths[index])
            else:
                bins[slot].append(index)
                room[slot] -= lengths[index]
        return bins

    generator = torch.Generator().manual_seed(2)
    for trial in range(40):
        lengths = torch.randint(0 if trial % 5 == 0 else 1, 30, (int(torch.randint(1, 200, (1,), generator=generator)),),
                                generator=generator).tolist()
        for capacity in (10, 29, 64, 1000):
            assert first_fit_decreasing(lengths, capacity) == full_scan(lengths, capacity)


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


def reference_pack(ids, mask, prompt_width, capacity):
    """pack_rows written the obvious way: row by row, sequence by sequence, token by token."""
    lengths = [int(m.sum()) for m in mask]
    bins = first_fit_decreasing(lengths, capacity)
    capacity = max(capacity, max(lengths))
    rows = [[0] * capacity for _ in bins]
    positions = [list(range(capacity)) for _ in bins]
    logit_positions, targets, response_index = [], [], []
    placed = {}
    for row, members in enumerate(bins):
        offset = 0
        for seq in sorted(members):
            placed[seq] = (row, offset)
            real = [int(x) for x, keep in zip(ids[seq], mask[seq]) if keep]
            rows[row][offset:offset + len(real)] = real
            positions[row][offset:offset + len(real)] = range(len(real))
            offset += len(real)
    for seq in range(len(ids)):
        row, offset = placed[seq]
        prompt_length = int(mask[seq, :prompt_width].sum())
        for t in range(int(mask[seq, prompt_width:].sum())):
            logit_positions.append(row * capacity + offset + prompt_length + t - 1)
            targets.append(int(ids[seq, prompt_width + t]))
            response_index.append(seq * (ids.shape[1] - prompt_width) + t)
    return rows, positions, logit_positions, targets, response_index


def test_pack_rows_equals_the_obvious_loop_on_random_batches():
    """Every field of the host-computed layout against `reference_pack`, over random left-padded prompts and
    right-padded responses (some empty), with capacities below, at and above the longest sequence."""
    generator = torch.Generator().manual_seed(5)
    for trial in range(12):
        rows, prompt, response = 3 + trial, 5, 4
        ids = torch.randint(3, 90, (rows, prompt + response), generator=generator)
        prompt_lengths = torch.randint(1, prompt + 1, (rows,), generator=generator)
        response_lengths = torch.randint(0, response + 1, (rows,), generator=generator)
        columns = torch.arange(prompt + response)
        mask = ((columns >= prompt - prompt_lengths[:, None]) & (columns < prompt + response_lengths[:, None])).long()
        for capacity in (4, prompt + response, 2 * (prompt + response) + 1):
            packed = pack_rows(ids, mask, prompt, capacity)
            want_ids, want_positions, want_logits, want_targets, want_index = reference_pack(ids, mask, prompt, capacity)
            assert packed.input_ids.tolist() == want_ids and packed.position_ids.tolist() == want_positions
            assert packed.logit_positions.tolist() == want_logits and packed.targets.tolist() == want_targets
            assert packed.response_index.tolist() == want_index


def test_packing_is_chosen_only_where_it_saves_rows(monkeypatch):
    """With the choice left to it, the log-prob pass packs when at least 1/8 of the tokens are padding AND the
    packed rows are at most 7/8 of the sequences; sequences of similar lengths, one per row either way, stay
    padded (same log-probs as packed, as the other tests show)."""
    import hybridrl.training.logprobs as logprobs

    model, _ = tiny_actor()
    calls = []
    real_pack = logprobs.pack_rows
    monkeypatch.setattr(logprobs, "pack_rows", lambda *a, **k: calls.append(1) or real_pack(*a, **k))
    ids = torch.randint(3, 80, (8, 12))
    similar = torch.ones_like(ids)
    similar[:, -3:] = 0  # 9 of 12 tokens each: a quarter is padding, yet rows of 9 hold one sequence each
    uneven = similar.clone()
    uneven[::2, :5] = 0  # half the sequences have 4 tokens: two share a row of 9, so 6 rows for 8 sequences
    for mask, packs in ((similar, False), (uneven, True)):
        calls.clear()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            chosen, _ = response_logprobs(model, ids * mask, mask, positions, 6)
            padded, _ = response_logprobs(model, ids * mask, mask, positions, 6, pack=False)
        assert bool(calls) == packs
        torch.testing.assert_close(chosen, padded, atol=1e-5, rtol=1e-5)


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
