"""Block bookkeeping of the paged KV cache, in pure Python: who holds which block, and the block-table rows to write.

The runner's `PagedKVCache` owns a pool of fixed-size blocks and a block table (one row per slot); this allocator
decides which ids go where, and the scheduler (`scheduler.py`) decides when: a sequence is admitted when its
prompt's blocks (unless another sample of the prompt already holds them) and its first decode window fit in the free
blocks, grows by whole blocks before each decode window, and gives every block back when it finishes. A prompt's
blocks are reference-counted by its live samples and freed with the last one.

Choices:
- Block 0 is never handed out: free slots' table rows point at it, so the KV a freed or finished slot still writes
  during a decode step lands in scratch (the kernels write every slot in the batch).
- A row is [prompt columns | response columns]: the response starts a fresh block, so samples share the prompt's
  last, partial block without copy-on-write (at most one partial block per prompt is the price).
- Changes are recorded as (slot, column, block) writes, which the runner applies in one copy before the next
  prefill or decode step; a freed slot's row is reset by the runner itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class SequenceBlocks:
    """The response blocks one sequence holds, in column order."""

    blocks: list[int] = field(default_factory=list)


class BlockAllocator:
    """Free list, prompt refcounts and per-sequence response blocks over blocks 1..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, prompt_columns: int) -> None:
        assert num_blocks >= 2, "the pool needs a scratch block and at least one to hand out"
        self.block_size, self.prompt_columns = block_size, prompt_columns
        self.num_usable = num_blocks - 1
        self.free = list(range(num_blocks - 1, 0, -1))  # a stack: pop() hands out the lowest id first
        self.prompt_blocks: dict[int, list[int]] = {}
        self.prompt_refs: dict[int, int] = {}
        self.response: dict[int, SequenceBlocks] = {}  # sequence index -> its response blocks
        self.writes: list[tuple[int, int, int]] = []  # (slot, column, block) not yet applied by the runner
        self.peak_in_use = 0

    @property
    def in_use(self) -> int:
        return self.num_usable - len(self.free)

    def prompt_cost(self, prompt_index: int, prompt_len: int) -> int:
        """Blocks admitting a sample of this prompt takes for the prompt: 0 when another sample holds them."""
        return 0 if prompt_index in self.prompt_blocks else blocks_for(prompt_len, self.block_size)

    def response_cost(self, index: int, tokens: int) -> int:
        """Blocks sequence `index` still needs for `tokens` response KV rows."""
        held = len(self.response[index].blocks) if index in self.response else 0
        return max(0, blocks_for(tokens, self.block_size) - held)

    def _take(self, count: int) -> list[int]:
        assert count <= len(self.free), "the scheduler checks free blocks before taking them"
        taken = [self.free.pop() for _ in range(count)]
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return taken

    def admit(self, index: int, prompt_index: int, prompt_len: int, slot: int) -> bool:
        """Give sequence `index` (in `slot`) its prompt's blocks, taking them if no sample holds them yet; returns
        whether they were just taken (so this admission's prefill must write the prompt's KV)."""
        new = prompt_index not in self.prompt_blocks
        if new:
            self.prompt_blocks[prompt_index] = self._take(blocks_for(prompt_len, self.block_size))
            self.prompt_refs[prompt_index] = 0
        self.prompt_refs[prompt_index] += 1
        self.response[index] = SequenceBlocks()
        self.writes.extend((slot, column, block) for column, block in enumerate(self.prompt_blocks[prompt_index]))
        return new

    def grow(self, index: int, slot: int, tokens: int) -> None:
        """Make sequence `index` hold blocks for `tokens` response rows (the caller checked `response_cost`)."""
        held, count = self.response[index].blocks, self.response_cost(index, tokens)
        if count == 0:  # most calls: a block holds several decode windows
            return
        start = len(held)
        held.extend(self._take(count))
        self.writes.extend((slot, self.prompt_columns + column, held[column]) for column in range(start, len(held)))

    def release(self, index: int, prompt_index: int) -> int:
        """Give back sequence `index`'s response blocks, and its prompt's when it was the last sample holding them;
        returns how many blocks were freed."""
        freed = self.response.pop(index).blocks
        self.prompt_refs[prompt_index] -= 1
        if self.prompt_refs[prompt_index] == 0:
            del self.prompt_refs[prompt_index]
            freed = freed + self.prompt_blocks.pop(prompt_index)
        self.free.extend(sorted(freed, reverse=True))
        return len(freed)

    def take_writes(self) -> list[tuple[int, int, int]]:
        writes, self.writes = self.writes, []
        return writes
