"""Kept runs (`rollout/engine/kept_runs.py`): a small call's KV cache, state and CUDA graphs reused by the next call of
its shape. On CPU the graphs are `RecordingGraphs` (test_builtin_engine.py), whose replay runs the step with the run
it was captured in, as a CUDA graph replays the tensors it recorded: a graph kept across a change of weights that it
cannot see replays the old weights, and the tokens then differ from the reference engine's."""

from __future__ import annotations

import pytest
import torch
from test_builtin_engine import engine_with_recorded_graphs, make_model
from test_builtin_engine_gpu import without_host_syncs

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import kept_runs
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.decode_state import DecodeState
from hybridrl.rollout.engine.weights import stacked

PROMPTS = [[3, 4, 5, 6], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [1, 2, 3], [6, 7, 8, 9]]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)


def kept_engine(model, monkeypatch, attention: str = "sdpa"):
    """An engine whose calls take the graph path on CPU, with stacked q/k/v and gate/up (the copies a kept graph
    reads), and the reference: no graphs, nothing kept."""
    options = dict(attention=attention, fuse_qkv=True, fuse_gate_up=True, sync_every=2)
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, **options)
    return engine, graphs, BuiltinBackend(model, use_cuda_graphs=False, keep_runs=False, **options)


def same_outputs(outputs, expected) -> None:
    assert [g.token_ids for g in outputs] == [g.token_ids for g in expected]
    assert [g.logprobs for g in outputs] == [g.logprobs for g in expected]


def nudge_in_place(model, scale: float = 0.5, seed: int = 1) -> None:
    """An optimizer step's effect: every parameter changed in place (same tensors, same addresses)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


@pytest.mark.parametrize("attention", ["sdpa", "triton"])  # per-slot and prefix-shared layouts (CPU references)
def test_a_kept_graph_replays_weights_changed_in_place_and_gives_the_references_tokens(monkeypatch, attention):
    model = make_model("qwen2")
    engine, graphs, reference = kept_engine(model, monkeypatch, attention)
    first = engine.generate(PROMPTS, SAMPLED)
    same_outputs(first, reference.generate(PROMPTS, SAMPLED))
    assert engine.last_stats["graphs_captured"] >= 1 and engine.last_stats["graphs_kept"] == 0
    captured = engine.last_stats["graphs_captured"]
    engine.release_memory()  # as the trainer does after each rollout
    for step in range(2):
        nudge_in_place(model, seed=step)
        graphs.events.clear()
        outputs = engine.generate(PROMPTS, SAMPLED)
        same_outputs(outputs, reference.generate(PROMPTS, SAMPLED))
        assert [g.token_ids for g in outputs] != [g.token_ids for g in first]  # the nudge changed the tokens
        assert graphs.events == [] and engine.last_stats["graphs_kept"] == captured  # nothing recorded again
        assert engine.last_stats["graphs_captured"] == 0


def test_new_prompts_of_the_same_shape_replay_the_prefill_graph_with_their_own_ids(monkeypatch):
    """A trainer's next batch: other prompts, the same counts and longest length, another seed. The kept prefill graph
    (and the decode graphs) replay on the new ids, index lists and lengths, copied into the graph's static inputs,
    and on the new seed's uniforms, drawn into the kept tensor the graph reads."""
    model = make_model("qwen2")
    engine, graphs, reference = kept_engine(model, monkeypatch)
    engine.generate(PROMPTS, SAMPLED)
    assert any(key[0] == "prefill" for key in engine.runner.kept.runs[next(iter(engine.runner.kept.runs))].graphs.graphs)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(1, 30, (len(prompt) if seed < 2 else 5 - index % 3,), generator=generator).tolist()
                   for index, prompt in enumerate(PROMPTS)]
        prompts[0] = prompts[0][:4] + [7] * (5 - len(prompts[0][:4]))  # the longest stays 5 tokens
        params = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=100 + seed, ignore_eos=True)
        graphs.events.clear()
        same_outputs(engine.generate(prompts, params), reference.generate(prompts, params))
        assert engine.last_stats["graphs_kept"] >= 2 and graphs.events == [], seed  # prefill + decode replayed


