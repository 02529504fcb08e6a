"""Built-in rollout engine vs Hugging Face on tiny random Llama / Qwen2 / Qwen3 / Mistral models (CPU, float32)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import runner
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.graphs import DecodeGraphs, step_signature
from hybridrl.rollout.engine.kernel_choices import auto_fuses_gate_up
from hybridrl.rollout.engine.weights import resolve_weights
from hybridrl.rollout.engine.sampling import SamplerSettings

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, initializer_range=0.2)
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),  # q/k/v bias
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),  # q/k RMSNorm
    "mistral": lambda: MistralConfig(**TINY),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20]]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threading only adds synchronisation overhead (10x slower on 2 cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).float().eval()
    # HF initialises biases to 0 and norms to 1; randomise them so they are actually exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                            pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under one HF forward pass: (len(response),)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def next_token_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1].float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf_generate_and_forward_logprobs(family):
    model = make_model(family)
    outputs = BuiltinBackend(model).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    assert [g.prompt_index for g in outputs] == list(range(len(PROMPTS)))
    for prompt, generation in zip(PROMPTS, outputs):
        assert generation.token_ids == hf_greedy(model, prompt, 16)
        assert generation.finish_reason == "length"
        reference = hf_logprobs(model, prompt, generation.token_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), reference, atol=1e-4, rtol=0)


def test_greedy_with_eos_stops_like_hf():
    model = make_model("qwen2")
    free_run = BuiltinBackend(model).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    eos = free_run[0].token_ids[5]  # a token greedy decoding does produce, so some responses stop early
    model.generation_config.eos_token_id = eos
    outputs = BuiltinBackend(model).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    for prompt, generation in zip(PROMPTS, outputs):
        expected = hf_greedy(model, prompt, 16)
        if eos in expected:  # HF pads after eos
            expected = expected[: expected.index(eos) + 1]
        assert generation.token_ids == expected
        assert generation.finish_reason == ("stop" if expected[-1] == eos else "length")
    assert outputs[0].finish_reason == "stop" and len(outputs[0].token_ids) <= 6
    forced = BuiltinBackend(model).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert [g.token_ids for g in forced] == [g.token_ids for g in free_run]


def test_sampled_frequencies_match_softmax():
    model = make_model("llama")
    prompt, temperature, num_samples = [5, 6, 7], 0.7, 6000
    outputs = BuiltinBackend(model).generate(
        [prompt], SamplingParams(max_new_tokens=1, temperature=temperature, n=num_samples, seed=1))
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in outputs]), minlength=128).double()
    logits = next_token_logits(model, prompt).double()
    expected = torch.softmax(logits / temperature, -1) * num_samples
    # Pearson chi-square over tokens with enough expected mass (the rest pooled into one cell).
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    expected_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected_cells > 0
    chi2 = (((observed_cells - expected_cells) ** 2) / expected_cells)[keep].sum().item()
    dof = int(keep.sum()) - 1
    bound = dof + 5 * math.sqrt(2 * dof)  # ~5 sigma of the chi-square distribution
    assert chi2 < bound, (chi2, dof)
    # The test can fail: the same counts against the wrong temperature are rejected.
    wrong = torch.softmax(logits / 1.0, -1) * num_samples
    wrong_cells = torch.cat([wrong[big], wrong[~big].sum()[None]])
    assert (((observed_cells - wrong_cells) ** 2) / wrong_cells)[keep].sum().item() > bound
    # Returned log-probs are the unfiltered tempered log-softmax.
    first = outputs[0]
    assert abs(first.logprobs[0] - torch.log_softmax(logits / temperature, -1)[first.token_ids[0]].item()) < 1e-4


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=5, top_p=0.5)])
def test_filters_never_sample_outside_the_allowed_set(filters):
    model = make_model("qwen3")
    temperature, prompt = 1.3, [8, 9, 10]
    params = SamplingParams(max_new_tokens=3, temperature=temperature, n=150, seed=3, **filters)
    outputs = BuiltinBackend(model).generate([prompt], params)
    allowed_cache: dict[tuple, set] = {}
    for generation in outputs:
        for position, token in enumerate(generation.token_ids):
            prefix = tuple(prompt + generation.token_ids[:position])
            if prefix not in allowed_cache:
                probs = torch.softmax(next_token_logits(model, list(prefix)) / temperature, -1)
                allowed_cache[prefix] = allowed_set(probs, **filters)
            assert token in allowed_cache[prefix], (filters, position, token)
        torch.testing.assert_close(torch.tensor(generation.logprobs),
                                   hf_logprobs(model, prompt, generation.token_ids, temperature), atol=1e-4, rtol=0)
    assert len({tuple(g.token_ids) for g in outputs}) > 1  # it did sample


def allowed_set(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    """Reference filter, written independently: top-k, then nucleus (renormalised), then min-p."""
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:top_k] if top_k else order
    mass = sum(probs[i].item() for i in keep)
    nucleus, total = [], 0.0
    for i in keep:
        nucleus.append(i)
        total += probs[i].item() / mass
        if total >= top_p - 1e-6:
            break
    largest = probs[nucleus[0]].item()
    return {i for i in nucleus if probs[i].item() >= min_p * largest - 1e-7}


class LetterTokenizer:
    """Token t decodes to one letter, so a stop string of two letters spans two tokens."""

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_stop_strings_truncate_after_the_completing_token():
    model = make_model("qwen2")
    tokenizer = LetterTokenizer()
    free_run = BuiltinBackend(model).generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0))
    stop = tokenizer.decode(free_run[1].token_ids[6:8])
    outputs = BuiltinBackend(model, tokenizer=tokenizer, sync_every=3).generate(
        PROMPTS, SamplingParams(max_new_tokens=20, temperature=0, stop_strings=[stop, "@@"]))
    for full, generation in zip(free_run, outputs):
        text = tokenizer.decode(full.token_ids)
        if stop in text:
            cut = text.index(stop) + len(stop)
            assert generation.token_ids == full.token_ids[:cut]
            assert generation.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-5)
            assert generation.finish_reason == "stop"
        else:
            assert generation.token_ids == full.token_ids and generation.finish_reason == "length"
    assert outputs[1].finish_reason == "stop" and len(outputs[1].token_ids) <= 8
    with pytest.raises(ValueError, match="tokenizer"):
        BuiltinBackend(model).generate(PROMPTS, SamplingParams(stop_strings=["x"]))


def test_continuous_batching_matches_one_big_batch(monkeypatch):
    model = make_model("llama")
    prompts = [[i + 1, i + 2, i + 3][: 1 + i % 3] for i in range(10)]
    free_run = BuiltinBackend(model).generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    model.generation_config.eos_token_id = free_run[0].token_ids[3]  # uneven lengths: slots free up mid-run
    params = SamplingParams(max_new_tokens=12, temperature=0, n=2)
    big = BuiltinBackend(model).generate(prompts, params)
    small_engine = BuiltinBackend(model, max_num_seqs=3, sync_every=2)
    monkeypatch.setattr(runner, "KV_LEN_BUCKET", 4)  # decode attention over growing key prefixes too
    small = small_engine.generate(prompts, params)
    assert small_engine.last_stats["num_slots"] == 3 and small_engine.last_stats["prefill_waves"] >= 5
    # The call's timeline: first prefill and decode of the first wave, the last sync, in time order (CPU: host only).
    timeline = small_engine.last_stats["timeline_ms"]
    assert list(timeline) == ["start", "prefill", "decode", "sync", "harvested", "released"]
    host = [mark["host_ms"] for mark in timeline.values()]
    assert host == sorted(host) and host[0] == 0 and all("gpu_ms" not in mark for mark in timeline.values())
    assert [g.token_ids for g in small] == [g.token_ids for g in big]
    assert [g.finish_reason for g in small] == [g.finish_reason for g in big]
    assert {g.finish_reason for g in big} == {"stop", "length"}
    for a, b in zip(small, big):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # A KV budget in GiB too small for even one sequence is a clear error, not a crash.
    with pytest.raises(ValueError, match="kv_cache_memory"):
        BuiltinBackend(model, kv_cache_memory=1e-9).generate(prompts, params)


def test_engine_reads_parameters_in_place():
    model = make_model("qwen3")
    engine = BuiltinBackend(model)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = [g.token_ids for g in engine.generate(PROMPTS, params)]
    with torch.no_grad():  # what an optimizer step does: update the same tensors
        model.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
        model.model.layers[0].self_attn.k_norm.weight.add_(0.5)
    after = [g.token_ids for g in engine.generate(PROMPTS, params)]
    assert after != before
    assert after == [hf_greedy(model, p, 8) for p in PROMPTS]


def test_seed_makes_sampling_reproducible():
    model = make_model("qwen2")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=7)
    first = BuiltinBackend(model).generate(PROMPTS, params)
    second = BuiltinBackend(model).generate(PROMPTS, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert len({tuple(g.token_ids) for g in first}) > 1


def test_supports_names_the_reason():
    ok, reason = BuiltinBackend.supports(make_model("qwen3"))
    assert ok
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    ok, reason = BuiltinBackend.supports(gpt2)
    assert not ok and "gpt2" in reason
    with pytest.raises(ValueError, match="rollout.backend=hf"):
        BuiltinBackend(gpt2)
    dynamic = LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    ok, reason = BuiltinBackend.supports(AutoModelForCausalLM.from_config(dynamic))
    assert not ok and "dynamic" in reason


def test_freed_slot_of_a_long_prompt_does_not_break_shorter_key_buckets(monkeypatch):
    model = make_model("qwen2")
    long_prompt, short_prompts = list(range(1, 41)), [[5], [6, 7], [8]]  # 4 slots: no compaction
    eos = BuiltinBackend(model).generate([long_prompt], SamplingParams(max_new_tokens=4, temperature=0))[0].token_ids[1]
    model.generation_config.eos_token_id = eos
    monkeypatch.setattr(runner, "KV_LEN_BUCKET", 4)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    outputs = BuiltinBackend(model, sync_every=1).generate([long_prompt] + short_prompts, params)
    assert outputs[0].finish_reason == "stop" and len(outputs[0].token_ids) == 2
    for prompt, generation in zip(short_prompts, outputs[1:]):
        expected = hf_greedy(model, prompt, 12)
        assert generation.token_ids == (expected[: expected.index(eos) + 1] if eos in expected else expected)


@pytest.mark.parametrize("attention", ["sdpa", "triton"])  # per-slot KV; prefix-shared (the GPU default) on its CPU reference
def test_compaction_after_early_stops_keeps_greedy_outputs(monkeypatch, attention):
    """Slots 0-5 stop within a few tokens while 6 and 7 run on, so the scheduler moves those two into a smaller
    batch bucket (their KV and per-slot state copied to new slots); every output still equals HF's greedy
    tokens cut at the first stop token. Counts the compactions, so the test cannot pass without one."""
    from hybridrl.rollout.engine import scheduler as scheduling

    model = make_model("qwen2")
    prompts = [[i + 1, (3 * i) % 50 + 2, (7 * i) % 40 + 3][: 1 + i % 3] for i in range(8)]
    greedy = [hf_greedy(model, prompt, 12) for prompt in prompts]
    running_on = set(greedy[6]) | set(greedy[7])
    stops = {next(t for t in tokens if t not in running_on) for tokens in greedy[:6]}
    compactions, plan = [], scheduling.Scheduler.compaction_moves
    monkeypatch.setattr(scheduling.Scheduler, "compaction_moves", lambda self: compactions.append(plan(self)) or compactions[-1])
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=sorted(stops), ignore_eos=True)
    outputs = BuiltinBackend(model, sync_every=1, attention=attention).generate(prompts, params)
    assert any(compactions), "no compaction happened"
    for tokens, generation in zip(greedy, outputs):
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        assert generation.token_ids == tokens[:cut]
        assert generation.finish_reason == ("stop" if cut < len(tokens) or tokens[-1] in stops else "length")
    for prompt, generation in zip(prompts[6:], outputs[6:]):  # the moved slots' log-probs, after the move too
        want = hf_logprobs(model, prompt, generation.token_ids)
        assert generation.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_compaction_keeps_each_sequences_random_draws(monkeypatch):
    """Sampled: a sequence's uniforms are drawn at admission, one per response position, and move with it when a
    compaction copies its slot, so its tokens are those of a run with no compaction at all (same seed)."""
    from hybridrl.rollout.engine import scheduler as scheduling

    model = make_model("qwen2")
    prompts = [[i + 1, (3 * i) % 50 + 2][: 1 + i % 2] for i in range(8)]
    # Stop on a third of the vocabulary: most sequences end within a few tokens, a few run on.
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True,
                            stop_token_ids=list(range(0, model.config.vocab_size, 3)))
    compactions, plan = [], scheduling.Scheduler.compaction_moves
    monkeypatch.setattr(scheduling.Scheduler, "compaction_moves", lambda self: compactions.append(plan(self)) or compactions[-1])
    moved = BuiltinBackend(model, sync_every=1).generate(prompts, params)
    assert any(compactions), "no compaction happened"
    monkeypatch.setattr(scheduling.Scheduler, "compaction_moves", lambda self: [])
    unmoved = BuiltinBackend(model, sync_every=1).generate(prompts, params)
    assert [g.token_ids for g in moved] == [g.token_ids for g in unmoved]
    assert len({len(g.token_ids) for g in moved}) > 2  # the stops really differ between sequences


def test_compile_defaults_to_eager_on_cpu():
    engine = BuiltinBackend(make_model("qwen2"))
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0))
    assert engine.last_stats["compiled"] is False


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"), reason="set HYBRIDRL_SLOW_TESTS=1 (~2 min of C++ compilation)")
@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2-lora"])
def test_compiled_decode_equals_eager_on_cpu(family):
    model = make_lora_model("qwen2") if family == "qwen2-lora" else make_model(family)
    for params in (SamplingParams(max_new_tokens=12, temperature=0, n=2),
                   SamplingParams(max_new_tokens=12, temperature=0.8, n=3, seed=3)):
        eager = BuiltinBackend(model, compile=False).generate(PROMPTS, params)
        engine = BuiltinBackend(model, compile=True)
        for _ in range(2):  # the second call reuses the compiled code
            compiled = engine.generate(PROMPTS, params)
            assert engine.last_stats["compiled"]
            assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
            for a, b in zip(compiled, eager):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def make_lora_model(family: str, target_modules="all-linear", **lora_kwargs):
    """A tiny model with rank-4 LoRA on its linear layers and non-zero B, so the adapter matters."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(family), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM", **lora_kwargs))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_greedy_matches_peft_generate_and_forward_logprobs(family):
    model = make_lora_model(family)
    assert BuiltinBackend.supports(model) == (True, "ok")
    engine = BuiltinBackend(model)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    for prompt, generation in zip(PROMPTS, outputs):
        assert generation.token_ids == hf_greedy(model, prompt, 16)
        reference = hf_logprobs(model, prompt, generation.token_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), reference, atol=1e-4, rtol=0)
    with model.disable_adapter():  # the adapter really changes the policy, and switching it off is followed
        base = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
        assert [g.token_ids for g in base] == [hf_greedy(model, p, 16) for p in PROMPTS]
    assert [g.token_ids for g in base] != [g.token_ids for g in outputs]


