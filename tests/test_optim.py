"""LeanAdamW: equals torch AdamW on float32 parameters; on bf16 it keeps small updates (stochastic rounding)."""

import pytest
import torch

from hybridrl.training.optim import LeanAdamW, build_optimizer, stochastic_round_to_bf16


def run(optimizer_cls, params, steps=3, **kwargs):
    optimizer = optimizer_cls(params, lr=1e-2, weight_decay=0.1, **kwargs)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
        optimizer.step()
    return params


def test_float32_matches_torch_adamw_also_offloaded_and_chunked():
    start = [torch.randn(7, 5), torch.randn(11)]
    want = run(torch.optim.AdamW, [p.clone().requires_grad_() for p in start])
    for kwargs in ({}, {"offload": True, "chunk_elements": 4}, {"offload": 0.5, "chunk_elements": 4}):
        got = run(LeanAdamW, [p.clone().requires_grad_() for p in start], **kwargs)
        for mine, reference in zip(got, want):
            assert torch.allclose(mine, reference, atol=1e-6)


def test_offload_fraction_keeps_the_first_parameters_resident():
    """`offload=f` puts the last parameters (whole ones) covering f of the elements in CPU memory; every rank
    of a sharded model picks the same ones because the choice uses global sizes in parameter order."""
    params = [torch.zeros(n, requires_grad=True) for n in (50, 30, 20)]
    chosen = lambda fraction: [LeanAdamW(params, offload=fraction).is_offloaded(p) for p in params]  # noqa: E731
    assert chosen(True) == chosen(1.0) == [True, True, True] and chosen(False) == [False, False, False]
    assert chosen(0.5) == [False, True, True]  # 50 resident; 30 more would exceed the 50 allowed
    assert chosen(0.2) == [False, False, True] and chosen(0.1) == [False, False, True]
    with pytest.raises(ValueError, match="fraction in \\[0, 1\\]"):
        LeanAdamW(params, offload=1.5)


def test_phase_switch_leaves_offloaded_moments_in_cpu_memory():
    """`actor.offload_during_rollout` moves optimizer state off and back to the device around a rollout; state
    the optimizer offloads itself must stay in CPU memory, not come back to the device afterwards."""
    from hybridrl.training.phase_switch import move_optimizer_state

    params = [torch.zeros(4, requires_grad=True), torch.zeros(6, requires_grad=True)]
    optimizer = LeanAdamW(params, offload=0.6)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    home = optimizer.state[params[1]]["exp_avg"]
    move_optimizer_state(optimizer, "meta")  # a device other than the CPU, on any machine
    assert optimizer.state[params[1]]["exp_avg"] is home and optimizer.state[params[0]]["exp_avg"].is_meta


def test_bf16_state_is_float32_and_tiny_updates_survive_on_average():
    weight = torch.full((100_000,), 1.0, dtype=torch.bfloat16, requires_grad=True)
    optimizer = build_optimizer([weight], lr=1e-4)  # 1e-4 is far below half a bf16 ulp at 1.0 (3.9e-3)
    assert isinstance(optimizer, LeanAdamW)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    assert optimizer.state[weight]["exp_avg"].dtype == torch.float32
    assert abs(weight.float().mean().item() - (1.0 - 1e-4)) < 2e-5  # unbiased in expectation
    plain = torch.full((10,), 1.0, dtype=torch.bfloat16, requires_grad=True)
    torch_opt = build_optimizer([plain], lr=1e-4, state_dtype="param")
    plain.grad = torch.ones_like(plain)
    torch_opt.step()
    assert torch.equal(plain, torch.ones_like(plain))  # nearest rounding drops the whole update


