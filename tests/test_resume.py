"""A multi-turn resume wave as device work (`engine/resume.py`): the graph buckets, the padded batch a CUDA graph
replays (padding rows must not touch what any real slot can see), the hashed uniforms against a pure-Python
reference, and whole episodes through the graph path (replayed eagerly on CPU) against the HF reference."""

from __future__ import annotations

import array
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import resume
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.llama_forward import EAGER_DECODE, extend_reference
from hybridrl.rollout.engine.resume import forward, graph_bucket, host_batch, resume_uniforms

sys.path.insert(0, os.path.dirname(__file__))
from test_multiturn import IM_END, TOKENIZER, assert_same_episodes, make_model, one_thread, sessions  # noqa: E402,F401
from test_multiturn_extend import assert_extended_alike, filled_cache, real_positions, resume_batch  # noqa: E402


def test_graph_buckets_pad_rows_to_powers_of_two_and_ids_to_eights_up_to_the_token_limit():
    assert graph_bucket(1, 1) == (1, 8)
    assert graph_bucket(3, 33) == (4, 40)
    assert graph_bucket(8, 8) == (8, 8)
    assert graph_bucket(65, 9) == (128, 16)
    assert graph_bucket(100, 33) is None  # 128 x 40 > GRAPH_MAX_TOKENS
    assert graph_bucket(512, 33) is None  # a large wave runs uncaptured
    for rows in range(1, 300, 7):
        for length in range(1, 80, 5):
            bucket = graph_bucket(rows, length)
            if bucket is not None:
                assert bucket[0] >= rows and bucket[1] >= length and bucket[1] % 8 == 0
                assert bucket[0] * bucket[1] <= resume.GRAPH_MAX_TOKENS and bucket[0] < 2 * rows


def python_uniform(key: int, column: int) -> float:
    """The hash of `resume_uniforms` in plain Python integers (no int64 tricks)."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    row = mix(mix(key & 0xFFFFFFFF) ^ (key >> 32))
    x = mix(row ^ mix((column * 0x9E3779B9) & 0xFFFFFFFF))
    return (x >> 8) / 2**24


def test_resume_uniforms_equal_the_python_hash_and_look_uniform():
    keys = [0, 1, 2, 1009, 3 * 1_000_003 + 5 * 1009 + 2, 2**40 + 7, 2**62 + 12345]
    got = resume_uniforms(torch.tensor(keys), 50)
    want = torch.tensor([[python_uniform(key, column) for column in range(50)] for key in keys])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    many = resume_uniforms(torch.arange(2000) * 1009 + 7, 64)  # (2000, 64): the keys of neighbouring episodes
    assert many.min() >= 0 and many.max() < 1
    counts = torch.histc(many, bins=20, min=0, max=1)
    expected = many.numel() / 20
    assert ((counts - expected).abs() < 5 * expected**0.5).all(), counts  # ~5 sigma
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002
    centred = many - 0.5
    assert (centred[:, 1:] * centred[:, :-1]).mean().abs() < 0.002  # neighbouring columns
    assert (centred[1:] * centred[:-1]).mean().abs() < 0.002  # neighbouring episodes
    assert torch.equal(resume_uniforms(torch.tensor(keys[::-1]), 50), got.flip(0))  # a row depends on its key only


def fake_run(w, kv, cos, sin):
    """What `forward` reads of the runner's `RunState`, for the per-slot layout."""
    return SimpleNamespace(weights=w, cos=cos, sin=sin, functions=EAGER_DECODE,
                           cache=SimpleNamespace(kv=kv, extend_access=lambda slots, kv_end: None))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_padded_to_its_graph_bucket_equals_the_reference_and_hides_its_padding(seed):
    """Rows and ids padded as a graph replays them: the real rows' hidden states give the reference's logits, the KV
    at every position a slot can see (its context and new ids) equals the reference's, and slots outside the wave
    are untouched, though the padding rows resume the wave's first slot."""
    model = make_model("qwen2", seed=seed)
    w, kv, cos, sin, contexts = filled_cache(model, seed, num_slots=6)
    slots = [3, 0, 4] if seed % 2 else [1, 4, 2, 0, 5]
    new, input_ids, lengths, starts, slots_t, kv_end = resume_batch(contexts, slots, seed, model.config.vocab_size)
    reference_kv = kv.clone()
    want = extend_reference(w, reference_kv, cos, sin, input_ids, lengths, starts, slots_t, kv_end)
    resumes = [(slot, ids, len(contexts[slot]), 0) for slot, ids in zip(slots, new)]
    rows, width = graph_bucket(len(slots), max(map(len, new)))
    assert rows > len(slots)  # there are padding rows
    batch = host_batch(resumes, rows, width + 3, "cpu")  # and padded ids past the bucket's own
    run = fake_run(w, kv, cos, sin)
    with torch.no_grad():
        got = forward(run, batch, kv_end, len(slots))
    assert_extended_alike(got, want, kv, reference_kv, reference_kv, contexts, slots, new)


