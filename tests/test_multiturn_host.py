"""The episode loop's host side (`engine/multiturn.py`): garbage collection paused while it runs, and the runner-less
stand-in that the profiling tools' `--stub-runner` times it with."""

from __future__ import annotations

import gc
import pathlib
import subprocess
import sys
import threading

from benchmarks.multiturn import FixedIds, SlowTool
from benchmarks.profiling.multiturn_trace import StubRunner
from hybridrl.envs.base import EnvironmentSession
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout import multiturn as rollout_multiturn
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.multiturn import collect_due, collections_paused
from hybridrl.rollout.multiturn import EpisodeBudget, make_sessions
from test_multiturn import TOKENIZER, make_model
from test_multiturn_failures import FixedLatency


class GcProbe(FixedLatency):
    """Records, at every step, whether automatic garbage collection is on."""

    seen: list[bool] = []

    async def step(self, text):
        GcProbe.seen.append(gc.isenabled())
        return await super().step(text)


def test_garbage_collection_is_off_while_episodes_run_and_back_on_after():
    GcProbe.seen = []
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER)
    assert gc.isenabled()
    episodes = engine.generate_episodes(make_sessions(GcProbe, [{}] * 3, n=1, name="probe.py:GcProbe"),
                                        ObservationRenderer(TOKENIZER),
                                        SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
                                        EpisodeBudget())
    assert [episode.num_turns for episode in episodes] == [3] * 3
    assert GcProbe.seen == [False] * 9 and gc.isenabled()


def test_paused_collections_resume_when_the_last_pause_ends_in_any_thread_and_only_if_they_were_on():
    inner_entered, outer_may_leave = threading.Event(), threading.Event()
    states = []

    def other_loop():
        with collections_paused():
            inner_entered.set()
            outer_may_leave.wait(5)
        states.append(gc.isenabled())  # this thread's pause ended, the main thread's has not

    with collections_paused():
        thread = threading.Thread(target=other_loop)
        thread.start()
        assert inner_entered.wait(5)
        outer_may_leave.set()
        thread.join(5)
        states.append(gc.isenabled())
    assert states == [False, False] and gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    assert rollout_multiturn._PAUSES["count"] == 0


def test_with_collections_paused_the_engine_runs_the_pass_that_is_due_itself():
    """`collect_due` (called after GPU work is launched) collects the young generation once it is over its threshold,
    and leaves it alone below."""
    with collections_paused():
        gc.collect()
        kept = [[] for _ in range(gc.get_threshold()[0] // 2)]
        before = gc.get_count()[0]
        collect_due()
        assert gc.get_count()[0] >= before  # below the threshold: nothing collected
        kept += [[] for _ in range(gc.get_threshold()[0] * 2)]
        assert gc.get_count()[0] > gc.get_threshold()[0]  # automatic collection is off
        collect_due()
        assert gc.get_count()[0] < 10
    assert len(kept) > 0


def test_the_stub_runner_drives_the_loop_through_whole_episodes():
    """`--stub-runner` (turn_host, multiturn_trace) times the loop with `StubRunner` in place of the model's runner:
    the episodes it makes have every turn at its forced length, the stub's ids under the loss mask, each observation
    after its turn."""
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER)
    engine.runner = StubRunner()
    observation = list(range(10, 14))
    sessions = [EnvironmentSession(lambda row: SlowTool(row, 3, 0.001), {"ids": [1, 2, 3]}, name="slow", sample=i)
                for i in range(5)]
    episodes = engine.generate_episodes(sessions, FixedIds(observation),
                                        SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True, seed=0),
                                        EpisodeBudget(max_turns=3, max_episode_tokens=64))
    turn = [7] * 4
    for episode in episodes:
        assert episode.token_ids == [1, 2, 3] + turn + observation + turn + observation + turn
        assert episode.num_sampled_tokens == 12 and episode.done_reason == "done"
    assert engine.last_stats["decode_steps"] == 3 * 3  # each turn's first token comes from its prefill


