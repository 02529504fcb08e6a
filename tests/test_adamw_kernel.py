"""LeanAdamW's Triton update kernel (`training/adamw_kernel.py`) against `optim.adamw_chunk`, the eager reference:
in Triton's interpreter on CPU here, compiled on CUDA in the GPU test."""

from types import SimpleNamespace

import pytest
import torch

from decode_attention_cases import run_in_interpreter


def kernel_cases(device: str = "cpu") -> None:
    """float32 weights against the reference (closely; bitwise where no rounding differs), bf16 weights with the
    counter-hash rounding bit for bit where the float32 update agrees, fp16 nearest, and apply=0 a no-op even with
    NaN gradients. Sizes not a multiple of the block, and a counter base near 2**32 (the counter wraps)."""
    from hybridrl.training.adamw_kernel import triton_adamw_chunk
    from hybridrl.training.optim import adamw_chunk, counter_noise

    generator = torch.Generator().manual_seed(3)
    numel = 2500
    hyper = torch.tensor([1e-2, 0.9, 0.99, 1e-8, 0.1, 1 - 0.9 ** 3, 1 - 0.99 ** 3, 1.0, 0.37])  # clipped by 0.37

    def inputs(dtype):
        weights = torch.randn(numel, generator=generator).to(dtype)
        grad = torch.randn(numel, generator=generator).to(dtype)
        return weights, grad, torch.randn(numel, generator=generator), torch.rand(numel, generator=generator)

    def both(weights, grad, m, v, base, hyper):
        moved = [t.to(device) for t in (weights, grad, m.clone(), v.clone(), hyper)]
        base_on = None if base is None else base.to(device)
        got = triton_adamw_chunk(moved[0], moved[1], moved[2], moved[3], base_on, moved[4])
        want_m, want_v = m.clone(), v.clone()
        want = adamw_chunk(weights, grad, want_m, want_v, base, hyper)
        return (got.cpu(), moved[2].cpu(), moved[3].cpu()), (want, want_m, want_v)

    (got, got_m, got_v), (want, want_m, want_v) = both(*inputs(torch.float32), None, hyper)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_m, want_m, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(got_v, want_v, atol=1e-7, rtol=1e-6)

    base = torch.tensor([0xFFFFFF00], dtype=torch.int64)  # counters wrap past 2**32 inside the tensor
    weights, grad, m, v = inputs(torch.bfloat16)
    (got, _, _), (want, _, _) = both(weights, grad, m, v, base, hyper)
    assert got.dtype == torch.bfloat16
    exact = adamw_chunk(weights, grad, m.clone(), v.clone(), None, hyper.clone())  # nearest rounding
    agree = (got == want).float().mean().item()
    assert agree > 0.999, agree  # other noise bits would round ~1/3 of them differently; a last-bit float32
    # difference flips a rare one
    assert (got != exact).any()  # stochastic, not nearest
    (got, _, _), (want, _, _) = both(*inputs(torch.float16), None, hyper)
    assert got.dtype == torch.float16 and (got == want).float().mean().item() > 0.999

    skip = hyper.clone()
    skip[7] = 0.0
    weights, grad, m, v = inputs(torch.bfloat16)
    grad[5] = float("nan")
    (got, got_m, got_v), _ = both(weights, grad, m, v, base, skip)
    assert torch.equal(got, weights) and torch.equal(got_m, m) and torch.equal(got_v, v)
    print("adamw kernel passed")


def test_adamw_kernel_in_interpreter():
    assert "adamw kernel passed" in run_in_interpreter("test_adamw_kernel", "kernel_cases")


@pytest.mark.gpu
def test_adamw_kernel_on_cuda():
    kernel_cases("cuda")


def test_a_kernel_that_fails_to_build_falls_back_with_a_warning(monkeypatch):
    """If Triton cannot build the kernel on some machine, LeanAdamW warns once and computes the same update
    through the fallback (torch.compile on CUDA; here the eager function stands in for it)."""
    from hybridrl.training import optim

    def broken(*args):
        raise RuntimeError("ptxas failed\nmore detail")

    monkeypatch.setattr(optim, "triton_adamw_chunk", broken)
    monkeypatch.setattr(optim, "fallback_update", lambda: optim.adamw_chunk)
    monkeypatch.setattr(optim, "_FALLBACK", [])
    weights, grad = torch.randn(10), torch.randn(10)
    hyper = torch.tensor([1e-2, 0.9, 0.99, 1e-8, 0.0, 0.1, 0.01, 1.0, 1.0])
    want = optim.adamw_chunk(weights, grad, torch.zeros(10), torch.zeros(10), None, hyper)
    with pytest.warns(RuntimeWarning, match=r"failed to build \(RuntimeError: ptxas failed\); using torch.compile"):
        got = optim.kernel_update(weights, grad, torch.zeros(10), torch.zeros(10), None, hyper)
    assert torch.equal(got, want)
    assert torch.equal(optim.kernel_update(weights, grad, torch.zeros(10), torch.zeros(10), None, hyper), want)


def test_the_triton_cache_key_is_computed_in_the_background():
    """The trainer's first step starts `triton_key` (Triton's hash of itself, 0.4 s at a process's first kernel
    lookup) in a thread, so the first optimizer step finds it cached."""
    from hybridrl.training import adamw_kernel

    if adamw_kernel.triton_key is None:
        pytest.skip("needs Triton 3")
    adamw_kernel.triton_key.cache_clear()
    thread = adamw_kernel.prefetch_cache_key()
    thread.join(timeout=120)
    assert not thread.is_alive() and adamw_kernel.triton_key.cache_info().currsize == 1


def test_a_kernel_launch_waits_for_a_running_prefetch_instead_of_hashing_beside_it(monkeypatch):
    from hybridrl.training import adamw_kernel

    joined = []
    monkeypatch.setattr(adamw_kernel, "_pending", SimpleNamespace(join=lambda: joined.append(1)))
    adamw_kernel.wait_for_cache_key()
    adamw_kernel.wait_for_cache_key()
    assert joined == [1] and adamw_kernel._pending is None


def test_the_prefetch_starts_with_the_first_step_not_before(tmp_path, monkeypatch):
    """Started at construction it would run during whatever comes before step 1 (a benchmark's untimed
    evaluation), off the steps' clock."""
    from conftest import contains_seven, tiny_actor, toy_prompts

    from hybridrl import RLTrainer
    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training import adamw_kernel

    started = []
    monkeypatch.setattr(adamw_kernel, "available", lambda device: True)
    monkeypatch.setattr(adamw_kernel, "prefetch_cache_key", lambda: started.append(1))
    actor = tiny_actor()
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven, dataset=PromptDataset(toy_prompts(), actor.tokenizer,
                                                                                     max_length=16),
                        trainer__output_dir=str(tmp_path), trainer__device="cpu", trainer__prompts_per_step=2,
                        rollout__num_samples_per_prompt=2, rollout__max_new_tokens=4, logging__sinks=["jsonl"])
    assert started == []
    trainer.step()
    trainer.step()
    assert started == [1]