def test_lora_engine_reads_adapter_in_place_and_handles_merged_and_subset_targets():
    model = make_lora_model("qwen2", target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    engine = BuiltinBackend(model)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = [g.token_ids for g in engine.generate(PROMPTS, params)]
    assert before == [hf_greedy(model, p, 8) for p in PROMPTS]
    with torch.no_grad():  # an optimizer step on the adapter only
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.mul_(-2.0)
    after = engine.generate(PROMPTS, params)
    assert [g.token_ids for g in after] != before
    assert [g.token_ids for g in after] == [hf_greedy(model, p, 8) for p in PROMPTS]
    model.merge_adapter()  # merged: the base weights carry the adapter, which must not be added twice
    merged = engine.generate(PROMPTS, params)
    assert [g.token_ids for g in merged] == [g.token_ids for g in after]
    for a, b in zip(merged, after):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_lora_supports_refuses_what_it_cannot_apply():
    ok, reason = BuiltinBackend.supports(make_lora_model("llama", use_dora=True))
    assert not ok and "DoRA" in reason
    ok, reason = BuiltinBackend.supports(make_lora_model("llama", target_modules=["q_proj", "lm_head"]))
    assert not ok and "lm_head" in reason
    model = make_lora_model("llama")
    model.add_adapter("second", type(model.peft_config["default"])(r=2, target_modules="all-linear"))
    model.base_model.set_adapter(["default", "second"])
    ok, reason = BuiltinBackend.supports(model)
    assert not ok and "several" in reason
    with pytest.raises(ValueError, match="rollout.backend=hf"):
        BuiltinBackend(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2-lora"])
def test_fused_projections_give_the_same_tokens_and_logprobs(family):
    """`fuse_qkv`: one stacked q/k/v matmul (biases included; Qwen3's q/k norms after the split) equals three;
    `fuse_gate_up`: one gate/up matmul equals two; with LoRA the projections stay separate and the adapter
    still applies."""
    model = make_lora_model("qwen2") if family == "qwen2-lora" else make_model(family)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    plain = BuiltinBackend(model).generate(PROMPTS, params)
    for fuse in (dict(fuse_qkv=True), dict(fuse_gate_up=True), dict(fuse_qkv=True, fuse_gate_up=True)):
        fused = BuiltinBackend(model, **fuse).generate(PROMPTS, params)
        for mine, reference in zip(fused, plain):
            assert mine.token_ids == reference.token_ids
            torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(reference.logprobs), atol=1e-5, rtol=0)
    layers = resolve_weights(model, fuse_qkv=True, fuse_gate_up=True).layers
    assert all((layer.qkv_weight is None) == (family == "qwen2-lora") for layer in layers)
    assert all((layer.gate_up_weight is None) == (family == "qwen2-lora") for layer in layers)


def test_fuse_gate_up_auto_keeps_the_projections_apart_on_cpu_and_bad_values_are_refused():
    model, params = make_model("qwen2"), SamplingParams(max_new_tokens=2, temperature=0)
    for option, fused in (("auto", False), (True, True), (False, False)):
        engine = BuiltinBackend(model, fuse_gate_up=option)
        engine.generate(PROMPTS[:2], params)
        assert engine.last_stats["fuse_gate_up"] is fused, option
    assert auto_fuses_gate_up(model) is False  # on CUDA: see the GPU test in test_decode_attention.py
    with pytest.raises(ValueError, match="fuse_gate_up must be true, false or 'auto'"):
        BuiltinBackend(model, fuse_gate_up="yes")
    with pytest.raises(ValueError, match="dequantize_4bit must be true, false or 'auto'"):
        BuiltinBackend(model, dequantize_4bit="yes")
    with pytest.raises(ValueError, match="sampler must be one of"):
        BuiltinBackend(model, sampler="triton")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rope_inside_the_attention_gives_the_same_tokens_and_logprobs(family):
    """With fused q/k/v and the prefix-shared attention, bias and RoPE move into the attention (its CPU
    reference here; the kernel in `test_decode_attention.py`); Qwen3's q/k norm keeps them in the step, as do
    unfused projections."""
    model, params = make_model(family), SamplingParams(max_new_tokens=12, temperature=0, n=2)
    plain = BuiltinBackend(model, attention="sdpa").generate(PROMPTS, params)
    inside = BuiltinBackend(model, attention="triton", fuse_qkv=True)
    kept = BuiltinBackend(model, attention="triton", fuse_qkv=False)
    for engine in (inside, kept):
        for mine, reference in zip(engine.generate(PROMPTS, params), plain):
            assert mine.token_ids == reference.token_ids
            torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(reference.logprobs), atol=1e-5, rtol=0)
    assert inside.last_stats["rope_in_attention"] == (family != "qwen3")
    assert not kept.last_stats["rope_in_attention"]