def test_a_replaced_weight_drops_the_kept_graphs(monkeypatch):
    """A parameter the trainer replaced (a new tensor: a module swapped, FSDP's gathered copy) has a new address:
    the kept graphs would replay the old one, so they are dropped and the steps captured again."""
    model = make_model("qwen2")
    engine, graphs, reference = kept_engine(model, monkeypatch)
    engine.generate(PROMPTS, SAMPLED)
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * -2.0)
    graphs.events.clear()
    same_outputs(engine.generate(PROMPTS, SAMPLED), reference.generate(PROMPTS, SAMPLED))
    assert engine.last_stats["graphs_kept"] == 0 and engine.last_stats["graphs_captured"] >= 1
    assert "capture" in graphs.events
    # Kept again from this call: the next call replays
    same_outputs(engine.generate(PROMPTS, SAMPLED), reference.generate(PROMPTS, SAMPLED))
    assert engine.last_stats["graphs_kept"] >= 1


def test_other_shapes_and_settings_get_runs_of_their_own(monkeypatch):
    """A trainer's training and evaluation rollouts alternate: each shape keeps its own run (two at most), and a
    new sampler setting (a constant inside the graphs) or a new shape never replays another's graphs."""
    model = make_model("qwen2")
    engine, graphs, reference = kept_engine(model, monkeypatch)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    cooler = SamplingParams(max_new_tokens=6, temperature=0.5, n=3, seed=7, ignore_eos=True)
    calls = [(PROMPTS, SAMPLED, 0), (PROMPTS[:4], greedy, 0), (PROMPTS, SAMPLED, 1), (PROMPTS[:4], greedy, 1),
             (PROMPTS, cooler, 0), (PROMPTS[:5], SAMPLED, 0), (PROMPTS[:4], greedy, 0)]  # the last: evicted (2 kept)
    for index, (prompts, params, kept) in enumerate(calls):
        same_outputs(engine.generate(prompts, params), reference.generate(prompts, params))
        assert (engine.last_stats["graphs_kept"] > 0) == bool(kept), index
    assert len(engine.runner.kept.runs) == kept_runs.MAX_KEPT_RUNS


def test_large_runs_are_not_kept_and_release_can_drop_them(monkeypatch):
    model = make_model("qwen2")
    engine, _, reference = kept_engine(model, monkeypatch)
    engine.generate(PROMPTS, SAMPLED)
    assert engine.runner.kept.runs and engine.cache is None  # kept, yet not the current cache (released)
    engine.release_memory(keep_small=False)
    assert not engine.runner.kept.runs and engine.runner.kept.weights is None
    monkeypatch.setattr(kept_runs, "KEEP_MAX_SHARE", 1e-9)  # every run is too large now
    same_outputs(engine.generate(PROMPTS, SAMPLED), reference.generate(PROMPTS, SAMPLED))
    engine.generate(PROMPTS, SAMPLED)
    assert not engine.runner.kept.runs and engine.last_stats["graphs_kept"] == 0


def test_a_reset_state_equals_a_new_one():
    state = DecodeState(4, 5, [2, 9], "cpu")
    for tensor in state.per_slot():
        tensor.copy_(torch.randint(0, 7, tensor.shape).to(tensor.dtype))
    state.reset()
    fresh = DecodeState(4, 5, [2, 9], "cpu")
    for kept, new in zip(state.per_slot(), fresh.per_slot()):
        assert torch.equal(kept, new)