@pytest.mark.parametrize("as_array", [False, True])
def test_host_batch_lays_out_ids_lengths_slots_starts_and_keys(as_array):
    """Ragged rows right-padded with 0, padding rows (length 0) resuming the first row's slot right after its new ids,
    keys cut to 63 bits (int64 on the device), all in one flat buffer; the ids given as lists or as int64 arrays (the
    episode loop converts them as the answers come in)."""
    rows = [[5, 6, 7], [8]]
    if as_array:
        rows = [array.array("q", ids) for ids in rows]
    resumes = [(3, rows[0], 10, 2**64 + 5), (1, rows[1], 4, 7)]
    batch = host_batch(resumes, 4, 5, "cpu")
    assert batch.input_ids.tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [0] * 5, [0] * 5]
    assert batch.lengths.tolist() == [3, 1, 0, 0]
    assert batch.slots.tolist() == [3, 1, 3, 3]
    assert batch.starts.tolist() == [10, 4, 13, 13]
    assert batch.keys.tolist() == [(2**64 + 5) & (2**63 - 1), 7, 0, 0]
    assert batch.packed.numel() == 4 * 5 + 4 * 4 and batch.input_ids.data_ptr() == batch.packed.data_ptr()


class EagerGraphs:
    """Stands in for `DecodeGraphs` on CPU: every "replay" runs the step again, reading the static inputs as a
    replay would (so inputs that were not copied in would show), and each step's signature is computed once."""

    def __init__(self):
        self.inputs, self.graphs, self.keys = {}, {}, []

    def step(self, key, signature, run_step, counts, before_replay=lambda: None):
        if key not in self.graphs:
            self.graphs[key] = signature()
        self.keys.append(key)
        run_step()

    def capture_ahead(self, key, signature, run_step, counts):
        return False  # a step captured ahead replays like any other here

    def drop(self):
        self.inputs, self.graphs = {}, {}


