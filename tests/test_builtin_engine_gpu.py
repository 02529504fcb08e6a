"""Built-in rollout engine on CUDA: graphs and compiled code against eager and HF, memory across rollouts, no host
waits in the prefill and capture (run with `pytest -m gpu`; the device tool's machines have the GPU)."""

from __future__ import annotations

import pytest
import torch
from test_builtin_engine import PROMPTS, make_lora_model, make_model

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.decode_state import DecodeState
from hybridrl.rollout.engine.kernel_choices import triton_available


def without_host_syncs(method):
    """`method` run under sync debug mode "error": any host synchronisation inside it raises."""
    def call(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2-lora"])
def test_cuda_graphs_match_eager_and_hf(family):
    model = (make_lora_model("qwen2") if family == "qwen2-lora" else make_model(family)).cuda()
    prompts = [[i + 1, i + 2, i + 3, i + 4][: 1 + i % 4] for i in range(9)]
    greedy = SamplingParams(max_new_tokens=20, temperature=0, n=2)
    # compiled by default on CUDA; nothing kept, so the second call captures again (`test_kept_runs.py` keeps)
    graphed_engine = BuiltinBackend(model, max_num_seqs=5, sync_every=3, keep_runs=False)
    graphed = graphed_engine.generate(prompts, greedy)
    assert graphed_engine.last_stats["graphs_captured"] >= 1 and graphed_engine.last_stats["compiled"]
    assert graphed_engine.last_stats["captures_without_warmup"] == 0
    # The same shapes again: every graph is captured without a warm-up step, while the prefill still runs.
    assert [g.token_ids for g in graphed_engine.generate(prompts, greedy)] == [g.token_ids for g in graphed]
    stats = graphed_engine.last_stats
    assert stats["captures_without_warmup"] == stats["graphs_captured"] >= 1
    timeline = stats["timeline_ms"]  # host and GPU clocks of each phase; the GPU finishes a phase after queuing it
    assert list(timeline) == ["start", "prefill", "decode", "replay", "sync", "harvested", "released"]
    assert all(mark["gpu_ms"] >= 0 for mark in timeline.values())
    assert timeline["sync"]["gpu_ms"] <= timeline["sync"]["host_ms"] + 1  # the sync waited for the GPU
    eager = BuiltinBackend(model, use_cuda_graphs=False, compile=False).generate(prompts, greedy)
    assert [g.token_ids for g in graphed] == [g.token_ids for g in eager]
    for generation in graphed[::2]:
        prompt = prompts[generation.prompt_index]
        output = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=20,
                                pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        assert generation.token_ids == output[0, len(prompt):].tolist()
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, n=3, seed=5)
    sampling_engine = BuiltinBackend(model, max_num_seqs=4, keep_runs=False)
    graphed = sampling_engine.generate(prompts, sampled)
    eager = BuiltinBackend(model, max_num_seqs=4, use_cuda_graphs=False, compile=False).generate(prompts, sampled)
    assert [g.token_ids for g in graphed] == [g.token_ids for g in eager]
    again = sampling_engine.generate(prompts, sampled)  # captured without warm-up: the same draws
    assert sampling_engine.last_stats["captures_without_warmup"] >= 1
    assert [g.token_ids for g in again] == [g.token_ids for g in graphed]
    for generation in graphed[:6]:
        prompt = prompts[generation.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generation.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.float() / 0.9, -1).gather(1, torch.tensor(generation.token_ids, device="cuda")[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(generation.logprobs), reference.cpu(), atol=1e-4, rtol=0)
    plain = SamplingParams(max_new_tokens=12, temperature=0.7, n=3, seed=5)  # the one-pass blocked sampler
    plain_graphed = BuiltinBackend(model, max_num_seqs=4).generate(prompts, plain)
    plain_eager = BuiltinBackend(model, max_num_seqs=4, use_cuda_graphs=False, compile=False).generate(prompts, plain)
    assert [g.token_ids for g in plain_graphed] == [g.token_ids for g in plain_eager]
    for a, b in zip(plain_graphed, plain_eager):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("keep_runs", [False, True])
def test_repeated_rollouts_hold_no_more_memory(keep_runs):
    """Each rollout captures its graphs again (the KV cache is freed in between), or replays those of the run kept
    from the rollout before; what it leaves allocated must not grow from one rollout to the next (a new warm-up
    stream per rollout would hold a new cuBLAS workspace every step)."""
    model = make_model("qwen2").cuda()
    engine = BuiltinBackend(model, max_num_seqs=4, release_after_generate=True, keep_runs=keep_runs)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, n=2, seed=1)
    held = []
    for _ in range(4):
        engine.generate(PROMPTS, params)
        engine.release_memory()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert engine.last_stats["graphs_kept" if keep_runs else "graphs_captured"] >= 1
    assert held[1] == held[2] == held[3], held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_capture_and_slot_bookkeeping_never_wait_for_the_gpu(monkeypatch):
    """The host queues a prefill and records the decode graph while the GPU still runs the prefill; one
    synchronizing op among them (`tensor[index] = 1` copies the 1 from pageable memory) would leave the GPU
    idle every rollout. Under sync debug mode "error" any such op raises."""
    model = make_model("qwen2").cuda()
    # continuous batching: prefill waves, frees; nothing kept, so the second call captures again
    engine = BuiltinBackend(model, max_num_seqs=5, sync_every=3, keep_runs=False)
    params = SamplingParams(max_new_tokens=9, temperature=0.8, n=2, seed=3)
    first = engine.generate(PROMPTS, params)  # compiles and warms every shape

    monkeypatch.setattr(engine.runner, "prefill", without_host_syncs(engine.runner.prefill))
    monkeypatch.setattr(engine.runner.graphs, "capture", without_host_syncs(engine.runner.graphs.capture))
    monkeypatch.setattr(engine.runner, "move", without_host_syncs(engine.runner.move))
    monkeypatch.setattr(DecodeState, "free", without_host_syncs(DecodeState.free))
    again = engine.generate(PROMPTS, params)
    assert engine.last_stats["captures_without_warmup"] >= 1 and engine.last_stats["prefill_waves"] >= 2
    assert [g.token_ids for g in again] == [g.token_ids for g in first]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_prefill_layer_matches_eager_for_any_prompt_shape():
    """One compilation serves every (prompts, length) of a prefill chunk, and equals the eager layer."""
    from hybridrl.rollout.engine.llama_forward import compiled_decode_functions, prefill_layer, rope_table
    from hybridrl.rollout.engine.weights import resolve_weights

    model = make_model("qwen2").cuda()
    weights = resolve_weights(model, fuse_qkv=True)
    cos, sin = rope_table(model, 64, "cuda", torch.float32)
    compiled = compiled_decode_functions().prefill_layer
    frames = []
    for prompts, length in ((3, 7), (5, 13), (2, 40)):
        h = torch.randn(prompts, length, model.config.hidden_size, device="cuda")
        with torch.no_grad():
            got = compiled(weights, weights.layers[1], h, cos[:length], sin[:length])
            want = prefill_layer(weights, weights.layers[1], h, cos[:length], sin[:length])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[1] == frames[2], frames


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_sampling_kernels_draw_what_the_pytorch_sampler_draws():
    """Plain temperature sampling runs the Triton sampling kernels inside the captured decode graphs: the same
    tokens as the PyTorch sampler for the same seed, and log-probs within float32 rounding (HF checks them above)."""
    model = make_model("qwen2").cuda()
    prompts = [[i + 1, i + 2, i + 3][: 1 + i % 3] for i in range(8)]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, n=4, seed=11)
    with_kernels = BuiltinBackend(model, max_num_seqs=12, sync_every=5)
    mine = with_kernels.generate(prompts, params)
    assert with_kernels.last_stats["sampler"] == "triton" and with_kernels.last_stats["graphs_captured"] >= 1
    reference_engine = BuiltinBackend(model, max_num_seqs=12, sync_every=5, sampler="torch")
    reference = reference_engine.generate(prompts, params)
    assert reference_engine.last_stats["sampler"] == "torch"
    assert [g.token_ids for g in mine] == [g.token_ids for g in reference]
    for a, b in zip(mine, reference):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    filtered = with_kernels.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.8, top_k=5, seed=1))
    assert with_kernels.last_stats["sampler"] == "torch" and len(filtered) == len(prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("options", [dict(compile=True), dict(compile=False), dict(compile=False, sampler="torch")],
                         ids=["compiled", "uncompiled", "light"])
def test_calls_of_changing_batch_length_and_sampler_capture_cleanly(attention, options):
    """One engine, calls whose batch size, length and sampler change: a greedy call after a sampled one with the
    same shapes (its sampler compiled inside the CUDA-graph capture before the warm-up covered samplers), then
    new temperatures, filters, batches and lengths, and repeats. Every call equals the same engine without CUDA
    graphs, and no capture happens cold for a new sampler. Uncompiled too (`rollout.engine.compile=auto` with short
    responses): CUDA graphs of the eager step, with the PyTorch sampler as well (a light rollout's choices)."""
    if attention == "triton" and not triton_available():
        pytest.skip("needs triton")
    model = make_model("qwen2").cuda()
    prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(16)]
    calls = [(prompts[:4], SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=1, ignore_eos=True)),
             (prompts[:8], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),
             (prompts, SamplingParams(max_new_tokens=40, n=4, temperature=1.0, seed=2, ignore_eos=True)),
             (prompts[:3], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),
             (prompts[:8], SamplingParams(max_new_tokens=24, n=2, temperature=0.7, top_p=0.9, seed=3)),
             (prompts[:8], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),
             (prompts[:5], SamplingParams(max_new_tokens=16, n=3, temperature=0.8, seed=4, ignore_eos=True))]
    engine = BuiltinBackend(model, attention=attention, max_num_seqs=64, sync_every=4, **options)
    reference = BuiltinBackend(model, attention=attention, max_num_seqs=64, sync_every=4, use_cuda_graphs=False,
                               **options)
    for index, (call_prompts, params) in enumerate(calls):
        outputs = engine.generate(call_prompts, params)
        assert engine.last_stats["graphs_captured"] >= 1, index
        expected = reference.generate(call_prompts, params)
        assert [g.token_ids for g in outputs] == [g.token_ids for g in expected], index
        for a, b in zip(outputs, expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), index
        if index == 5:  # call 1 again: every signature warmed before, so all captured without a warm-up
            assert engine.last_stats["captures_without_warmup"] == engine.last_stats["graphs_captured"]
