"""LeanAdamW: equals torch AdamW on float32 parameters; on bf16 it keeps small updates (stochastic rounding)."""

import torch

from hybridrl.optim import LeanAdamW, build_optimizer, stochastic_round_to_bf16


def run(optimizer_cls, params, steps=3, **kwargs):
    optimizer = optimizer_cls(params, lr=1e-2, weight_decay=0.1, **kwargs)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()
    return params


def test_float32_matches_torch_adamw_also_offloaded_and_chunked():
    start = [torch.randn(7, 5), torch.randn(11)]
    want = run(torch.optim.AdamW, [p.clone().requires_grad_() for p in start])
    for kwargs in ({}, {"offload": True, "chunk_elements": 4}):
        got = run(LeanAdamW, [p.clone().requires_grad_() for p in start], **kwargs)
        for mine, reference in zip(got, want):
            assert torch.allclose(mine, reference, atol=1e-6)


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


def test_stochastic_round_is_exact_on_representable_values():
    values = torch.tensor([1.0, -2.5, 0.0, 3.140625])
    assert torch.equal(stochastic_round_to_bf16(values), values.to(torch.bfloat16))