def test_rounding_noise_is_the_documented_hash_and_uniform():
    """The rounding bits are the high 16 bits of hash32(base + i); the hash is checked against the same
    function on Python ints, and the bits against uniformity (a chi-square test over 16 bins)."""
    from hybridrl.training.optim import counter_noise, hash32

    base = 0xFFFFFF00  # the counter wraps past 2**32 inside this draw
    bits = counter_noise(torch.tensor([base], dtype=torch.int64), 100_000)
    assert bits.dtype == torch.int32 and int(bits.min()) >= 0 and int(bits.max()) < 1 << 16
    assert [int(b) for b in bits[:300]] == [hash32((base + i) & 0xFFFFFFFF) >> 16 for i in range(300)]
    counts = torch.bincount(bits >> 12, minlength=16).double()
    chi_square = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi_square < 40, chi_square  # 15 degrees of freedom: P(chi2 > 40) ~ 5e-4 for uniform bits


def test_bf16_updates_do_not_depend_on_chunking_or_offload():
    """The rounding counter of an element is its place among all parameters, so concatenating small
    parameters into one update, cutting large ones into chunks, and offloading moments all give the same
    bits; the small parameters really share updates (calls counted)."""
    import hybridrl.training.optim as optim

    start = [torch.randn(7, 50), torch.randn(301), torch.randn(3), torch.randn(5, 4), torch.randn(20)]
    bf16 = [p.to(torch.bfloat16) for p in start]
    calls, plain = [], optim.chunk_update_function
    counting = lambda device: (lambda *args: calls.append(args[0].numel()) or plain(device)(*args))  # noqa: E731
    optim.chunk_update_function = counting
    try:
        results = {str(kwargs): run(LeanAdamW, [p.clone().requires_grad_() for p in bf16], **kwargs)
                   for kwargs in ({}, {"chunk_elements": 64}, {"offload": True, "chunk_elements": 64},
                                  {"offload": 0.5, "chunk_elements": 100})}
    finally:
        optim.chunk_update_function = plain
    first = results["{}"]
    assert all(torch.equal(a, b) for got in results.values() for a, b in zip(got, first))
    assert calls[:1] == [sum(p.numel() for p in start)]  # default chunks: all five parameters in one update
    assert not torch.equal(first[1], bf16[1])  # the step did change the weights


def test_stochastic_round_is_exact_on_representable_values():
    values = torch.tensor([1.0, -2.5, 0.0, 3.140625])
    assert torch.equal(stochastic_round_to_bf16(values), values.to(torch.bfloat16))


