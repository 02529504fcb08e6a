"""Decode attention over a paged KV cache: keys and values live in fixed-size blocks, reached through a block table.

Layout, per layer (what `kv_cache.PagedKVCache` holds):
    k_pool, v_pool   (blocks, Hkv, block_size, D)   every block of every sequence; block 0 is a scratch block
    block_table      (B, prompt_columns + response_columns) integer block ids per slot
A slot's prompt keys [0, prompt_len) lie in the blocks of its first `prompt_columns` columns (shared by the n samples
of a prompt: the same ids in each sample's row), its response keys [0, response_len) in the blocks of the columns
after them; key i of a part sits in that part's column i // block_size at row i % block_size. The response starts a
fresh block, so the prompt's last, partial block is never written after prefill and needs no copy-on-write. Those
are the keys the contiguous layouts hold at positions [0, prompt_len + response_len), so the attention is the same;
what changes is that a sequence holds only the blocks it has filled.

Both functions take `decode_attention`'s arguments, with prompt_k = response_k = k_pool (and the values alike) and
the block table in place of the prompt index, so `llama_forward.decode_logits_prefix_shared` runs either layout:
- `reference_paged_decode_attention`: rotate (if asked), write the new key/value through the table, gather each
  slot's blocks into contiguous keys and run `reference_decode_attention` on them. The CPU path and the oracle.
- `triton_paged_decode_attention`: the prefix-shared Triton kernel with its PAGED switch: each loop iteration loads
  its keys' block ids from the table and gathers rows in int64 offsets; the new key/value are stored and attended
  from registers, as in the contiguous kernel. A free slot's row points at block 0 (scratch), so the writes of a
  freed or finished slot land there and never in a block another sequence owns. Long responses run split-KV by the
  rule of the contiguous kernel (`decode_launch.py`), their capacity being the table's response columns times
  block_size.
"""

from __future__ import annotations

import torch

from hybridrl.rollout.kernels.decode_attention import (
    reference_decode_attention,
    rotate_projections,
    triton_decode_attention,
)


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """pool (blocks, Hkv, block_size, D), table (B, columns) -> each slot's keys in order, (B, Hkv, columns *
    block_size, D)."""
    gathered = pool[table]  # (B, columns, Hkv, block_size, D)
    batch, columns, heads, block_size, head_dim = gathered.shape
    return gathered.transpose(1, 2).reshape(batch, heads, columns * block_size, head_dim)


def write_through_table(k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, prompt_columns: int,
                        response_len: torch.Tensor, new_kv: torch.Tensor) -> None:
    """Store this step's keys/values (B, 2, Hkv, D) at response index response_len - 1 of each slot, through its
    block table; a slot without response tokens writes nothing (as the kernel)."""
    batch, block_size = new_kv.shape[0], k_pool.shape[2]
    index = (response_len[:batch] - 1).clamp(min=0)
    rows = torch.arange(batch, device=new_kv.device)
    blocks = table[rows, prompt_columns + index // block_size]
    offsets = index % block_size
    live = (response_len[:batch] > 0)[:, None, None]
    k_pool[blocks, :, offsets] = torch.where(live, new_kv[:, 0], k_pool[blocks, :, offsets])
    v_pool[blocks, :, offsets] = torch.where(live, new_kv[:, 1], v_pool[blocks, :, offsets])


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    response_k: torch.Tensor,
    response_v: torch.Tensor,
    block_table: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    scale: float,
    new_kv: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    qkv_bias: torch.Tensor | None = None,
    *,
    prompt_columns: int,
) -> torch.Tensor:
    """Plain-PyTorch paged decode attention (see the module docstring); response_k/v are the pool again."""
    batch = q.shape[0]
    if rope is not None:
        q, new_kv = rotate_projections(q, new_kv, *rope, qkv_bias)
    table = block_table[:batch]
    if new_kv is not None:
        write_through_table(k_pool, v_pool, table, prompt_columns, response_len, new_kv)
    prompt_table, response_table = table[:, :prompt_columns], table[:, prompt_columns:]
    slots = torch.arange(batch, device=q.device)
    return reference_decode_attention(q, gather_blocks(k_pool, prompt_table), gather_blocks(v_pool, prompt_table),
                                      gather_blocks(k_pool, response_table), gather_blocks(v_pool, response_table),
                                      slots, prompt_len, response_len, scale)


def triton_paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, response_k: torch.Tensor,
                                  response_v: torch.Tensor, block_table: torch.Tensor, prompt_len: torch.Tensor,
                                  response_len: torch.Tensor, scale: float, *, prompt_columns: int,
                                  **fused) -> torch.Tensor:
    """The Triton kernel reading through the block table; same contract as `reference_paged_decode_attention`
    (`fused`: its new_kv, rope and qkv_bias)."""
    assert block_table.stride(-1) == 1, "block table rows must be contiguous"
    return triton_decode_attention(q, k_pool, v_pool, k_pool, v_pool, block_table, prompt_len, response_len, scale,
                                   paged=(k_pool.shape[2], prompt_columns), **fused)
