"""How the decode-attention kernel launches, for both KV layouts: tile sizes, warps, the split-KV partition of the
response keys, and the checked pointers and strides the kernel takes.

`decode_attention.triton_decode_attention` launches one kernel for the prefix-shared layout and, through
`paged_attention.triton_paged_decode_attention`, for the paged one. Everything that decides how it launches lives
here, so the two layouts follow one rule and cannot drift apart.

Every choice is a function of shapes, never of live lengths (those stay on the device): a launch needs no host sync,
and the plan made when a CUDA graph is captured holds for every replay. Nothing is autotuned for the same reason
(autotuning would benchmark configs at the first call and could pick a different kernel per shape).

Split-KV ("flash decoding"): one program per (slot, KV head) walks that slot's whole context alone, so at the tail
of an uneven batch a few long sequences leave all but a few SMs idle. When the response capacity (the most response
keys a slot can hold) exceeds `SPLIT_KEYS`, the keys are cut over `num_splits` programs per (slot, KV head) (at most
`split_count` of them: fewer for a wide batch, which already fills the GPU), in one of two ways chosen by the batch
(`balanced_splits`): capacity-sized splits (response keys in parts of `split_len`; split 0 also takes the prompt and
this step's new key) for wide batches, or balanced splits (each slot's own prompt and response keys in equal runs of
whole key blocks, read on the device) for narrow ones. Each program leaves its partial softmax state (running max,
sum, accumulator, float32) in a buffer and a second kernel merges them (log-sum-exp), loading all of a slot's
splits at once (`COMBINE_TILE`); a slot whose keys all fell to split 0 is finished by that program and the merge
skips it. The grid depends on the capacity and the batch (shapes) only, so splits past a slot's own length do no
work. The narrowest grids (`NARROW_SLOT_HEADS`) take wider key tiles over more warps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_N = 32
"""Keys per loop iteration; fixed (no autotune) so every launch is the same graph-safe kernel. Float32 tiles of
head_dim 128 (32 x 128 x 4 bytes) stay well inside shared memory."""
NUM_WARPS = 1
"""Warps per program up to head_dim 64: the loop is a chain of dependent loads and dots, and more programs per
SM hide its latency better than more warps per program (`docs/benchmarks.md` has the launch sweep)."""
WIDE_HEAD_NUM_WARPS = 2
"""Warps per program above head_dim 64 (Qwen2.5-1.5B/7B, Llama 3: 128): with RoPE and the bias inside, one warp
would need more than 255 registers a thread and spill (the no-spill test reads ptxas' report)."""
BALANCED_MAX_SLOT_HEADS = 32
"""Balanced splits for grids of at most this many (slot, KV head) pairs (batch 16 at 2 KV heads), capacity-sized
splits above. In a narrow batch the programs do not fill the GPU, so a step lasts as long as its longest program:
with capacity-sized splits that is split 0 (the whole prompt plus `split_len` response keys, twice the others at
a 512-token prompt), with balanced ones every split holds an equal share. In a wide batch the grid runs in several
waves anyway, and balanced splits only add work: every split of every slot then holds keys, and the combine merges
them all, where capacity-sized splits past a slot's length return at once. In the sweep (`docs/benchmarks.md`,
"Paged kernel: launch sweep") balanced splits won at 16 and 4 slots of 8k keys, tied or lost from 32 slots up."""
COMBINE_TILE = 8192
"""Partial-state elements (splits x query rows x head dims) one combine program loads at once: all of a (slot, KV
head)'s splits together, so the merge is one round of loads rather than a chain of one per split (which at a
narrow tail's 16 splits is a row of dependent HBM round trips); head dims are cut into chunks to stay inside it
(`combine_chunk`). 0: the per-split loop (kept for the sweep's comparison)."""
NARROW_SLOT_HEADS = 8
"""Grids of at most this many (slot, KV head) pairs (batch 4 at 2 KV heads), at head dims above 64, take
`NARROW_BLOCK_N` keys per loop iteration and `NARROW_NUM_WARPS` warps: such a tail runs one program per SM at most,
so each program's bytes in flight set the time, and a wider tile over more warps keeps more of them in flight. In
the sweep (`docs/benchmarks.md`, "Paged kernel: launch sweep") this won at 4 slots of 8k keys and lost at 16."""
NARROW_BLOCK_N = 64
NARROW_NUM_WARPS = 4
MIN_DOT_ROWS = 16
"""`tl.dot` needs at least 16 rows (and 16 columns); query groups and head dims are padded up to it."""
SPLIT_KEYS = 512
"""Response keys per split program, at the least (the count is capped; see `response_splits`); responses of at most
this many keys run unsplit."""
MAX_SPLITS = 16
"""At most this many splits (capacity-sized splits of a capacity of 8,192 are 16 anyway)."""
MIN_SPLITS = 4
SPLIT_PROGRAMS = 2048
"""Programs the split grid aims at (`split_count`), chosen from the split-KV table of `benchmarks/kernels/split_kv.py`
(docs/benchmarks.md, "Split-KV: how many splits"): wide batches pay for every split, narrow tails gain from many."""


def default_num_warps(head_dim: int, paged: bool = False) -> int:
    """Warps per program: `NUM_WARPS` up to head_dim 64, else `WIDE_HEAD_NUM_WARPS`; the paged variant always the
    latter (its int64 key offsets gathered through the block table spill a single warp at head_dim 64 too)."""
    return NUM_WARPS if head_dim <= 64 and not paged else WIDE_HEAD_NUM_WARPS


def padded_tile(size: int) -> int:
    """A tile side of `tl.dot`: the next power of two, at least `MIN_DOT_ROWS`."""
    return max(MIN_DOT_ROWS, 1 << (max(size, 1) - 1).bit_length())


def combine_chunk(num_splits: int, group: int, block_d: int) -> int:
    """Head dims per combine program (`COMBINE_TILE`): all of block_d when the tile holds every split's rows,
    else the largest power of two that fits (at least 16); 0 for the per-split loop."""
    if not COMBINE_TILE:
        return 0
    rows, splits = (1 << (max(size, 1) - 1).bit_length() for size in (group, num_splits))
    return min(block_d, max(16, COMBINE_TILE // (splits * rows)))


def split_count(slot_heads: int) -> int:
    """The most splits worth launching for `slot_heads` (slot, KV head) pairs: enough programs to reach about
    `SPLIT_PROGRAMS`, at least `MIN_SPLITS` (uneven lengths still gain from balancing), at most `MAX_SPLITS`, a power
    of two."""
    wanted = max(1, SPLIT_PROGRAMS // max(1, slot_heads))
    return max(MIN_SPLITS, min(MAX_SPLITS, 1 << (wanted.bit_length() - 1)))


def balanced_splits(slot_heads: int) -> bool:
    """Whether a grid of `slot_heads` (batch x KV heads) pairs shares each slot's own keys out evenly over its
    splits (`BALANCED_MAX_SLOT_HEADS` says why the batch decides)."""
    return slot_heads <= BALANCED_MAX_SLOT_HEADS


def response_splits(response_capacity: int, split_keys: int | None = None,
                    slot_heads: int = 1, block_n: int | None = None) -> tuple[int, int] | None:
    """(num_splits, split_len) for responses of up to `response_capacity` keys, or None (one program per slot and
    head) when they fit one split: short responses gain nothing from a second kernel. split_len is a whole number of
    `block_n` (the plan's; default `BLOCK_N`) key blocks, so no loop iteration straddles two splits.

    `slot_heads` (batch x KV heads, the programs one split would run) bounds the count further: a wide batch already
    fills the GPU and pays for every extra split (splits past a slot's length still launch and are merged), so
    it gets `MIN_SPLITS`, a narrow tail up to `MAX_SPLITS` (`split_count`)."""
    split_keys = split_keys or SPLIT_KEYS
    if response_capacity <= split_keys:
        return None
    most = split_count(slot_heads)
    # Balanced splits share each slot's own keys, so their count need not follow the capacity; capacity-sized ones
    # get no more splits than `split_keys`-key parts of it.
    num_splits = most if balanced_splits(slot_heads) else min(-(-response_capacity // split_keys), most)
    split_len, block_n = -(-response_capacity // num_splits), block_n or BLOCK_N
    return num_splits, -(-split_len // block_n) * block_n


@dataclass(frozen=True)
class LaunchPlan:
    """How one call launches: the grid (batch, KV heads, `num_splits`) and the kernel's compile-time sizes."""

    group_pad: int
    """Query rows per program: the GQA group padded (`padded_tile`); padded rows are zeros and are not stored."""
    block_d: int
    """head_dim padded likewise."""
    block_n: int
    """Keys per loop iteration (`BLOCK_N`)."""
    num_warps: int
    num_splits: int
    """Programs per (slot, KV head): 1 without split-KV."""
    split_len: int
    """Response keys per split program (0 without split-KV)."""
    balanced: bool = False
    """Split-KV by each slot's own length (`balanced_splits`)."""

    def one_block(self, block_size: int) -> bool:
        """Paged: whether each loop iteration's keys lie in one block (`BLOCK_N` divides the block size; every
        iteration starts at a multiple of `block_n`, as splits and balanced ranges are whole numbers of it). Then the
        kernel loads one block id per iteration, one iteration ahead, so the key loads need not wait for it; other
        block sizes load one id per key."""
        return block_size % self.block_n == 0


def launch_plan(group: int, head_dim: int, response_capacity: int, paged: bool, slot_heads: int = 1) -> LaunchPlan:
    """The plan for query groups of `group` rows of `head_dim`, over responses of up to `response_capacity` keys,
    for `slot_heads` (batch x KV heads) programs per split (the same rule for both layouts; see the module
    docstring; `NARROW_SLOT_HEADS` for the narrowest grids)."""
    narrow = head_dim > 64 and slot_heads <= NARROW_SLOT_HEADS
    block_n = NARROW_BLOCK_N if narrow else BLOCK_N
    num_splits, split_len = response_splits(response_capacity, slot_heads=slot_heads, block_n=block_n) or (1, 0)
    return LaunchPlan(group_pad=padded_tile(group), block_d=padded_tile(head_dim), block_n=block_n,
                      num_warps=NARROW_NUM_WARPS if narrow else default_num_warps(head_dim, paged),
                      num_splits=num_splits, split_len=split_len,
                      balanced=num_splits > 1 and balanced_splits(slot_heads))


def partial_state(plan: LaunchPlan, batch: int, num_kv_heads: int, placeholder: torch.Tensor) -> tuple:
    """The split programs' float32 buffers: accumulators (B, Hkv, splits, group_pad, block_d) and running max and
    sum (B, Hkv, splits, 2, group_pad); without split-KV, `placeholder` for both (the kernel never touches them)."""
    if plan.num_splits == 1:
        return placeholder, placeholder
    shape, device = (batch, num_kv_heads, plan.num_splits), placeholder.device
    return (torch.empty(*shape, plan.group_pad, plan.block_d, dtype=torch.float32, device=device),
            torch.empty(*shape, 2, plan.group_pad, dtype=torch.float32, device=device))


def launch_arguments(q, prompt_k, prompt_v, response_k, response_v, new_kv, rope, qkv_bias) -> tuple:
    """Checks and arguments of `triton_decode_attention`'s kernel: q made contiguous in head_dim, the output,
    the new K/V, cos, sin and bias pointers (the output stands in for absent ones) and the strides, in the
    kernel's order."""
    batch, num_kv_heads, _, head_dim = q.shape
    assert prompt_k.stride() == prompt_v.stride() and response_k.stride() == response_v.stride()
    assert prompt_k.stride(-1) == 1 and response_k.stride(-1) == 1, "head_dim must be contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)  # (B, Hkv, group, D)
    if new_kv is not None:
        assert new_kv.shape == (batch, 2, num_kv_heads, head_dim) and new_kv.stride(-1) == 1
    fused = new_kv if new_kv is not None else out  # a placeholder pointer when nothing is written
    if rope is not None:
        assert new_kv is not None, "rope needs new_kv: the kernel rotates the new key it stores"
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in rope)
        assert cos.shape == sin.shape == (batch, head_dim) and cos.stride() == sin.stride()
    else:
        cos = sin = out  # placeholders
    bias = qkv_bias if qkv_bias is not None and rope is not None else out  # placeholder without one
    strides = (*q.stride()[:3], *prompt_k.stride()[:3], *response_k.stride()[:3], *out.stride()[:3],
               *fused.stride()[:3], cos.stride(0))
    return q, out, fused, cos, sin, bias, strides
