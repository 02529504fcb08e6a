"""Continuous-batching bookkeeping in pure Python: which sequence sits in which KV slot.

No tensors here (the runner in `runner.py` owns them), so every decision of the engine's loop (whom to admit,
how to chunk a prefill, how many steps until the next sync, who finished and why, which slots to compact) can be
read and tested without a model. Sequences wait in prompt-major order; free
slots are handed out lowest-first, so the live sequences stay packed at the front and a decode step
only has to run over slots `0..batch-1`. When nothing is waiting and the live sequences have thinned
out, `compaction_moves` proposes moving the ones in high slots down so that a smaller batch-size
bucket (a smaller CUDA graph) covers them.

For the prefix-shared KV layout, `PromptEntries` also maps each live prompt to one prompt-cache entry,
refcounted by its live samples: the first admitted sample of a prompt takes a free entry (and its
prefill fills it), later samples share it, and the entry is free again once the last one finishes.
Compaction moves slots only; a sequence keeps its entry.

Multi-turn episodes (`engine/multiturn.py`) add a paused state: a sequence whose turn ended keeps its slot (and
so its KV) while its environment steps, and `resume` makes it live again once its observation has been prefilled
onto that KV; `prompt_len` then counts every token before the current turn, and `limit` caps the turn's tokens.

For the paged KV layout (`blocks.py`), admission also asks for free blocks (the prompt's unless a sample already
holds them, plus the first decode window), `reserve` grows each live sequence by the blocks its next window needs,
oldest first, and when blocks run out preempts the youngest live sequences: their blocks and slots are freed and
they go back to the front of the queue. A preempted sequence keeps what it sampled (`kept`; the runner keeps the
tokens and log-probs): re-admitted, it needs the blocks of its prompt (none when a sample still holds them) and of
its kept response plus a window, the runner prefills that context again and decoding continues after the kept
tokens (vLLM's "recompute" preemption: no token is sampled twice). Multi-turn on the paged layout: a
resume takes the blocks of its whole turn up front; sequences past their first turn are never preempted, but paused
episodes are evicted (blocks taken, context prefilled again on resume), and a resume that still does not fit waits
(`resume`, `_make_room`).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from hybridrl.rollout.engine.blocks import BlockAllocator, blocks_for


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
    limit: int | None = None
    """Tokens this turn may sample when fewer than the call's `max_new_tokens` (multi-turn budgets, or a benchmark's
    forced response lengths)."""
    admitted_at: int = 0
    """Admission order (paged layout: the youngest live sequences are preempted first)."""
    context: int = 0
    """Multi-turn: tokens after the prompt and before the current turn (earlier turns and observations), whose KV
    the paged layout keeps in the sequence's response blocks; 0 in a first turn."""
    needs_context: bool = False
    """Multi-turn, paged: its blocks were taken while it was paused (`Scheduler._evict`), so its resume must prefill
    everything after the prompt again; the caller clears it once it has."""
    kept: int = 0
    """Paged: response tokens it had sampled when it was last preempted (`Scheduler._preempt`), which its re-admission
    keeps: it starts at `generated = kept`, its context is prefilled again and none of them is sampled again."""


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

    def __init__(self, prompt_indices: list[int], prompt_lens: list[int], num_slots: int,
                 blocks: BlockAllocator | None = None, window: int = 1, max_new_tokens: int = 1,
                 limits: Sequence[int] | None = None, limits_at_sync: bool = False) -> None:
        """`blocks` (paged layout) with `window`, the decode steps between syncs, and `max_new_tokens`: admission and
        growth by blocks. `limits`: per-sequence caps on response tokens. `limits_at_sync`: a sequence's limit is
        checked at the syncs only, so it may run past it until the next one (the extra tokens are dropped), as a
        sequence that stops on EOS idles until then; otherwise (multi-turn turns) a sync falls due at every limit."""
        self.waiting = deque(SequenceSlot(i, p, prompt_lens[p], limit=None if limits is None else limits[i])
                             for i, p in enumerate(prompt_indices))
        self.num_slots, self.prompt_lens = num_slots, prompt_lens
        self.buckets = batch_buckets(num_slots)
        self.free_slots = list(range(num_slots))  # a min-heap
        self.live: dict[int, SequenceSlot] = {}  # slot -> sequence
        self.paused: dict[int, SequenceSlot] = {}  # slot -> sequence waiting for its observation (multi-turn)
        self.entries = PromptEntries(prompt_entries_needed(len(set(prompt_indices)), num_slots))
        self.blocks, self.window, self.max_new_tokens = blocks, window, max_new_tokens
        self.limits_at_sync = limits_at_sync
        self.evicted: list[int] = []  # paused slots whose response blocks were taken, for the runner to reset
        self.admissions = self.preemptions = self.preempted_tokens = 0
        self.decoded_tokens = 0  # response tokens the decode steps sampled, counted at the syncs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def admit(self) -> list[SequenceSlot]:
        """Move as many waiting sequences as there are free slots into the lowest free slots."""
        admitted = []
        while self.waiting and self.free_slots and self._blocks_fit(self.waiting[0]):
            sequence = self.waiting.popleft()
            sequence.slot = heapq.heappop(self.free_slots)
            sequence.generated = sequence.kept or 1  # a new sequence's prefill draws its first token
            sequence.admitted_at, self.admissions = self.admissions, self.admissions + 1
            if self.blocks is None:
                sequence.entry, sequence.fills_entry = self.entries.acquire(sequence.prompt_index)
            else:
                sequence.fills_entry = self.blocks.admit(sequence.index, sequence.prompt_index, sequence.prompt_len,
                                                         sequence.slot)
                self.blocks.grow(sequence.index, sequence.slot, self._window_rows(sequence))
            self.live[sequence.slot] = sequence
            admitted.append(sequence)
        assert admitted or self.live or self.paused or not self.waiting, "a sequence fits no block budget"
        return admitted

    # ---- paged layout -------------------------------------------------------------------------------
    def _window_rows(self, sequence: SequenceSlot) -> int:
        """Response KV rows the sequence fills by the end of its next decode window: a step writes the KV of the
        token it feeds, so after s steps from `generated` the rows are generated - 1 + s."""
        return sequence.context + self._rows_after_window(sequence, sequence.generated)

    def _rows_after_window(self, sequence: SequenceSlot, generated: int) -> int:
        return generated - 1 + min(self.window, self._limit(sequence, self.max_new_tokens) - generated)

    def _blocks_fit(self, sequence: SequenceSlot) -> bool:
        """Paged: whether admitting `sequence` leaves its first window (after its kept tokens, if it was preempted)
        and a 1% watermark free (no watermark when nothing runs, so one sequence always fits: `begin` refused any
        longer than the pool, and kept tokens plus a window never pass `max_new_tokens`)."""
        if self.blocks is None:
            return True
        blocks, rows = self.blocks, self._rows_after_window(sequence, sequence.kept or 1)
        need = blocks.prompt_cost(sequence.prompt_index, sequence.prompt_len) + blocks_for(rows, blocks.block_size)
        watermark = blocks.num_usable // 100 if self.live else 0
        return need + watermark <= len(blocks.free)

    def reserve(self) -> list[SequenceSlot]:
        """Paged: give every live sequence, oldest first, the blocks of its next decode window, preempting the
        youngest live sequences when the pool runs dry; returns the preempted ones (their slots are free now).
        Multi-turn: see `_make_room`."""
        if self.blocks is None:
            return []
        wanted = self._window_needs()
        if sum(need for _, _, need in wanted) <= len(self.blocks.free):  # the common case: no one is preempted
            for sequence, rows, _ in sorted(wanted, key=lambda item: item[0].admitted_at):
                self.blocks.grow(sequence.index, sequence.slot, rows)
            return []
        queue = deque(sorted(self.live.values(), key=lambda s: s.admitted_at))
        preempted: list[SequenceSlot] = []
        while queue:
            sequence = queue.popleft()
            rows = self._window_rows(sequence)
            if self._make_room(sequence, queue, preempted, rows):
                self.blocks.grow(sequence.index, sequence.slot, rows)
            else:  # a resume took its whole turn's blocks (`resume`), so its turn never grows here
                assert sequence.slot not in self.live, "a sequence past its first turn outgrew its reserved turn"
        self._requeue(preempted)
        return preempted

    def _window_needs(self) -> list[tuple[SequenceSlot, int, int]]:
        """(sequence, rows, blocks still needed) of the live sequences whose next window needs blocks: most windows
        of a sequence need none (a block holds several windows), and at every sync with hundreds of sequences live
        this loop is the scheduler's largest host cost, hence `_window_rows` and `response_cost` written out."""
        block_size, window, response = self.blocks.block_size, self.window, self.blocks.response
        wanted = []
        for sequence in self.live.values():
            generated = sequence.generated
            limit = self._limit(sequence, self.max_new_tokens)
            rows = sequence.context + generated - 1 + min(window, limit - generated)
            need = -(-rows // block_size) - len(response[sequence.index].blocks)
            if need > 0:
                wanted.append((sequence, rows, need))
        return wanted

    def _make_room(self, sequence: SequenceSlot, queue: deque[SequenceSlot] | Callable[[], deque[SequenceSlot]],
                   preempted: list[SequenceSlot], rows: int | None = None, extra: int = 0) -> bool:
        """Preempt the youngest of `queue` (live, younger than `sequence`) in their first turn until the blocks of
        `sequence`'s next window are free; then `sequence` itself if it is in its first turn; past it, evict paused
        episodes, youngest first (`_evict`). A live sequence past its first turn is never taken (a re-admission
        prefills a prompt and kept tokens, not the earlier turns and observations). `rows`: the response rows wanted
        (default: the next window's), and `extra` blocks besides. Returns whether they are free now (False:
        `sequence` was preempted, or it is past its first turn and must wait)."""
        need = extra + self.blocks.response_cost(sequence.index, self._window_rows(sequence) if rows is None else rows)
        # The common case, checked before the scan below: `reserve` asks for every live sequence at every sync, and
        # a scan each made that quadratic (128 ms per 512 x 256-token rollout on the CPU).
        if need <= len(self.blocks.free):
            return True
        if callable(queue):  # `resume`: the queue is made only when someone must give blocks back
            queue = queue()
        candidates = [s for s in queue if s.context == 0]
        while need > len(self.blocks.free) and candidates:
            victim = candidates.pop()
            queue.remove(victim)
            preempted.append(self._preempt(victim))
        if need <= len(self.blocks.free):
            return True
        if sequence.context == 0:
            preempted.append(self._preempt(sequence))
            return False
        paused = sorted((s for s in self.paused.values() if not s.needs_context), key=lambda s: s.admitted_at)
        while need > len(self.blocks.free) and paused:
            self._evict(paused.pop())
        return need <= len(self.blocks.free)

    def _evict(self, sequence: SequenceSlot) -> None:
        """Take a paused episode's blocks (its prompt's only if no other sample holds them); it keeps its slot and,
        when it resumes, its context is prefilled again (`needs_context`): from the prompt's end, or from position 0
        when its prompt's blocks had to be taken again (`fills_entry`)."""
        self.blocks.release(sequence.index, sequence.prompt_index)
        self.preemptions += 1
        self.preempted_tokens += sequence.context + sequence.generated
        sequence.needs_context = True
        self.evicted.append(sequence.slot)

    def _requeue(self, preempted: list[SequenceSlot]) -> None:
        for sequence in sorted(preempted, key=lambda s: s.index, reverse=True):
            self.waiting.appendleft(sequence)  # first in line again, in output order

    def _preempt(self, sequence: SequenceSlot) -> SequenceSlot:
        """Free a live sequence's slot and blocks; it keeps its sampled tokens (`kept`; the caller hands it to
        `ModelRunner.preempt`, which reads them from `slot` before the slot is used again)."""
        slot = sequence.slot
        self.finish(slot)
        self.preemptions += 1
        self.preempted_tokens += sequence.generated
        sequence.kept, sequence.slot, sequence.fills_entry = sequence.generated, slot, False
        return sequence

    def finish(self, slot: int) -> SequenceSlot:
        sequence = self.live.pop(slot) if slot in self.live else self.paused.pop(slot)
        heapq.heappush(self.free_slots, slot)
        if self.blocks is None:
            self.entries.release(sequence.prompt_index)
        elif not sequence.needs_context:  # an evicted episode holds no blocks
            self.blocks.release(sequence.index, sequence.prompt_index)
        return sequence

    def pause(self, slot: int) -> SequenceSlot:
        """A live sequence whose turn ended keeps its slot (its KV) until `resume` or `finish`."""
        sequence = self.live.pop(slot)
        self.paused[slot] = sequence
        return sequence

    def resume(self, slot: int, context_len: int, limit: int) -> tuple[bool, list[SequenceSlot]]:
        """A paused sequence is live again: `context_len` tokens precede its new turn, whose first token the
        observation's prefill draws; the turn may sample `limit` tokens. Paged: first it takes the blocks of the
        observation's prefill and of its whole turn (so its turn never needs blocks a live episode could not give
        back), from others if it must (`_make_room`); when even that leaves too few, it stays paused for a later
        try. Returns whether it resumed, and the live sequences preempted (their slots are free now)."""
        sequence = self.paused.pop(slot)
        saved = (sequence.prompt_len, sequence.limit, sequence.generated, sequence.context)
        sequence.prompt_len, sequence.limit, sequence.generated = context_len, limit, 1
        sequence.context = context_len - self.prompt_lens[sequence.prompt_index]
        self.live[slot] = sequence
        preempted: list[SequenceSlot] = []
        if self.blocks is not None:
            # Sorting every live sequence at every resume made a wave of 512 resumes quadratic; it is needed only
            # when the pool is short, so `_make_room` makes it then.
            queue = lambda: deque(sorted((s for s in self.live.values() if s is not sequence),  # noqa: E731
                                         key=lambda s: s.admitted_at))
            rows = sequence.context + self._limit(sequence, self.max_new_tokens) - 1
            prompt = self.prompt_lens[sequence.prompt_index]
            # Evicted: room for its prompt's blocks too, even if a sample holds them now (evicting it may free them).
            extra = blocks_for(prompt, self.blocks.block_size) if sequence.needs_context else 0
            fits = self._make_room(sequence, queue, preempted, rows, extra)
            self._requeue(preempted)
            if not fits:
                del self.live[slot]
                self.paused[slot] = sequence
                sequence.prompt_len, sequence.limit, sequence.generated, sequence.context = saved
                return False, preempted
            if sequence.needs_context:  # evicted: its prompt's blocks again (taken anew if no sample kept them)
                sequence.fills_entry = self.blocks.admit(sequence.index, sequence.prompt_index, prompt, slot)
            self.blocks.grow(sequence.index, slot, rows)
        return True, preempted

    def _limit(self, sequence: SequenceSlot, max_new_tokens: int) -> int:
        """The most tokens the device may sample for `sequence` before a sync (see `limits_at_sync`)."""
        if sequence.limit is None or self.limits_at_sync:
            return max_new_tokens
        return min(sequence.limit, max_new_tokens)

    def steps_until_sync(self, sync_every: int, max_new_tokens: int) -> int:
        """Decode steps before the next host check: `sync_every`, or fewer when a sequence reaches its length
        limit sooner (the host knows every length bound, so such a sequence is harvested at once)."""
        return min([sync_every] + [self._limit(s, max_new_tokens) - s.generated for s in self.live.values()])

    def furthest_position(self) -> int:
        """The furthest position (prompt + response tokens) any live or paused sequence has reached, as of the last
        sync (a paused slot inside the batch still runs, finished, at its own position)."""
        return max(s.prompt_len + s.generated for s in (*self.live.values(), *self.paused.values()))

    def rows_in_use(self) -> int:
        """Slots 0..rows-1 hold every live sequence (0 when none is live)."""
        return max(self.live) + 1 if self.live else 0

    def record_progress(self, gen_len: Sequence[int]) -> None:
        """Response lengths read at a sync point, indexed by slot."""
        for slot, sequence in self.live.items():
            self.decoded_tokens += gen_len[slot] - sequence.generated
            sequence.generated = gen_len[slot]

    def harvest(self, done: Sequence[int], tokens, stop_ids: set[int],
                cut_at_stop_string: Callable[[list[int]], int | None] | None, pause: bool = False) -> list[Finished]:
        """Finish the live sequences that are done (stop token, length or their turn's `limit`) or contain a stop
        string, and free their slots (`pause`: keep them, paused). `tokens` (rows, max_new_tokens) indexable by
        slot; `cut_at_stop_string(response)` -> how many tokens to keep, or None (`find_stop_string`)."""
        finished = []
        for slot in list(self.live):
            sequence = self.live[slot]
            at_limit = sequence.limit is not None and sequence.generated >= sequence.limit
            if not (done[slot] or at_limit or cut_at_stop_string):
                continue
            length, reason = min(sequence.generated, sequence.limit or sequence.generated), None
            if cut_at_stop_string:
                cut = cut_at_stop_string(tokens[slot, :length].tolist())
                if cut is not None:
                    length, reason = cut, "stop"
            if reason is None and (done[slot] or at_limit):
                reason = "stop" if int(tokens[slot, length - 1]) in stop_ids else "length"
            if reason is not None:
                finished.append(Finished(self.pause(slot) if pause else self.finish(slot), slot, length, reason))
        return finished

    def batch_size(self) -> int:
        """The smallest bucket that covers every live slot."""
        if not self.live:
            return 0
        return self.buckets[bisect.bisect_left(self.buckets, max(self.live) + 1)]

    def next_batch_size(self) -> int | None:
        """The bucket below the current batch's when the live sequences thin out and are about to fit it (fewer than
        the slots, at most a quarter more than that bucket, nothing waiting): the batch a compaction will soon move
        to, whose decode step is worth recording ahead (`ModelRunner.capture_decode_ahead`); None otherwise (a batch
        whose sequences all end together never needs it)."""
        if self.waiting or not self.live or len(self.live) == self.num_slots:
            return None
        index = bisect.bisect_left(self.buckets, self.batch_size())
        smaller = self.buckets[index - 1] if index else None
        return smaller if smaller and len(self.live) <= smaller + max(1, smaller // 4) else None

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


@dataclass(frozen=True)
class Finished:
    """A harvested sequence: it sat in `slot`, and its response is the first `length` tokens there."""

    sequence: SequenceSlot
    slot: int
    length: int
    reason: str


def prefill_chunks(prompt_lens: list[int], prompt_indices: list[int], max_tokens: int) -> list[list[int]]:
    """Prompts to prefill, grouped into chunks of at most `max_tokens` padded tokens (a chunk of one prompt may
    exceed it). Sorted by length first, so prompts of similar lengths share a chunk: less padding."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    for prompt_index in sorted(prompt_indices, key=lambda p: prompt_lens[p]):
        # Ascending lengths: this prompt is the chunk's longest (a max over the chunk made this quadratic, tens of
        # ms per wave of 512 multi-turn resumes).
        if chunk and prompt_lens[prompt_index] * (len(chunk) + 1) > max_tokens:
            chunks.append(chunk)
            chunk = []
        chunk.append(prompt_index)
    if chunk:
        chunks.append(chunk)
    return chunks


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
