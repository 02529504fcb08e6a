"""Multi-turn episodes on the built-in engine: a sequence pauses while its environment steps, others keep decoding.

The loop over scheduler and runner of `backend.generate`, with turns:
1. begin: slots sized for whole episodes (`max_episode_tokens` positions each), per-slot (SDPA) KV layout;
2. admit waiting episodes and prefill their prompts (each distinct prompt once);
3. resume: for each observation that has come back, prefill only the new ids onto the slot's own KV (the turn's
   last sampled token, whose KV no decode step wrote, then the observation) and draw the next turn's first token;
4. decode a few steps over the live slots; paused slots in the batch are marked finished and left alone;
5. harvest ended turns (stop token, stop string, per-turn limit): append the sampled ids to the episode, pause the
   slot, and start its environment step as an asyncio task (a sync environment runs in a worker thread, see
   `EnvironmentSession`), so it runs while the next decode steps do; the loop yields to the event loop after
   every decode block, and waits only when no sequence is live (`idle_s`);
6. a finished step either ends the episode (its slot is freed) or queues its observation for step 3.

Where multi-turn time goes besides decoding, and what the loop does about it:
- Turns that end together start their tools together, and those answer over a few milliseconds (the tasks start
  one after another). Resuming whichever answered first and decoding a block for them makes the rest wait a whole
  block (a decode step costs the same for the batch bucket whatever its live share), and the episodes drift apart
  for good: every later turn ends in two or more waves, each costing extra steps. So when nothing is live, the
  loop waits for the first answer, then for the steps started after it, each expected as long after its own start
  as the first one took (the calls of one harvest start over its whole length, and the host may stall in the middle
  of it), at most a full decode block in all; then for stragglers until none has come for a tenth of a block (at
  least `GATHER_QUIET_S`): waiting costs those already back at most about a block, not waiting costs a straggler a
  whole block. It resumes them as one wave; after a decode block it yields to the event loop twice (a timer's
  callback, then the task it wakes), so answers already due join the next block. `last_stats` reports
  `resume_waves` and `decode_blocks`.
- Environment steps start while the harvest is still decoding the other turns' texts (eagerly on Python 3.12+, each
  running up to its first wait as it is started, `envs.base.start_task`; before 3.12 a yield every `_START_EVERY`
  ended turns lets the event loop start the last few), and the turns are recorded in their episodes only after the
  last step has started, so a tool's latency overlaps the host's bookkeeping.
- Slots of ended episodes are freed in one call per collection, not one per episode.
- A resume's observation moves the sequences' key bucket on at once: the decode graph of the next bucket is recorded
  while the GPU runs a block (`runner.capture_decode_ahead`), not when it is due with the GPU waiting.

Choices:
- The prefix-shared layout (attention="triton") stores one response of `max_new_tokens` per slot after a shared
  prompt, so a sequence cannot grow by observations there: multi-turn is refused with it. The paged layout
  (kv_cache="paged") keeps an episode's prompt in its shared blocks and the rest in blocks taken as it grows (the
  observation's prefill writes and reads through the block table). Episodes are admitted by the blocks they need
  now. When blocks run out, live sequences in their first turn are preempted (they keep what they sampled and
  continue after it when re-admitted: `engine/preemption.py`); an episode past it
  that needs blocks evicts paused episodes (youngest first; their prompt's blocks too when no sample holds them),
  whose context is prefilled again when they resume (`Scheduler._make_room`); a resume that still does not fit
  waits for the live ones to pause (with nothing live, every other episode can be evicted, and `begin` refused a
  pool smaller than one episode).
- Each resumed turn's uniforms are a hash of (seed, episode, turn) (`resume.resume_uniforms`, on the device for a
  whole wave), so a seeded run gives the same episodes whatever order the environments answer in.
- The observations that are back at one point are prefilled together (padded, chunked by `max_prefill_tokens`, a
  small last chunk joining the one before: `resume.resume_chunks`).
"""

from __future__ import annotations

import array
import asyncio
import time

import torch

from hybridrl.envs.base import EAGER_TASKS, start_task
from hybridrl.envs.episode import Episode
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.kernel_choices import attention_path
from hybridrl.rollout.engine.kv_cache import PrefixSharedKVCache
from hybridrl.rollout.engine.runner import KV_LEN_BUCKET
from hybridrl.rollout.engine.scheduler import Scheduler
from hybridrl.rollout.multiturn import EpisodeRun, close_runs, collect_due, collections_paused