def test_eight_bit_adamw_trains_through_the_trainer(tmp_path):
    """`actor.optimizer_8bit`: bitsandbytes' AdamW8bit (it has CPU kernels; 0.50.2 checked) moves every
    trainable tensor through the trainer and keeps uint8 moments for large tensors."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'hybridrl[bitsandbytes]')")
    from conftest import contains_seven, tiny_actor, toy_prompts

    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, trainer__total_steps=2,
                        trainer__prompts_per_step=8, rollout__num_samples_per_prompt=4, rollout__max_new_tokens=4,
                        actor__lr=1e-3, actor__optimizer_8bit=True, trainer__output_dir=str(tmp_path),
                        trainer__save_model=False, logging__sinks=["jsonl"])
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    trainer.train()
    assert type(trainer.parts.actor_optimizer).__name__ == "AdamW8bit"
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters()))
    # The tiny model's tensors are under bitsandbytes' 4096-element minimum, so their state is 32-bit;
    # a larger tensor gets 8-bit moments.
    big = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = build_optimizer([big], lr=1e-3, eight_bit=True)
    big.grad = torch.randn_like(big)
    optimizer.step()
    assert optimizer.state[big]["state1"].dtype == torch.uint8


def test_missing_bitsandbytes_is_one_sentence_from_the_cli(tmp_path, monkeypatch, capsys):
    """A setting whose optional package is absent ends the command with one line naming what to install."""
    import json
    import sys

    from conftest import toy_prompts

    from hybridrl.cli import main

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in toy_prompts()))
    (tmp_path / "config.yaml").write_text("{}\n")
    code = main(["train", str(tmp_path / "config.yaml"), f"data.train_path={tmp_path / 'prompts.jsonl'}",
                 "reward.functions=[{fn: exact_match}]", "trainer.device=cpu", "actor.optimizer_8bit=true",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=1"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and error[-1].startswith("error: actor.optimizer_8bit needs bitsandbytes")
    assert "Traceback" not in "\n".join(error)


def test_fused_chunk_update_equals_torch_adamw_formula_in_place():
    """`adamw_chunk` (what LeanAdamW runs per chunk; on CUDA as the Triton kernel) on float32 equals torch's AdamW
    step written out by hand, and updates the moments in place."""
    from hybridrl.training.optim import adamw_chunk

    generator = torch.Generator().manual_seed(1)
    weights, grad = torch.randn(50, generator=generator), torch.randn(50, generator=generator)
    m, v = torch.randn(50, generator=generator), torch.rand(50, generator=generator)
    lr, beta1, beta2, eps, decay, step = 1e-2, 0.9, 0.99, 1e-8, 0.1, 3
    c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
    want_m, want_v = beta1 * m + (1 - beta1) * grad, beta2 * v + (1 - beta2) * grad * grad
    want = weights * (1 - lr * decay) - lr / c1 * want_m / (want_v.sqrt() / c2 ** 0.5 + eps)
    got = adamw_chunk(weights, grad, m, v, None, torch.tensor([lr, beta1, beta2, eps, decay, c1, c2, 1.0, 1.0]))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m, want_m)
    torch.testing.assert_close(v, want_v)
    # apply = 0 (the step skipped on the device): weights and moments exactly unchanged, even with NaN gradients
    m_before, v_before, bf16 = m.clone(), v.clone(), weights.to(torch.bfloat16)
    grad[3] = float("nan")
    skipped = adamw_chunk(bf16, grad, m, v, torch.tensor([12345]), torch.tensor([lr, beta1, beta2, eps, decay, c1, c2, 0.0, 1.0]))
    assert torch.equal(skipped, bf16) and torch.equal(m, m_before) and torch.equal(v, v_before)


@pytest.mark.gpu
def test_cuda_kernel_and_streamed_offload_equal_cpu():
    """On CUDA the chunk update is the Triton kernel (`adamw_kernel.py`) and offloaded moments stream through two copy streams: float32
    results equal the eager CPU optimizer; bf16 results of resident and offloaded moments are identical
    (same rounding noise), with chunks smaller than the tensors so the pipeline has several stages, and
    small tensors sharing a staging group."""
    start = [torch.randn(7, 50), torch.randn(301), torch.randn(3), torch.randn(5, 4), torch.randn(20)]
    want = run(LeanAdamW, [p.clone().requires_grad_() for p in start])
    for kwargs in ({}, {"offload": True, "chunk_elements": 64}, {"offload": 0.5, "chunk_elements": 64}):
        got = run(LeanAdamW, [p.cuda().requires_grad_() for p in start], **kwargs)
        for mine, reference in zip(got, want):
            torch.testing.assert_close(mine.cpu(), reference, atol=1e-6, rtol=1e-5)
    bf16 = [p.to(torch.bfloat16) for p in start]
    resident = run(LeanAdamW, [p.cuda().requires_grad_() for p in bf16], chunk_elements=64)
    streamed = run(LeanAdamW, [p.cuda().requires_grad_() for p in bf16], offload=True, chunk_elements=64)
    partly = run(LeanAdamW, [p.cuda().requires_grad_() for p in bf16], offload=0.5, chunk_elements=64)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(resident, streamed, partly))



def test_moments_allocated_together_update_in_place_with_the_same_bits():
    """The first step lays the moments of all resident parameters end to end in one buffer per slot, so a bucket of
    small parameters updates them through one view, in place; the weights and moments equal those of moments
    kept apart (here: cloned after the first step, so every later bucket concatenates and copies back)."""
    from hybridrl.training.optim import _end_to_end_view

    start = [torch.randn(7, 50), torch.randn(301), torch.randn(3), torch.randn(5, 4), torch.randn(20)]
    for dtype in (torch.float32, torch.bfloat16):
        together = [p.to(dtype, copy=True).requires_grad_() for p in start]
        apart = [p.to(dtype, copy=True).requires_grad_() for p in start]
        optimizers = [LeanAdamW(params, lr=1e-2, weight_decay=0.1, chunk_elements=400) for params in (together, apart)]
        generator = torch.Generator().manual_seed(0)
        for step in range(3):
            grads = [torch.randn(p.shape, generator=generator).to(dtype) for p in start]
            for optimizer, params in zip(optimizers, (together, apart)):
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                optimizer.step()
            if step == 0:
                states = [optimizers[0].state[p] for p in together]
                pointers = [s["exp_avg"].data_ptr() for s in states]
                assert _end_to_end_view([s["exp_avg"].view(-1) for s in states]) is not None
                for p in apart:  # moments apart from here on
                    state = optimizers[1].state[p]
                    state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
                assert _end_to_end_view([optimizers[1].state[p]["exp_avg"].view(-1) for p in apart]) is None
        assert [optimizers[0].state[p]["exp_avg"].data_ptr() for p in together] == pointers  # updated in place
        for a, b in zip(together, apart):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizers[0].state[a][key], optimizers[1].state[b][key])


def test_cached_memory_goes_back_only_when_the_device_is_short(monkeypatch):
    """A phase switch empties the allocator's cache when less than a quarter of the device is free (CUDA faked:
    the decision is what is checked), keeps it otherwise, and does nothing on the CPU."""
    from hybridrl.devices import release_cached_memory

    calls, free = [], {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 100))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    free["bytes"] = 60
    assert not release_cached_memory("cuda") and calls == []
    free["bytes"] = 24
    assert release_cached_memory("cuda") and calls == ["empty"]
    assert not release_cached_memory("cpu") and calls == ["empty"]


def test_clipping_inside_the_update_equals_clip_grad_norm(device="cpu"):
    """`update.clip_and_step` hands LeanAdamW the clipping coefficient instead of scaling the gradients first: the
    same weights and moments, bit for bit, as torch's clip_grad_norm_ then a step (bf16 and float32, the norm
    above and below the limit, no limit)."""
    from hybridrl.training.update import clip_and_step

    generator = torch.Generator().manual_seed(4)
    start = [torch.randn(40, 30, generator=generator).to(device), torch.randn(301, generator=generator).to(device)]
    for dtype in (torch.bfloat16, torch.float32):
        for max_norm in (0.5, 1e4, 0.0):
            mine = [p.to(dtype, copy=True).requires_grad_() for p in start]
            theirs = [p.to(dtype, copy=True).requires_grad_() for p in start]
            optimizers = [LeanAdamW(params, lr=1e-2, weight_decay=0.1, chunk_elements=500) for params in (mine, theirs)]
            for _ in range(2):
                grads = [torch.randn(p.shape, generator=generator).to(device, dtype) for p in start]
                for p, g in zip(mine, grads):
                    p.grad = g.clone()
                norm, loss = clip_and_step(mine, optimizers[0], max_norm, torch.tensor(0.5, device=device))
                for p, g in zip(theirs, grads):
                    p.grad = g.clone()
                want = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm > 0 else float("inf"))
                optimizers[1].step()
                assert norm == want.item() and loss == 0.5
            for a, b in zip(mine, theirs):
                assert torch.equal(a, b), (dtype, max_norm)
                assert torch.equal(optimizers[0].state[a]["exp_avg"], optimizers[1].state[b]["exp_avg"])


@pytest.mark.gpu
def test_clipping_inside_the_update_on_cuda():
    """The same on CUDA: the Triton kernel's rounding of the scaled gradient against torch's CUDA `mul_`."""
    test_clipping_inside_the_update_equals_clip_grad_norm("cuda")


def test_noise_bases_are_16_byte_aligned():
    """Every bucket's rounding counter start sits at a 16-byte boundary, so the update kernel sees one pointer
    alignment (one Triton build), whatever the bucket's place."""
    from hybridrl.training.optim import _attach_noise_bases, _Bucket, _Piece

    buckets = [_Bucket(_Piece(*(torch.zeros(4) for _ in range(4)), 4 * i), torch.zeros(9), 7) for i in range(5)]
    _attach_noise_bases(buckets, torch.device("cpu"))
    assert [b.noise_base.data_ptr() % 16 for b in buckets] == [0] * 5
    assert [int(b.noise_base) for b in buckets] == [7 + 4 * i for i in range(5)]
