"""The extend attention kernel against the masked-matmul form, run by test_multiturn_extend.py in a TRITON_INTERPRET=1
subprocess (kept apart so that the kernel is built in interpret mode)."""

from __future__ import annotations

import torch

from hybridrl.rollout.engine.llama_forward import _masked_gqa_attention
from hybridrl.rollout.kernels.extend_attention import BLOCK_M, BLOCK_N, extend_attention

# (rows, new ids, query heads, KV heads, head_dim, keys): group 7 as Qwen2-0.5B's; folded queries past one BLOCK_M
# and keys past one BLOCK_N (several loop iterations, a partial last block); one id; one row.
CASES = [(5, 12, 14, 2, 32, 150), (3, 1, 4, 2, 16, 40), (1, 9, 4, 4, 16, BLOCK_N), (6, 3, 7, 1, 64, 9)]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def check_kernel_cases() -> None:
    """float32 and float16 (the interpreter's `tl.dot` is unusable for bf16; the GPU test covers it): rows at
    different offsets, and rows whose positions clamp at the last key (as `extend` passes a padded row's)."""
    assert BLOCK_M >= 16 and BLOCK_N >= 16
    generator = torch.Generator().manual_seed(5)
    for rows, length, heads, kv_heads, head_dim, keys in CASES:
        for dtype in (torch.float32, torch.float16):
            q = torch.randn(rows, length, heads, head_dim, generator=generator).to(dtype)
            k, v = (torch.randn(rows, kv_heads, keys, head_dim, generator=generator).to(dtype) for _ in range(2))
            starts = torch.randint(0, keys, (rows, 1), generator=generator)
            positions = (starts + torch.arange(length)).clamp(max=keys - 1)
            want = _masked_gqa_attention(q.float(), k.float(), v.float(), positions).to(dtype)
            torch.testing.assert_close(extend_attention(q, k, v, positions), want, **TOLERANCE[dtype])
            # In place: the rows' keys as slots of a larger cache, in another order, with room past `keys`.
            slots = torch.randperm(rows + 3, generator=generator)[:rows]
            cache_k, cache_v = (torch.randn(rows + 3, kv_heads, keys + 20, head_dim, generator=generator).to(dtype)
                                for _ in range(2))
            cache_k[slots, :, :keys], cache_v[slots, :, :keys] = k, v
            got = extend_attention(q, cache_k, cache_v, positions, slots)
            torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    print("extend attention kernel: ok")


def check_extend_in_place() -> None:
    """The whole `extend` with the kernel reading each row's slot of the per-slot cache in place (its path on CUDA,
    taken here by naming "triton") equals it with the obviously right masked matmuls over gathered slots: logits and
    the KV written, float32, uneven rows in an order unlike the slots', a key bucket past the longest row."""
    from hybridrl.rollout.engine import llama_forward
    from test_multiturn import make_model
    from test_multiturn_extend import filled_cache, resume_batch

    model = make_model("qwen2")
    w, kv, cos, sin, contexts = filled_cache(model, 0)
    new, input_ids, lengths, starts, slots, kv_end = resume_batch(contexts, [3, 0, 4], 0, model.config.vocab_size)
    results = {}
    for name in ("triton", "matmul"):
        llama_forward.extend_attention = name
        assert llama_forward.reads_slots_in_place(input_ids.device) == (name == "triton")
        cache = kv.clone()
        with torch.no_grad():
            results[name] = (llama_forward.extend(w, cache, cos, sin, input_ids, lengths, starts, slots, kv_end + 5),
                             cache)
    torch.testing.assert_close(results["triton"][0], results["matmul"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results["triton"][1], results["matmul"][1], atol=1e-5, rtol=0)  # later layers: rounding
    print("extend in place: ok")