def test_the_episodes_records_are_made_after_the_first_decode_block_is_launched(monkeypatch):
    """The record of each episode (its prompt's ids, mask and log-prob lists) is made while the GPU runs the first
    decode block, not before it with the GPU waiting, nor between the prefill's launch and the first block's (whose
    graph capture it would hold back); the episodes are the same."""
    events = []
    make_record = rollout_multiturn.EpisodeRun.make_record
    monkeypatch.setattr(rollout_multiturn.EpisodeRun, "make_record",
                        lambda run: (events.append("record"), make_record(run))[1])
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER)
    engine.runner = StubRunner()
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda prompts, admitted: (events.append("prefill"), prefill(prompts, admitted))[1]
    decode = engine.runner.decode
    engine.runner.decode = lambda *args: (events.append("decode"), decode(*args))[1]
    sessions = [EnvironmentSession(lambda row: SlowTool(row, 2, 0.001), {"ids": [1, 2, 3]}, name="slow", sample=i)
                for i in range(4)]
    episodes = engine.generate_episodes(sessions, FixedIds([9]), SamplingParams(max_new_tokens=2, ignore_eos=True),
                                        EpisodeBudget(max_turns=2, max_episode_tokens=64))
    assert events[:6] == ["prefill", "decode"] + ["record"] * 4 and events.count("record") == 4
    assert all(episode.token_ids == [1, 2, 3, 7, 7, 9, 7, 7] for episode in episodes)


def test_a_boundarys_observations_are_recorded_once_the_next_decode_block_is_launched(monkeypatch):
    """The answers of a turn boundary are taken as they come (what the resume feeds); their records (messages,
    observation ids) are made after the resume's prefill and the next decode block are launched, while the GPU runs
    them; the episodes are whole all the same."""
    events = []
    record_step = rollout_multiturn.EpisodeRun.record_step
    monkeypatch.setattr(rollout_multiturn.EpisodeRun, "record_step", lambda run: (
        events.append("record") if run._unrecorded is not None else None, record_step(run))[1])
    engine = BuiltinBackend(make_model("llama"), tokenizer=TOKENIZER)
    engine.runner = StubRunner()
    for name in ("extend", "decode"):
        method = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *args, name=name, method=method: (events.append(name), method(*args))[1])
    sessions = [EnvironmentSession(lambda row: SlowTool(row, 3, 0.001), {"ids": [1, 2, 3]}, name="slow", sample=i)
                for i in range(4)]
    episodes = engine.generate_episodes(sessions, FixedIds([9, 8]), SamplingParams(max_new_tokens=2, ignore_eos=True),
                                        EpisodeBudget(max_turns=3, max_episode_tokens=64))
    assert events.count("record") == 8
    first = events.index("record")
    assert events[first - 2:first] == ["extend", "decode"] and "extend" not in events[first:first + 4]
    assert all(episode.token_ids == [1, 2, 3, 7, 7, 9, 8, 7, 7, 9, 8, 7, 7] for episode in episodes)
    assert all(len(episode.spans) == 6 and len(episode.messages) == 6 for episode in episodes)


def test_the_trace_tool_runs_the_loops_on_the_stub_and_reports_the_calls_edges():
    """`multiturn_trace --stub-runner` end to end on CPU (the engine's loop and a --loop file in alternation): every
    boundary's marks, the call's edges and the table."""
    root = pathlib.Path(__file__).resolve().parent.parent
    command = ["-m", "benchmarks.profiling.multiturn_trace", "--tiny", "--quick", "--prompts", "2", "--n", "2",
               "--stub-runner", "--repeats", "1", "--loop", "hybridrl/rollout/engine/multiturn.py"]
    out = subprocess.run([sys.executable, *command], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("first prefill launched") >= 5  # single turn, then each loop in two rounds
    assert "boundary 1, ms after the sync: {'tools': 4" in out.stdout and "resume_waves 2" in out.stdout
    assert "multi-turn / single-turn tokens/s:" in out.stdout