@pytest.mark.parametrize("layout", [dict(attention="sdpa"), dict(kv_cache="paged")])
def test_episodes_through_the_graph_path_equal_the_hf_reference(layout, monkeypatch):
    """The engine with its graph path on (replayed eagerly: `EagerGraphs`), so every resume wave is padded to its
    bucket and read from the static buffer: greedy episodes equal the HF reference loop's, per-slot and paged."""
    from hybridrl.envs.rendering import ObservationRenderer
    from hybridrl.rollout.hf import HFBackend
    from hybridrl.rollout.multiturn import EpisodeBudget

    model = make_model("qwen2")
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[IM_END])
    budget, renderer = EpisodeBudget(max_turns=4, max_episode_tokens=400), ObservationRenderer(TOKENIZER)
    engine = BuiltinBackend(model, tokenizer=TOKENIZER, sync_every=4, **layout)
    graphs = engine.runner.graphs = EagerGraphs()
    begin = engine.runner.begin

    def begin_with_graphs(*args, **kwargs):
        slots = begin(*args, **kwargs)
        engine.runner.run.use_graphs = True
        return slots
    monkeypatch.setattr(engine.runner, "begin", begin_with_graphs)
    episodes = engine.generate_episodes(sessions(n=3), renderer, params, budget)
    reference = HFBackend(model, TOKENIZER).generate_episodes(sessions(n=3), renderer, params, budget)
    assert_same_episodes(episodes, reference)
    extends = [key for key in graphs.keys if key[0] == "extend"]
    assert extends and engine.last_stats["observation_prefills"] > 0
    assert any(rows > 1 and rows & (rows - 1) == 0 for _, rows, _, _ in extends)  # padded to powers of two


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_extend_on_cuda_equals_the_reference(dtype):
    """A real CUDA graph of the compiled `extend_hidden`: captured at the first wave of a bucket (after a real run on
    a side stream), replayed for a second wave of other slots and then a third continuing the first: logits and KV
    equal the uncaptured path's (float32: the reference's within 1e-4; bf16: no further from a float32 run than the
    slow reference in bf16 is), and one graph serves the three waves."""
    from hybridrl.rollout.engine.graphs import CaptureCounts, DecodeGraphs
    from hybridrl.rollout.engine.llama_forward import compiled_decode_functions
    from hybridrl.rollout.engine.resume import replay

    w32, kv32, cos32, sin32, contexts = filled_cache(make_model("qwen2").cuda(), 0, num_slots=6)
    model = make_model("qwen2").cuda().to(dtype)  # the same weights (seeded), in a model of its own
    w, kv, cos, sin, _ = filled_cache(model, 0, num_slots=6)
    run = fake_run(w, kv, cos, sin)
    run.functions, run.counts, graphs = compiled_decode_functions(), CaptureCounts(), DecodeGraphs()
    slow_kv = kv.clone()
    for wave, slots in enumerate(([1, 4, 2], [0, 3, 5], [4, 1, 2])):
        new, input_ids, lengths, starts, slots_t, _ = resume_batch(contexts, slots, wave, model.config.vocab_size)
        args = [t.cuda() for t in (input_ids, lengths, starts, slots_t)]
        with torch.no_grad():
            exact = extend_reference(w32, kv32, cos32, sin32, *args, 64)
            slow = extend_reference(w, slow_kv, cos, sin, *args, 64)
            batch = host_batch([(s, ids, len(contexts[s]), 0) for s, ids in zip(slots, new)], 4, 16, "cuda")
            got = replay(run, batch, 64, 3, graphs)
        if dtype == torch.float32:
            torch.testing.assert_close(got, exact, atol=1e-4, rtol=0)
            for mine, theirs in zip(real_positions(kv, contexts, slots, new),
                                    real_positions(kv32, contexts, slots, new)):
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
        else:
            fast_error, slow_error = (got - exact).abs().max().item(), (slow - exact).abs().max().item()
            assert fast_error <= 1.5 * slow_error + 1e-2, (wave, fast_error, slow_error)
        for slot, ids in zip(slots, new):
            contexts[slot] = contexts[slot] + ids
    assert list(graphs.graphs) == [("extend", 4, 16, 64)]


def test_decode_graphs_capture_ahead_only_signatures_warmed_before_and_each_key_once_per_call():
    """`capture_ahead` records a step before it is due only when an earlier call warmed its signature (a warm-up would
    run the step for real), without synchronizing, once per key and call; a key with a graph is left alone."""
    from hybridrl.rollout.engine.graphs import CaptureCounts, DecodeGraphs

    graphs, counts, captured = DecodeGraphs(), CaptureCounts(), []
    graphs.warmed.add(("warmed",))

    def capture(key, run_step, synchronize):
        captured.append((key, synchronize))
        graphs.graphs[key] = object()
    graphs.capture = capture
    never = lambda: pytest.fail("a step captured ahead must not run")  # noqa: E731
    assert not graphs.capture_ahead((4, 256), lambda: ("not warmed",), never, counts)
    assert not graphs.capture_ahead((4, 256), lambda: ("warmed",), never, counts)  # tried in this call already
    assert graphs.capture_ahead((4, 384), lambda: ("warmed",), never, counts)
    assert not graphs.capture_ahead((4, 384), lambda: ("warmed",), never, counts)  # has its graph
    assert captured == [((4, 384), False)] and counts.captures_without_warmup == 1
    graphs.drop()  # the next call
    assert graphs.capture_ahead((4, 256), lambda: ("warmed",), never, counts) and captured[-1] == ((4, 256), False)