def test_stacked_rewrites_a_fitting_buffer_in_place():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    buffer = torch.zeros(5, 4)
    assert stacked((a, b), buffer) is buffer and torch.equal(buffer, torch.cat((a, b)))
    for misfit in (torch.zeros(6, 4), torch.zeros(5, 4, dtype=torch.float64), None):
        result = stacked((a, b), misfit)
        assert result is not misfit and torch.equal(result, torch.cat((a, b)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [dict(), dict(attention="sdpa", compile=False, sampler="torch")],
                         ids=["default", "light"])
def test_kept_cuda_graphs_replay_the_weights_as_they_are_now(options):
    """Real CUDA graphs: an engine's kept graphs (prefill and decode) after two in-place changes of every weight and
    one replaced weight, each call with new prompts of the same shape, give the tokens of an engine that keeps
    nothing and captures afresh, log-probs within float rounding."""
    model = make_model("qwen2").cuda()
    engine = BuiltinBackend(model, max_num_seqs=64, sync_every=2, fuse_gate_up=True, **options)
    reference = BuiltinBackend(model, max_num_seqs=64, sync_every=2, fuse_gate_up=True, keep_runs=False, **options)
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 2 + i % 3] for i in range(8)]
    engine.generate(prompts, SAMPLED)
    engine.release_memory()
    assert engine.runner.kept.runs
    down = model.model.layers[1].mlp.down_proj
    for index, change in enumerate(("in place", "in place", "replaced")):
        prompts = [[(token * 7 + index) % 40 + 1 for token in prompt] for prompt in prompts]
        if change == "replaced":
            down.weight = torch.nn.Parameter(down.weight.detach() * -2.0)
        else:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.3 * torch.randn_like(parameter))
        outputs = engine.generate(prompts, SAMPLED)
        assert (engine.last_stats["graphs_kept"] >= 2) == (change == "in place"), change  # prefill + decode
        expected = reference.generate(prompts, SAMPLED)
        assert [g.token_ids for g in outputs] == [g.token_ids for g in expected], change
        for a, b in zip(outputs, expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), change
        engine.release_memory()


def test_a_trainer_keeps_its_rollout_run_and_trains_bitwise_as_without(tmp_path, monkeypatch):
    """Three GRPO steps with the built-in engine (CPU: no graphs, so the kept KV cache and state are what is reused,
    under weights the optimizer changed in place): the run is kept between steps, and the trained weights equal,
    bit for bit, those of a trainer whose runs are never kept."""
    from test_trainer import make_trainer

    def trained(kept_share: float, out):
        monkeypatch.setattr(kept_runs, "KEEP_MAX_SHARE", kept_share)
        trainer = make_trainer(out, trainer__total_steps=3, rollout__backend="builtin", actor__lr=1e-2)
        kept_after = []
        step = trainer.step
        for _ in range(3):
            step()
            kept_after.append(len(trainer.parts.rollout.runner.kept.runs))
        return [p.detach().clone() for p in trainer.parts.actor.parameters()], kept_after

    weights, kept_after = trained(kept_runs.KEEP_MAX_SHARE, tmp_path / "kept")
    assert kept_after == [1, 1, 1]
    reference, never = trained(0.0, tmp_path / "fresh")
    assert never == [0, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(weights, reference))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kept_call_takes_its_run_back_and_replays_its_prefill_without_waiting_for_the_gpu(monkeypatch):
    """The second call of a shape: taking the kept run (state reset, uniforms drawn in place, weight addresses) and
    its prefill (inputs copied into the graph's static buffer, replay) queue work without one host synchronisation,
    so the host runs ahead of the GPU as in the first call (sync debug mode "error" raises on any)."""
    model = make_model("qwen2").cuda()
    engine = BuiltinBackend(model, max_num_seqs=64, attention="sdpa", compile=False, sampler="torch")
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 2 + i % 3] for i in range(8)]
    first = engine.generate(prompts, SAMPLED)
    engine.release_memory()

    monkeypatch.setattr(engine.runner, "begin", without_host_syncs(engine.runner.begin))
    monkeypatch.setattr(engine.runner, "prefill", without_host_syncs(engine.runner.prefill))
    again = engine.generate(prompts, SAMPLED)
    assert engine.last_stats["graphs_kept"] >= 2 and engine.last_stats["graphs_captured"] == 0
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
