"""Paged attention inputs built from a prefix-shared case (the same keys scattered into shuffled blocks), and the
kernel check that test_paged_kv.py runs in a TRITON_INTERPRET=1 subprocess (no transformers imported here)."""

from __future__ import annotations

import torch

from decode_attention_cases import CASES, TOLERANCE, make_case, rope_inputs, with_new_kv
from hybridrl.rollout.kernels.decode_attention import reference_decode_attention
from hybridrl.rollout.kernels import decode_launch
from hybridrl.rollout.kernels.decode_launch import MAX_SPLITS, SPLIT_KEYS
from hybridrl.rollout.kernels.paged_attention import triton_paged_decode_attention


def to_paged(case: dict, block_size: int, seed: int = 0) -> dict:
    """The keys of a prefix-shared `case` in a block pool, in shuffled blocks: each prompt entry's blocks once
    (shared by the slots that read that entry), each slot's response blocks; block 0 is scratch (random too, so a
    read of it would show). The result takes `paged_attention`'s arguments."""
    generator = torch.Generator().manual_seed(seed)
    prompt_k, response_k = case["prompt_k"], case["response_k"]
    entries, kv_heads, prompt_max, head_dim = prompt_k.shape
    slots, _, response_max, _ = response_k.shape
    prompt_columns, response_columns = -(-prompt_max // block_size), -(-response_max // block_size)
    num_blocks = 1 + entries * prompt_columns + slots * response_columns
    order = 1 + torch.randperm(num_blocks - 1, generator=generator)
    prompt_blocks = order[: entries * prompt_columns].view(entries, prompt_columns)
    response_blocks = order[entries * prompt_columns:].view(slots, response_columns)
    pools = []
    for prompt, response in ((prompt_k, response_k), (case["prompt_v"], case["response_v"])):
        pool = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=generator).to(prompt)
        for source, blocks in ((prompt, prompt_blocks), (response, response_blocks)):
            padded = torch.zeros(source.shape[0], kv_heads, blocks.shape[1] * block_size, head_dim).to(source)
            padded[:, :, : source.shape[2]] = source
            pool[blocks.flatten()] = padded.unflatten(2, (blocks.shape[1], block_size)).transpose(1, 2).flatten(0, 1)
        pools.append(pool)
    batch = case["q"].shape[0]
    table = torch.cat((prompt_blocks[case["prompt_index"].cpu()], response_blocks[:batch]), dim=1)
    return dict(q=case["q"], k_pool=pools[0], v_pool=pools[1], response_k=pools[0], response_v=pools[1],
                block_table=table.to(case["q"].device), prompt_len=case["prompt_len"], response_len=case["response_len"],
                scale=case["scale"], prompt_columns=prompt_columns)


def read_back(paged: dict, slot: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value (Hkv, D) at response index `index` of `slot`, read through the block table."""
    block_size = paged["k_pool"].shape[2]
    block = paged["block_table"][slot, paged["prompt_columns"] + index // block_size]
    return paged["k_pool"][block, :, index % block_size], paged["v_pool"][block, :, index % block_size]


def check_paged(attention, seed: int, shape: tuple, block_size: int, dtype, tolerance: dict,
                device: str = "cpu") -> None:
    """`attention` on the paged copy of a case equals the contiguous reference on the case: plain, with the new
    key/value written (and read back through the table), and with RoPE + bias applied inside."""
    case = make_case(seed, *shape, dtype=dtype, device=device)
    torch.testing.assert_close(attention(**to_paged(case, block_size, seed)), reference_decode_attention(**case),
                               **tolerance)
    for rope in (False, True):
        written, new_kv = with_new_kv(case)
        extra = dict(new_kv=new_kv)
        if rope:
            cos, sin, bias = rope_inputs(case, with_bias=seed % 2 == 0)
            extra.update(rope=(cos, sin), qkv_bias=bias)
        paged = to_paged(written, block_size, seed)
        torch.testing.assert_close(attention(**paged, **extra), reference_decode_attention(**written, **extra),
                                   **tolerance)
        for slot, length in enumerate(case["response_len"].tolist()):  # what the contiguous write stored
            key, value = read_back(paged, slot, length - 1)
            torch.testing.assert_close(key, written["response_k"][slot, :, length - 1], **tolerance)
            torch.testing.assert_close(value, written["response_v"][slot, :, length - 1], **tolerance)


BLOCK_SIZES = (16, 5, 64)
"""A power of two below the kernel's key block, an odd size (blocks straddle key blocks), one above it."""


LONG_RESPONSES = (3, 2, 4, 32, 1, 20, 600)
"""Responses of up to 600 keys (the capacity among them): many key blocks per split, so a balanced split that covered
less than its slot's keys would show."""


def check_kernel_cases() -> None:
    """Run with TRITON_INTERPRET=1: the paged kernel against the contiguous reference (float32, float16; the
    interpreter's bf16 dot is unusable, see decode_attention_cases)."""
    # One program per slot and head; split-KV over 32-key splits, capacity-sized, then each slot's keys shared out
    # evenly (forced at every batch: the engine picks by batch). Blocks of 64 (twice the key block) load one block id
    # per iteration, one ahead; blocks of 16 and 5 one id per key.
    saved = decode_launch.BALANCED_MAX_SLOT_HEADS
    for split_keys, balanced in ((None, False), (32, False), (32, True)):
        decode_launch.SPLIT_KEYS = split_keys or SPLIT_KEYS
        decode_launch.BALANCED_MAX_SLOT_HEADS = (1 << 30) * balanced
        for seed, shape in enumerate(CASES + [LONG_RESPONSES] * balanced):
            # the interpreter runs every program in turn: at most 16 splits (the engine's `MAX_SPLITS` too)
            decode_launch.MAX_SPLITS = min(16, MAX_SPLITS)
            for block_size in BLOCK_SIZES:
                for dtype in (torch.float32, torch.float16)[:1 if balanced or block_size == 64 else 2]:
                    check_paged(triton_paged_decode_attention, seed, shape, block_size, dtype, TOLERANCE[dtype])
    decode_launch.SPLIT_KEYS, decode_launch.BALANCED_MAX_SLOT_HEADS = SPLIT_KEYS, saved
    decode_launch.MAX_SPLITS = MAX_SPLITS
    print("paged kernel cases passed")