_SEED_STRIDE = 1_000_003
GATHER_QUIET_S = 0.002
"""With nothing live, environment answers that follow each other by less than this (or a tenth of a full decode
block, if longer) are resumed as one wave."""
_START_EVERY = 8
class EpisodeLoop:
    """One `generate_episodes` call on a `BuiltinBackend` (see the module docstring for its phases)."""

    def __init__(self, backend, runs: list[EpisodeRun], params: SamplingParams, stop_ids: list[int], budget) -> None:
        device = next(backend.model.parameters()).device
        if attention_path(backend.options.attention, device, backend.options.kv_cache).layout is PrefixSharedKVCache:
            raise ValueError("multi-turn episodes need the per-slot KV layout or the paged one, since the "
                             "prefix-shared one (attention='triton') keeps a single response per slot; use "
                             "rollout.engine.attention=sdpa or rollout.engine.kv_cache=paged.")
        self.backend, self.runner, self.runs, self.params = backend, backend.runner, runs, params
        self.stop_ids = stop_ids
        distinct: dict[tuple[int, ...], int] = {}
        self.prompt_of, previous, index = [], None, -1
        for run in runs:  # the samples of a prompt come together: a tuple (and its hash) per prompt, not per episode
            if run.prompt_ids != previous:
                index, previous = distinct.setdefault(tuple(run.prompt_ids), len(distinct)), run.prompt_ids
            self.prompt_of.append(index)
        self.prompts = [list(p) for p in distinct]
        self.budget = budget
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        self.resume_waves = self.decode_blocks = 0
        self.step_seconds = 0.0  # wall time per decode step of the latest full block

    async def run(self) -> list[Episode]:
        with collections_paused():
            return await self._run()

    async def _run(self) -> list[Episode]:
        runner, params = self.runner, self.params
        num_slots = runner.begin(self.prompts, params, self.stop_ids, num_sequences=len(self.runs),
                                 max_len=self.budget.max_episode_tokens)
        # One sequence per episode; its index is the episode's. Paged: blocks are taken as episodes grow.
        scheduler = Scheduler(self.prompt_of, [len(p) for p in self.prompts], num_slots, runner.block_allocator(),
                              self.backend.sync_every, params.max_new_tokens)
        self.pending: dict[asyncio.Task, int] = {}  # environment step -> slot
        self.started_at: dict[asyncio.Task, float] = {}  # environment step -> when the harvest started it
        self.answers: list[asyncio.Task] = []  # finished environment steps not yet collected, in finishing order
        self.waiter: asyncio.Future | None = None  # set when an answer comes in or the alarm rings (`_next_wake`)
        self.rang = False  # the gather's alarm has rung (`_gather_answers`)
        self.ready: list[tuple[int, array.array, int, int, int]] = []  # slot, ids to feed, context, limit, key
        self.unrecorded: list[EpisodeRun] = []  # episodes with a step taken and not recorded yet (`_record_steps`)
        # Episode -> its sequence, for turns the budget ends before `max_new_tokens`: the device stops a turn at
        # `max_new_tokens` (its done flag), the harvest looks for these itself (not through every live sequence).
        self.short_turns: dict[int, object] = {}
        finished = records_made = False
        try:
            while scheduler.has_work or scheduler.paused:
                admitted = scheduler.admit()  # 2.
                if admitted:
                    for sequence in admitted:
                        sequence.limit = self.runs[sequence.index].turn_limit(params.max_new_tokens)
                        if sequence.limit < params.max_new_tokens:
                            self.short_turns[sequence.index] = sequence
                    self._apply_blocks(scheduler, [])
                    runner.prefill(self.prompts, admitted)  # (no collection here: the first block's launch is next)
                self._resume(scheduler)  # 3.
                self._apply_blocks(scheduler, scheduler.reserve())  # paged: blocks for the next window
                if scheduler.live:
                    steps = scheduler.steps_until_sync(self.backend.sync_every, params.max_new_tokens)  # 4.
                    started = time.perf_counter()
                    batch, furthest = scheduler.batch_size(), scheduler.furthest_position() + steps
                    runner.decode(batch, runner.kv_len(furthest), steps)
                    # The next key bucket, recorded while the GPU runs this block, when the turn (or a resume's
                    # observation) may reach it soon.
                    runner.capture_decode_ahead(batch, runner.kv_len(furthest + KV_LEN_BUCKET // 2))
                    if not records_made:
                        # The episodes' records, made while the GPU runs the first decode block: not earlier, where
                        # they would hold back the first block's launch (with its graph's capture) behind the prefill.
                        for run in self.runs:
                            run.make_record()
                        records_made = True
                    self._record_steps()
                    collect_due()  # garbage collection paused (`run`): its passes run here, while the GPU decodes
                    self.decode_blocks += 1
                    await self._harvest(scheduler)  # 5.
                    if steps == self.backend.sync_every:  # a full block; a short one is mostly its harvest
                        self.step_seconds = (time.perf_counter() - started) / steps
                    runner.move(scheduler.compaction_moves())
                    for _ in range(2 if self.pending else 0):  # answers due: the timer's callback, the task it wakes
                        await asyncio.sleep(0)
                elif self.pending:
                    started = time.perf_counter()
                    await self._gather_answers(scheduler)
                    runner.run.stats.idle_s += time.perf_counter() - started
                else:  # paged: with nothing live every other episode can be evicted, and `begin` fitted one
                    assert not self.ready, "a resume found too few blocks with nothing running or pending"
                self._collect(scheduler)  # 6.
            finished = True
        finally:
            self._record_steps()
            for task in self.pending:
                task.cancel()
            # An environment step cancelled here may still run in its thread; close() must not start beside it.
            await asyncio.gather(*self.pending, return_exceptions=True)
            runner.record_scheduling(scheduler)
            self.backend.last_stats = runner.end(finished, release=self.backend.release_after_generate)
            self.backend.last_stats.update(resume_waves=self.resume_waves, decode_blocks=self.decode_blocks)
            await close_runs(self.runs)
        return [run.episode for run in self.runs]

    async def _gather_answers(self, scheduler: Scheduler) -> None:
        """Nothing is live: wait for the first environment answer, then for the steps started after it (until each is
        as old as the first was when it answered, at most a decode block) and for those that follow closely (see the
        module docstring), so that turns which ended together resume together. Answers are collected as they come,
        so that after the last one only its own bookkeeping is left before the wave resumes."""
        block = self.step_seconds * self.backend.sync_every
        quiet = max(GATHER_QUIET_S, 0.1 * block)
        await self._next_wake()
        now = last = time.perf_counter()
        latency = min(now - self.started_at[task] for task in self.answers)
        self._collect(scheduler)
        expected = max((self.started_at[task] + latency for task in self.pending), default=now)
        deadline = min(expected + quiet, now + (block or latency))
        # One alarm, at the deadline and then `quiet` after the latest answer, not a timer made and cancelled at each of
        # hundreds of wake-ups: the gather ends when it rings with no answer in the last `quiet` seconds.
        loop = asyncio.get_running_loop()
        alarm = loop.call_later(max(deadline - now, quiet), self._ring)
        try:
            while self.pending:
                await self._next_wake()
                if not self.answers:  # the alarm: a step that finished in its pass has its callback queued behind it
                    await asyncio.sleep(0)
                if self.answers:
                    last = time.perf_counter()
                    self._collect(scheduler)
                if self.rang and self.pending:
                    self.rang = False
                    if time.perf_counter() - last >= quiet:
                        return
                    alarm = loop.call_later(last + quiet - time.perf_counter(), self._ring)
        finally:
            alarm.cancel()
            self.rang = False

    def _answered(self, task: asyncio.Task) -> None:
        """A started environment step finished (its done callback): queue it for `_collect`, wake `_next_wake`.
        One callback per step, where `asyncio.wait` over the pending steps would add and remove one on every step still
        waiting at each wake-up, hundreds of times per turn boundary."""
        self.answers.append(task)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _ring(self) -> None:
        """The gather's alarm (`_gather_answers`)."""
        self.rang = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _next_wake(self) -> None:
        """Until an answer is in or the gather's alarm has rung (at once if either happened already)."""
        if not (self.answers or self.rang):
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def _apply_blocks(self, scheduler: Scheduler, preempted: list) -> None:
        """Paged: write the block-table rows the scheduler changed, then park the preempted sequences' slots (after
        the writes: one admitted in this pass has writes of its own pending)."""
        if scheduler.blocks:
            evicted, scheduler.evicted = scheduler.evicted, []
            self.runner.write_blocks(scheduler.blocks.take_writes(), evicted)
        self.runner.preempt(preempted)

    def _resume(self, scheduler: Scheduler) -> None:
        resumes, preempted, deferred = [], [], []
        for item in self.ready:
            slot, feed, context_len, limit, key = item
            # Before the prefill: the paged layout takes the blocks it writes here, or has the resume wait.
            resumed, taken = scheduler.resume(slot, context_len, limit)
            preempted += taken
            if not resumed:
                deferred.append(item)
                continue
            start = context_len - len(feed)  # the last sampled token's position: its KV is not written yet
            sequence = scheduler.live[slot]
            if limit < self.params.max_new_tokens:
                self.short_turns[sequence.index] = sequence
            if sequence.needs_context:  # its blocks were taken while it was paused: from the prompt's end, or all
                start = 0 if sequence.fills_entry else len(self.prompts[self.prompt_of[sequence.index]])
                sequence.needs_context = False
                run = self.runs[sequence.index]
                run.record_step()
                feed = run.episode.token_ids[start:]
            resumes.append((slot, feed, start, key))
        self._apply_blocks(scheduler, preempted)
        if resumes:
            # Evicted episodes that took their prompt's blocks anew write its KV first: another sample of the prompt
            # resumed in this wave reads it (in one forward, each layer writes before it reads; chunks may split).
            for part in ([r for r in resumes if r[2] == 0], [r for r in resumes if r[2] > 0]):
                if part:
                    self.runner.extend(part)
            self.resume_waves += 1
        self.ready = deferred

    async def _harvest(self, scheduler: Scheduler) -> None:
        """Ended turns: pause their slots, start their environment steps (eagerly, or yielding every `_START_EVERY`
        turns before Python 3.12, so the steps started so far run while the other texts are decoded), then append their
        sampled ids to the episodes."""
        rows = scheduler.rows_in_use()
        done, gen_len = self.runner.read_progress(rows)
        scheduler.record_progress(gen_len)
        cut = self.backend._stop_string_cut(self.params)
        live = scheduler.live
        limits = any(s.generated >= s.limit for s in self.short_turns.values() if live.get(s.slot) is s)
        if not (cut or limits or any(done[slot] for slot in live)):
            return
        tokens, logprobs = self.runner.read_outputs(rows)
        ended = scheduler.harvest(done, tokens, set(self.stop_ids), cut, pause=True)
        for item in ended:
            self.short_turns.pop(item.sequence.index, None)
        slots = [item.slot for item in ended]
        # One conversion of every ended row to Python lists (of ints and floats), not one per row and then one per
        # element: at 512 turns a boundary that is most of the harvest's own host time.
        width = max((item.length for item in ended), default=0)
        token_rows = [ids if len(ids) == item.length else ids[:item.length]
                      for item, ids in zip(ended, tokens[slots, :width].tolist())]
        # The boundary's answers fall due as long after the last start as the tool takes: the loop's names are local.
        texts, runs, pending, started_at, answers = [], self.runs, self.pending, self.started_at, self.answers
        answered, now = self._answered, time.perf_counter
        for count, (item, ids) in enumerate(zip(ended, token_rows), 1):
            run = runs[item.sequence.index]
            text = run.turn_text(ids, item.reason)
            texts.append(text)
            task = start_task(run.session.step(text))
            pending[task], started_at[task] = item.slot, now()
            if task.done():  # eagerly, with no waiting (a final answer's step): no callback through the event loop
                answers.append(task)
            else:
                task.add_done_callback(answered)
            if count % _START_EVERY == 0 and not EAGER_TASKS:
                await asyncio.sleep(0)
        # Once every step has started (the steps need only the text, and the tools' latency hides this): the paused
        # slots marked on the device (before the next decode block), the turns recorded.
        self.runner.pause(slots)
        for item, ids, row_logprobs, text in zip(ended, token_rows, logprobs[slots, :width].tolist(), texts):
            self.runs[item.sequence.index].record_turn(ids, row_logprobs[:item.length], text)

    def _collect(self, scheduler: Scheduler) -> None:
        """Finished environment steps (`answers`, in the order they finished): end the episode (free its slot) or queue
        its observation."""
        answers, self.answers = self.answers, []
        ended, max_new_tokens = [], self.params.max_new_tokens
        for task in answers:
            slot = self.pending.pop(task)
            del self.started_at[task]
            index = scheduler.paused[slot].index
            run = self.runs[index]
            ids = run.take_step(task.result())  # an environment error propagates here, as one sentence
            if ids is None:
                scheduler.finish(slot)
                ended.append(slot)
            else:
                # What the resume needs, made here while other tools are still out, not after the last answer: the
                # ids to feed (the turn's last sampled token, whose KV no decode step wrote, then the observation) as
                # int64 already (`resume.host_batch` copies an int64 array whole), the context they complete, the
                # next turn's limit and its uniforms' key.
                feed = array.array("q", run.last_turn_ids[-1:])
                feed.extend(ids)
                self.ready.append((slot, feed, run.num_tokens, run.turn_limit(max_new_tokens),
                                   self.seed * _SEED_STRIDE + index * 1009 + run.num_turns))
                self.unrecorded.append(run)  # its record once the next decode block runs (`_record_steps`)
        self.runner.free(ended)

    def _record_steps(self) -> None:
        """The records of the steps `_collect` took (`EpisodeRun.record_step`), made while the GPU runs a decode block:
        at a turn boundary the answers come in with the GPU waiting for the last one."""
        unrecorded, self.unrecorded = self.unrecorded, []
        for run in unrecorded:
            run.record_step()
