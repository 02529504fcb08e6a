"""Continuous-batching bookkeeping in pure Python: which sequence sits in which KV slot.

No tensors here (the runner in `builtin.py` owns them). Sequences wait in prompt-major order; free
slots are handed out lowest-first, so the live sequences stay packed at the front and a decode step
only has to run over slots `0..batch-1`. When nothing is waiting and the live sequences have thinned
out, `compaction_moves` proposes moving the ones in high slots down so that a smaller batch-size
bucket (a smaller CUDA graph) covers them.

For the prefix-shared KV layout, `PromptEntries` also maps each live prompt to one prompt-cache entry,
refcounted by its live samples: the first admitted sample of a prompt takes a free entry (and its
prefill fills it), later samples share it, and the entry is free again once the last one finishes.
Compaction moves slots only; a sequence keeps its entry.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass


@dataclass
class SequenceSlot:
    """One response being generated: output position `index` (prompt-major) of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_len: int
    slot: int = -1
    generated: int = 0
    """Response tokens as of the last host sync."""
    entry: int = -1
    """Prompt-cache entry that holds this sequence's prompt KV (prefix-shared layout)."""
    fills_entry: bool = False
    """Set at admission when the entry is new, so this admission's prefill must write the prompt's KV."""


def prompt_entries_needed(num_prompts: int, num_slots: int) -> int:
    """Entries that always suffice: live prompts are at most the live sequences and the distinct prompts."""
    return min(num_prompts, num_slots)


class PromptEntries:
    """Refcounted prompt -> entry map; free entries are handed out lowest-first."""

    def __init__(self, num_entries: int) -> None:
        self.free = list(range(num_entries))  # a min-heap
        self.entry_of: dict[int, int] = {}
        self.refs: dict[int, int] = {}

    def acquire(self, prompt_index: int) -> tuple[int, bool]:
        """The entry of `prompt_index` and whether it was just taken (so its KV must be written)."""
        if prompt_index in self.entry_of:
            self.refs[prompt_index] += 1
            return self.entry_of[prompt_index], False
        assert self.free, "more live prompts than prompt entries (see prompt_entries_needed)"
        entry = heapq.heappop(self.free)
        self.entry_of[prompt_index], self.refs[prompt_index] = entry, 1
        return entry, True

    def release(self, prompt_index: int) -> None:
        self.refs[prompt_index] -= 1
        if self.refs[prompt_index] == 0:
            del self.refs[prompt_index]
            heapq.heappush(self.free, self.entry_of.pop(prompt_index))


def batch_buckets(num_slots: int) -> list[int]:
    """Batch sizes a decode step may run with: powers of two below `num_slots`, then `num_slots`."""
    buckets, size = [], 1
    while size < num_slots:
        buckets.append(size)
        size *= 2
    return buckets + [num_slots]


class Scheduler:
    """Admits waiting sequences into free slots and frees slots of finished ones."""

    def __init__(self, prompt_indices: list[int], prompt_lens: list[int], num_slots: int) -> None:
        self.waiting = deque(SequenceSlot(i, p, prompt_lens[p]) for i, p in enumerate(prompt_indices))
        self.num_slots = num_slots
        self.buckets = batch_buckets(num_slots)
        self.free_slots = list(range(num_slots))  # a min-heap
        self.live: dict[int, SequenceSlot] = {}  # slot -> sequence
        self.entries = PromptEntries(prompt_entries_needed(len(set(prompt_indices)), num_slots))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def admit(self) -> list[SequenceSlot]:
        """Move as many waiting sequences as there are free slots into the lowest free slots."""
        admitted = []
        while self.waiting and self.free_slots:
            sequence = self.waiting.popleft()
            sequence.slot = heapq.heappop(self.free_slots)
            sequence.entry, sequence.fills_entry = self.entries.acquire(sequence.prompt_index)
            self.live[sequence.slot] = sequence
            admitted.append(sequence)
        return admitted

    def finish(self, slot: int) -> SequenceSlot:
        sequence = self.live.pop(slot)
        heapq.heappush(self.free_slots, slot)
        self.entries.release(sequence.prompt_index)
        return sequence

    def batch_size(self) -> int:
        """The smallest bucket that covers every live slot."""
        if not self.live:
            return 0
        return self.buckets[bisect.bisect_left(self.buckets, max(self.live) + 1)]

    def compaction_moves(self) -> list[tuple[int, int]]:
        """(source, destination) slot pairs that pack live sequences into a smaller bucket; may be empty."""
        if self.waiting or not self.live:
            return []
        target = self.buckets[bisect.bisect_left(self.buckets, len(self.live))]
        if target >= self.batch_size():
            return []
        sources = sorted(slot for slot in self.live if slot >= target)
        destinations = sorted(slot for slot in self.free_slots if slot < target)[: len(sources)]
        moves = list(zip(sources, destinations))
        for source, destination in moves:
            sequence = self.live.pop(source)
            sequence.slot = destination
            self.live[destination] = sequence
            self.free_slots.remove(destination)
            self.free_slots.append(source)
        heapq.heapify(self.free_slots)
        return moves


def find_stop_string(tokenizer, tokens: list[int], stop_strings: list[str]) -> int | None:
    """How many response tokens to keep: the shortest prefix whose text contains a stop string.

    None when the decoded response contains none. The prefix ends with the token that completes the
    stop string, so the string itself stays in the response (as the stop token does).
    """
    def contains(length: int) -> bool:
        text = tokenizer.decode(tokens[:length])
        return any(stop in text for stop in stop_strings)

    if not tokens or not contains(len(tokens)):
        return None
    low, high = 1, len(tokens)  # contains(high) holds; find the smallest such length
    while low < high:
        middle = (low + high) // 2
        if contains(middle):
            high = middle
        else:
            low = middle + 1
    return low
