"""The decode step's plain temperature sampling (no top-k/top-p/min-p) as two Triton kernels: the same draw as
`sampling._sample_blocked` followed by `decode_state.sample_and_record`'s bookkeeping.

Why: compiled by Inductor, that sampler is a pass over the (rows, vocabulary) logits followed by several small
kernels, and a decode step is bound by its kernel count; these two kernels do the same work with one read of the
logits for the statistics and one of the chosen block (`docs/benchmarks.md` compares them). Here:

- `_block_stats_kernel`, grid (rows, block groups): each program reads `BLOCKS_PER_PROGRAM` whole blocks of one row
  (16 KB of bf16 at the default 8192 logits) and writes each block's max of x / T and sum of exp(x / T - that
  max), float32.
- `_draw_and_record_kernel`, one program per row: block masses rescaled to the row's max, their CDF inverted at
  the row's uniform for this response position, then the chosen block's logits read again and its own CDF
  inverted (with `_offset_inside_block`'s guard against rounding); the token, its log-prob and the row's state
  (out_tokens/out_logprobs at the response position, last_token, gen_len, done) written as the reference does,
  a finished row left as it is.

Masked lanes hold -1e30, never -inf (no lane forms inf - inf). The kernels scale by 1 / T (exact at T = 1; a
correctly rounded division makes the stats kernel compute-bound) and use Triton's exp and scan; their float32
rounding differs from torch's, so a draw whose uniform lands near a CDF boundary can pick the neighbouring token
(rarely, and more often at a large vocabulary, where a block mass's rounding is large against one token's mass).
Both are draws from the same distribution; the tests compare whole batches with the reference.
`TRITON_INTERPRET=1` set before the first import runs them on CPU tensors; `sampling_kernel_applies` says when the
engine uses them.
"""

from __future__ import annotations

import torch

from hybridrl.rollout.engine.sampling import SamplerSettings, _block_size

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps the PyTorch sampler
    triton = None

BLOCK_ELEMENTS, NUM_WARPS = 8192, 4
"""Logits per `_block_stats_kernel` program (rounded to whole blocks, at least one) and its warps."""


def _next_power_of_two(value: int) -> int:
    return 1 << (max(value, 1) - 1).bit_length()


def sampling_kernel_applies(settings: SamplerSettings, vocab: int) -> bool:
    """Plain temperature sampling over a vocabulary whose sampling blocks (`sampling._block_size`) fit one program."""
    plain = not settings.greedy and settings.top_k <= 0 and settings.top_p >= 1.0 and settings.min_p <= 0
    return triton is not None and plain and _block_size(vocab) <= BLOCK_ELEMENTS


def triton_sample_and_record(logits: torch.Tensor, settings: SamplerSettings, uniform_table: torch.Tensor,
                             done: torch.Tensor, gen_len: torch.Tensor, last_token: torch.Tensor,
                             out_tokens: torch.Tensor, out_logprobs: torch.Tensor, stop_ids: torch.Tensor,
                             max_new_tokens: int) -> None:
    """`decode_state.sample_and_record` for plain temperature sampling (`sampling_kernel_applies`), in two kernels."""
    rows, vocab = logits.shape
    size = _block_size(vocab)
    num_blocks = vocab // size
    assert logits.stride(-1) == 1 and out_tokens.stride(-1) == 1 and uniform_table.stride(-1) == 1
    size_pad = _next_power_of_two(size)
    per_program = max(1, BLOCK_ELEMENTS // size_pad)
    maxima = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxima)
    _block_stats_kernel[(rows, triton.cdiv(num_blocks, per_program))](
        logits, maxima, sums, logits.stride(0), num_blocks, 1.0 / settings.temperature,
        SIZE=size, SIZE_PAD=size_pad, BLOCKS_PER_PROGRAM=per_program, num_warps=NUM_WARPS)
    _draw_and_record_kernel[(rows,)](
        logits, maxima, sums, uniform_table, done, gen_len, last_token, out_tokens, out_logprobs, stop_ids,
        logits.stride(0), uniform_table.stride(0), out_tokens.stride(0), out_logprobs.stride(0),
        num_blocks, stop_ids.numel(), 1.0 / settings.temperature, max_new_tokens,
        SIZE=size, SIZE_PAD=size_pad, BLOCKS_PAD=_next_power_of_two(num_blocks),
        STOPS_PAD=_next_power_of_two(stop_ids.numel()), num_warps=4)