def test_compiling_raises_dynamos_recompile_limit(monkeypatch):
    """Every engine variant (shape, LoRA, fused copies) adds a compilation of the same decode functions; at
    Dynamo's default limit of 8 the ninth would fail under fullgraph=True."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    with torch._dynamo.config.patch(recompile_limit=8):  # restored on exit
        BuiltinBackend(make_model("llama"), compile=True).generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))
        assert torch._dynamo.config.recompile_limit >= 64


def test_quantized_projection_weights_are_refused():
    """A checkpoint that loads with quantized (integer) projection weights, e.g. bitsandbytes 4-bit, must not
    be read as if it were floating point: `supports` says no and the trainer falls back to `hf`."""
    model = make_model("llama")
    proj = model.model.layers[0].mlp.up_proj
    proj.weight = torch.nn.Parameter(torch.zeros(proj.weight.shape, dtype=torch.uint8), requires_grad=False)
    ok, reason = BuiltinBackend.supports(model)
    assert not ok and "torch.uint8 (quantized?)" in reason


def test_releasing_the_engine_hands_cached_memory_back_when_short(monkeypatch):
    """The engine's release asks `devices.release_cached_memory` (which empties the allocator's cache only when the
    device is short of memory, tested in test_optim.py) about the model's device, and a rollout's set-up does not
    ask at all (its tensors reuse the cached blocks); the removed option `rollout.empty_cuda_cache` is an unknown
    key."""
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError

    calls = []
    monkeypatch.setattr(runner, "release_cached_memory", lambda device: calls.append(device))
    engine = BuiltinBackend(make_model("llama"), release_after_generate=False)
    for _ in range(2):  # the second set-up drops the cache the first call kept
        engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))
    assert calls == []
    engine.release_memory()
    assert calls == [torch.device("cpu")]
    with pytest.raises(ConfigError, match="unknown config key 'rollout.empty_cuda_cache'"):
        load_config(None, ["rollout.empty_cuda_cache=false"])


def test_engine_section_of_the_config_reaches_the_engine():
    """`rollout.engine.*` (the advanced section) is what `build_rollout` hands the engine; each old top-level key
    names its new place."""
    import yaml

    from hybridrl.config.explain import explained_yaml
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError
    from hybridrl.training.components import build_rollout

    config = load_config(None, ["rollout.backend=builtin", "rollout.engine.attention=sdpa", "rollout.engine.fuse_qkv=false",
                                "rollout.engine.fuse_gate_up=true", "rollout.engine.sampler=torch",
                                "rollout.engine.dequantize_4bit=false"])
    engine = build_rollout(config, make_model("llama"), None, torch.device("cpu"))
    assert engine.options == runner.EngineOptions(attention="sdpa", fuse_qkv=False, fuse_gate_up=True, sampler="torch",
                                                  dequantize_4bit=False, compile=False)  # compile=auto on CPU
    for key in ("attention", "fuse_qkv", "fuse_gate_up", "dequantize_4bit"):
        with pytest.raises(ConfigError, match=f"'rollout.{key}' is now 'rollout.engine.{key}'"):
            load_config(None, [f"rollout.{key}=auto"])
    # `config show --explain` prints the nested section under its key, each field with its documentation.
    explained = yaml.safe_load(explained_yaml(config))
    assert explained["rollout"]["engine"] == dict(attention="sdpa", fuse_qkv=False, fuse_gate_up=True, sampler="torch",
                                                  dequantize_4bit=False, kv_cache="auto", kv_block_size=64,
                                                  compile="auto")
    assert "    # Decode attention." in explained_yaml(config)


def test_compile_auto_compiles_on_cuda_for_long_responses_only():
    """`rollout.engine.compile=auto`: the trainer's engine compiles on CUDA when responses are long enough for the
    compilation to pay; true / false are passed on as given. (The engine is built, not run: no GPU needed.)"""
    from hybridrl.config.loading import load_config
    from hybridrl.rollout.engine.kernel_choices import AUTO_COMPILE_MIN_NEW_TOKENS, auto_compiles
    from hybridrl.training.components import build_rollout

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long, short = AUTO_COMPILE_MIN_NEW_TOKENS, AUTO_COMPILE_MIN_NEW_TOKENS - 1
    assert auto_compiles(long, cuda) and not auto_compiles(short, cuda) and not auto_compiles(long, cpu)
    model = make_model("llama")
    for option, tokens, device, expected in (("auto", long, cuda, True), ("auto", short, cuda, False),
                                             ("auto", long, cpu, False), ("true", short, cuda, True),
                                             ("false", long, cuda, False)):
        config = load_config(None, ["rollout.backend=builtin", f"rollout.engine.compile={option}",
                                    f"rollout.max_new_tokens={tokens}"])
        assert build_rollout(config, model, None, device).options.compile is expected, (option, tokens, device)


def test_light_rollouts_take_kernels_that_need_no_building():
    """Short prompts and responses on CUDA (the time-to-accuracy run's): the `auto` kernel choices become SDPA and the
    PyTorch sampler, uncompiled; longer prompts, or any of those options (or the paged cache) set by hand, leave the
    usual choices. (The engine is built, not run: no GPU needed.)"""
    from hybridrl.config.loading import load_config
    from hybridrl.rollout.engine.kernel_choices import LIGHT_MAX_PROMPT_TOKENS, light_rollout
    from hybridrl.training.components import build_rollout

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    short = LIGHT_MAX_PROMPT_TOKENS
    assert light_rollout(6, short, cuda) and not light_rollout(6, short + 1, cuda)
    assert not light_rollout(64, short, cuda) and not light_rollout(6, short, cpu)
    model = make_model("llama")
    cases = (([], ("sdpa", "torch", False)),
             ([f"data.max_prompt_length={short + 1}"], ("auto", "auto", False)),
             (["rollout.max_new_tokens=64"], ("auto", "auto", True)),
             (["rollout.engine.attention=triton"], ("triton", "auto", False)),
             (["rollout.engine.compile=true"], ("auto", "auto", True)),
             (["rollout.engine.kv_cache=paged"], ("auto", "auto", False)))
    for extra, expected in cases:
        config = load_config(None, ["rollout.backend=builtin", "rollout.max_new_tokens=6",
                                    f"data.max_prompt_length={short}", *extra])
        options = build_rollout(config, model, None, cuda).options
        assert (options.attention, options.sampler, options.compile) == expected, extra


def test_timeline_keeps_the_first_mark_or_with_last_the_latest():
    import time

    from hybridrl.rollout.timeline import Timeline

    timeline = Timeline(torch.device("cpu"))
    timeline.mark("sync", last=True)
    timeline.mark("prefill")
    time.sleep(0.002)
    timeline.mark("prefill")  # a second wave: the first prefill's time stays
    timeline.mark("sync", last=True)  # the final sync: moves to the end with its new time
    report = timeline.report()
    assert list(report) == ["start", "prefill", "sync"]
    assert report["sync"]["host_ms"] - report["prefill"]["host_ms"] >= 2


def test_phase_seconds_counts_each_mark_when_both_clocks_reached_it():
    from hybridrl.rollout.timeline import phase_seconds

    report = {"start": {"host_ms": 0, "gpu_ms": 0}, "prefill": {"host_ms": 5, "gpu_ms": 5},
              "decode": {"host_ms": 30, "gpu_ms": 34}, "replay": {"host_ms": 50, "gpu_ms": 50},
              "sync": {"host_ms": 550, "gpu_ms": 550}, "harvested": {"host_ms": 553, "gpu_ms": 553},
              "released": {"host_ms": 560, "gpu_ms": 561}}
    assert phase_seconds(report) == pytest.approx({"before_decode": 0.050, "decode": 0.500, "after_decode": 0.011})
    uncaptured = {name: {"host_ms": mark["host_ms"]} for name, mark in report.items() if name != "replay"}
    assert phase_seconds(uncaptured) == pytest.approx({"before_decode": 0.030, "decode": 0.520, "after_decode": 0.010})
    assert phase_seconds({"start": {"host_ms": 0}}) == {}


class RecordingGraphs(DecodeGraphs):
    """`DecodeGraphs` on CPU: a warm-up runs the step, a "capture" records it without running it and its replay
    runs it, as a CUDA graph's would; `events` lists what happened, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def warm_up(self, run_step) -> None:
        self.events.append("warm_up")
        run_step()

    def capture(self, key, run_step, synchronize: bool):
        self.events.append("capture")
        self.graphs[key] = graph = SimpleNamespace(replay=run_step)
        return graph


def engine_with_recorded_graphs(model, monkeypatch, **options) -> tuple[BuiltinBackend, RecordingGraphs]:
    """An engine on CPU that takes the CUDA-graph path with `RecordingGraphs` in place of real graphs."""
    engine = BuiltinBackend(model, **options)
    engine.runner.graphs = graphs = RecordingGraphs()
    begin = engine.runner.begin

    def begin_with_graphs(*args, **kwargs):
        num_slots = begin(*args, **kwargs)
        engine.runner.run.use_graphs = True
        return num_slots

    monkeypatch.setattr(engine.runner, "begin", begin_with_graphs)
    return engine, graphs


def test_a_new_sampler_is_warmed_up_before_capture_even_at_known_shapes(monkeypatch):
    """A greedy call after a sampled one with the same tensor shapes: the greedy sampler has never run, so its
    first step must run for real (a warm-up, where a compiled sampler compiles) before any capture; capturing it
    straight away compiled inside the CUDA-graph capture, which fails. The same call again captures without a
    warm-up; a new temperature, batch or length warms up again. Tokens equal the engine without graphs. (Runs are not
    kept, so every call captures: a kept run's graphs would replay without any capture, `test_kept_runs.py`.)"""
    model = make_model("qwen2")
    prompts = [[3, 4, 5], [9, 10, 11], [12, 13, 14], [15, 16, 17], [1, 2, 3], [6, 7, 8], [18, 19, 20], [21, 22, 23]]
    calls = [(prompts[:4], SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=1, ignore_eos=True)),
             (prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),  # same shapes, greedy
             (prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)),  # all warmed now
             (prompts, SamplingParams(max_new_tokens=8, temperature=0.7, seed=2, ignore_eos=True)),
             (prompts[:3], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)),
             (prompts[:5], SamplingParams(max_new_tokens=12, n=3, temperature=1.0, top_p=0.8, seed=3, ignore_eos=True))]
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, sync_every=3, keep_runs=False)
    reference = BuiltinBackend(model, sync_every=3, use_cuda_graphs=False)
    for index, (call_prompts, params) in enumerate(calls):
        graphs.events.clear()
        outputs = engine.generate(call_prompts, params)
        assert [g.token_ids for g in outputs] == [g.token_ids for g in reference.generate(call_prompts, params)]
        stats = engine.last_stats
        assert graphs.events and stats["graphs_captured"] >= 1, index
        if index == 2:  # a repeat: every signature was warmed by the call before
            assert "warm_up" not in graphs.events and stats["captures_without_warmup"] == stats["graphs_captured"]
        else:  # a new sampler or new shapes: warmed up before the first capture, and none captured cold
            assert graphs.events[0] == "warm_up" and stats["captures_without_warmup"] == 0, (index, graphs.events)