if triton is not None:

    @triton.jit
    def _block_stats_kernel(LOGITS, MAXIMA, SUMS, stride_row, num_blocks, inv_temperature,
                            SIZE: tl.constexpr, SIZE_PAD: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        blocks = tl.program_id(1) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        lanes = tl.arange(0, SIZE_PAD)
        mask = (blocks[:, None] < num_blocks) & (lanes[None, :] < SIZE)
        x = tl.load(LOGITS + row * stride_row + blocks[:, None] * SIZE + lanes[None, :], mask=mask, other=-1e30)
        x = tl.where(mask, x.to(tl.float32) * inv_temperature, -1e30)
        block_max = tl.max(x, 1)
        block_sum = tl.sum(tl.where(mask, tl.exp(x - block_max[:, None]), 0.0), 1)
        live = blocks < num_blocks
        tl.store(MAXIMA + row * num_blocks + blocks, block_max, mask=live)
        tl.store(SUMS + row * num_blocks + blocks, block_sum, mask=live)

    @triton.jit
    def _draw_and_record_kernel(LOGITS, MAXIMA, SUMS, UNIFORM_TABLE, DONE, GEN_LEN, LAST_TOKEN, OUT_TOKENS,
                                OUT_LOGPROBS, STOP_IDS, stride_row, stride_uniform, stride_tokens, stride_logprobs,
                                num_blocks, num_stops, inv_temperature, max_new_tokens,
                                SIZE: tl.constexpr, SIZE_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr,
                                STOPS_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        gen_len = tl.load(GEN_LEN + row)
        column = tl.minimum(gen_len, max_new_tokens - 1)  # the response position this step draws
        uniform = tl.load(UNIFORM_TABLE + row * stride_uniform + column)
        # The block: its CDF over masses relative to the row's max, inverted at uniform * total.
        blocks = tl.arange(0, BLOCKS_PAD)
        in_row = blocks < num_blocks
        block_max = tl.load(MAXIMA + row * num_blocks + blocks, mask=in_row, other=-1e30)
        row_max = tl.max(block_max, 0)
        mass = tl.where(in_row, tl.load(SUMS + row * num_blocks + blocks, mask=in_row, other=0.0)
                        * tl.exp(block_max - row_max), 0.0)
        log_total = tl.log(tl.sum(mass, 0))
        cdf = tl.cumsum(mass, 0)
        target = uniform * tl.max(cdf, 0)  # the CDF's last entry (masses are >= 0)
        block = tl.minimum(tl.sum((in_row & (cdf <= target)).to(tl.int32), 0), num_blocks - 1)
        mass_before = tl.sum(tl.where(blocks == block, cdf - mass, 0.0), 0)
        # The token inside that block: the same inversion over its own exponentials.
        lanes = tl.arange(0, SIZE_PAD)
        in_block = lanes < SIZE
        x = tl.load(LOGITS + row * stride_row + block.to(tl.int64) * SIZE + lanes, mask=in_block, other=-1e30)
        x = tl.where(in_block, x.to(tl.float32) * inv_temperature, -1e30)
        weights = tl.where(in_block, tl.exp(x - row_max), 0.0)
        offset = tl.sum((in_block & (tl.cumsum(weights, 0) <= target - mass_before)).to(tl.int32), 0)
        positive = weights > 0  # rounding can put the target past the block's total: stay on a positive entry
        any_positive = tl.max(positive.to(tl.int32), 0) > 0
        first = tl.where(any_positive, tl.min(tl.where(positive, lanes, SIZE_PAD), 0), 0)
        last = tl.where(any_positive, tl.max(tl.where(positive, lanes, -1), 0), SIZE - 1)
        offset = tl.minimum(tl.maximum(offset, first), last)
        token = block.to(tl.int64) * SIZE + offset
        logprob = tl.sum(tl.where(lanes == offset, x, 0.0), 0) - row_max - log_total
        # Bookkeeping, as `sample_and_record`: a finished row keeps its state.
        live = tl.load(DONE + row) == 0
        tl.store(OUT_TOKENS + row * stride_tokens + column, token, mask=live)
        tl.store(OUT_LOGPROBS + row * stride_logprobs + column, logprob, mask=live)
        tl.store(LAST_TOKEN + row, token, mask=live)
        new_len = gen_len + live.to(gen_len.dtype)
        tl.store(GEN_LEN + row, new_len)
        stops = tl.arange(0, STOPS_PAD)
        stop_ids = tl.load(STOP_IDS + stops, mask=stops < num_stops, other=-1)
        stopped = tl.sum(((stops < num_stops) & (stop_ids == token)).to(tl.int32), 0) > 0
        tl.store(DONE + row, 1, mask=live & (stopped | (new_len >= max_new_tokens)))


def with_sampling_kernel(fallback):
    """A `sample_and_record` that runs the kernels where `sampling_kernel_applies` and `fallback` (the PyTorch
    sampler, compiled or not) otherwise; the choice is made on the host, once per call or graph capture."""

    def sample_and_record(logits, settings, *state_and_limits):
        if sampling_kernel_applies(settings, logits.shape[-1]):
            return triton_sample_and_record(logits, settings, *state_and_limits)
        return fallback(logits, settings, *state_and_limits)

    return sample_and_record