def test_step_signature_tells_samplers_and_shapes_apart():
    tensors = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    greedy, sampled = SamplerSettings(temperature=0), SamplerSettings(temperature=1.0)
    base = step_signature(4, 128, (sampled, "triton"), tensors)
    assert base == step_signature(4, 128, (sampled, "triton"), tuple(t.clone() for t in tensors))
    for other in (step_signature(4, 128, (greedy, "torch"), tensors), step_signature(4, 128, (sampled, "torch"), tensors),
                  step_signature(2, 128, (sampled, "triton"), tensors),
                  step_signature(4, 128, (sampled, "triton"), (torch.zeros(4, 9), tensors[1]))):
        assert other != base


def test_the_step_signature_is_computed_only_for_steps_without_a_graph(monkeypatch):
    """The signature walks every tensor the step reads: computing it at every replayed step costs host time
    on each decode step. It is needed only when a (batch, kv_len) has no graph yet. (Nothing kept: a kept call's
    prefill is a graph too, `test_kept_runs.py`.)"""
    model = make_model("llama")
    engine, graphs = engine_with_recorded_graphs(model, monkeypatch, sync_every=4, keep_runs=False)
    computed = []
    signature = engine.runner.step_signature
    monkeypatch.setattr(engine.runner, "step_signature", lambda *args: computed.append(args) or signature(*args))
    engine.generate([[3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    stats = engine.last_stats
    assert stats["decode_steps"] > stats["graphs_captured"] >= 1
    assert len(computed) == stats["graphs_captured"]
