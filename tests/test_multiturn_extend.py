"""The multi-turn resume's forward (`extend`): the per-layer pieces (eager and compiled) against the slow, obviously
right `extend_reference`, and both against one HF forward over the whole sequence, on tiny seeded float32 models."""

from __future__ import annotations

import importlib.util
import os
import random
import types

import pytest
import torch

from hybridrl.rollout.engine import llama_forward
from hybridrl.rollout.engine.llama_forward import EAGER_DECODE, extend, extend_reference, prefill, rope_table
from hybridrl.rollout.engine.resume import resume_chunks
from hybridrl.rollout.engine.weights import resolve_weights
from test_multiturn import assert_same_episodes, both, make_model

MAX_LEN = 64
CPU_ATTENTIONS = [name for name in llama_forward.EXTEND_ATTENTIONS if name != "triton"]
"""The attentions that run on CPU tensors as they are; the Triton kernel runs on CPU only in the interpreter
(`test_the_extend_attention_kernel_equals_the_matmul_form_in_the_interpreter`)."""


def filled_cache(model, seed: int, num_slots: int = 5):
    """Weights, RoPE tables and a cache whose slots hold random contexts (prefilled), plus those contexts; on the
    model's device and in its dtype."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    w = resolve_weights(model, fuse_qkv=True)
    cos, sin = rope_table(model, MAX_LEN, device, dtype)
    kv = torch.zeros(len(w.layers), 2, num_slots, w.num_kv_heads, MAX_LEN, w.head_dim, device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    contexts = [torch.randint(1, vocab, (int(torch.randint(1, 30, (), generator=generator)),),
                              generator=generator).tolist() for _ in range(num_slots)]
    width = max(map(len, contexts))
    with torch.no_grad():
        prefill(w, kv, cos, sin, torch.tensor([c + [0] * (width - len(c)) for c in contexts], device=device),
                torch.tensor([len(c) for c in contexts], device=device), torch.arange(num_slots, device=device),
                torch.arange(num_slots, device=device))
    return w, kv, cos, sin, contexts


def resume_batch(contexts, slots: list[int], seed: int, vocab: int):
    """New ids of uneven lengths (1..12) for the given slots, right-padded with garbage ids, not zeros, so that a
    padding id leaking into a real row's attention would change the result."""
    generator = torch.Generator().manual_seed(seed + 1000)
    new = [torch.randint(1, vocab, (int(torch.randint(1, 13, (), generator=generator)),), generator=generator).tolist()
           for _ in slots]
    width = max(map(len, new))
    input_ids = torch.tensor([ids + [7] * (width - len(ids)) for ids in new])
    starts = torch.tensor([len(contexts[s]) for s in slots])
    kv_end = max(len(contexts[s]) + len(ids) for s, ids in zip(slots, new))
    return new, input_ids, torch.tensor([len(ids) for ids in new]), starts, torch.tensor(slots), kv_end


def real_positions(kv, contexts, slots, new):
    """The cache's keys/values at every real position of the resumed slots (padding's are not compared)."""
    return [kv[:, :, s, :, :len(contexts[s]) + len(ids)] for s, ids in zip(slots, new)]


def assert_extended_alike(got, want, kv, reference_kv, before, contexts, slots, new):
    """Logits equal the reference's; the KV at every real position of the resumed slots too; every other slot is as
    it was `before`."""
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for mine, theirs in zip(real_positions(kv, contexts, slots, new),
                            real_positions(reference_kv, contexts, slots, new)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)  # float32 rounding through the layers
    untouched = [s for s in range(kv.shape[2]) if s not in slots]
    torch.testing.assert_close(kv[:, :, untouched], before[:, :, untouched], atol=0, rtol=0)


@pytest.mark.parametrize("attention", CPU_ATTENTIONS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_equals_the_reference_and_a_full_forward(family, seed, attention, monkeypatch):
    """Uneven rows in an order unlike the slots', a key length bucketed past the longest row, and slots left out:
    logits and the KV written equal the reference; logits equal HF's forward over context + new ids; with each of
    `extend`'s attentions."""
    monkeypatch.setattr(llama_forward, "extend_attention", attention)
    model = make_model(family, seed=seed)
    w, kv, cos, sin, contexts = filled_cache(model, seed)
    slots = [3, 0, 4] if seed % 2 else [1, 4, 2, 0]
    new, input_ids, lengths, starts, slots_t, kv_end = resume_batch(contexts, slots, seed, model.config.vocab_size)
    reference_kv = kv.clone()
    want = extend_reference(w, reference_kv, cos, sin, input_ids, lengths, starts, slots_t, kv_end)
    for bucket in (kv_end, min(MAX_LEN, kv_end + 17)):
        fast_kv = kv.clone()
        with torch.no_grad():  # as the engine runs it
            got = extend(w, fast_kv, cos, sin, input_ids, lengths, starts, slots_t, bucket)
        assert_extended_alike(got, want, fast_kv, reference_kv, kv, contexts, slots, new)
    with torch.no_grad():
        for row, (slot, ids) in enumerate(zip(slots, new)):
            full = model(torch.tensor([contexts[slot] + ids])).logits[0, -1].float()
            torch.testing.assert_close(want[row], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", [name for name in CPU_ATTENTIONS if name != "matmul"])
def test_each_extend_attention_equals_the_matmul_form_on_ragged_rows(attention):
    """Straight against the obviously right masked matmul in float32: grouped heads (1, 2 and 7 query heads per KV
    head), query rows at different offsets, padded rows whose positions are clamped to the last key, one-row waves."""
    generator = torch.Generator().manual_seed(3)
    for rows, length, heads, kv_heads, keys in ((5, 7, 4, 2, 30), (3, 1, 14, 2, 40), (1, 9, 4, 4, 16), (6, 3, 7, 1, 9)):
        q = torch.randn(rows, length, heads, 16, generator=generator)
        k, v = (torch.randn(rows, kv_heads, keys, 16, generator=generator) for _ in range(2))
        starts = torch.randint(0, keys - 1, (rows, 1), generator=generator)
        positions = (starts + torch.arange(length)).clamp(max=keys - 1)
        want = llama_forward.EXTEND_ATTENTIONS["matmul"](q, k, v, positions)
        got = llama_forward.EXTEND_ATTENTIONS[attention](q, k, v, positions)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_the_default_extend_attention_is_the_kernel_on_cuda_with_triton_and_sdpa_otherwise(monkeypatch):
    """`auto`: the Triton kernel for CUDA tensors where Triton is installed; SDPA on CPU and where Triton is not."""
    for name in ("sdpa", "triton"):
        monkeypatch.setitem(llama_forward.EXTEND_ATTENTIONS, name, lambda *tensors, name=name: name)
    assert llama_forward.extend_attention == "auto"
    auto = llama_forward.EXTEND_ATTENTIONS["auto"]
    on_cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(llama_forward, "_TRITON_INSTALLED", True)
    assert auto(torch.zeros(1), None, None, None) == "sdpa"
    assert auto(on_cuda, None, None, None) == "triton"
    monkeypatch.setattr(llama_forward, "_TRITON_INSTALLED", False)
    assert auto(on_cuda, None, None, None) == "sdpa"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (it is optional; the other attentions cover CPU)")
def test_the_extend_attention_kernel_equals_the_matmul_form_in_the_interpreter():
    """The Triton kernel (`kernels/extend_attention.py`) in TRITON_INTERPRET=1 against the masked matmuls, float32 and
    float16, on grouped heads, several key blocks and folded-query blocks, padded rows (`extend_attention_cases`)."""
    from decode_attention_cases import run_in_interpreter  # tests/ is on sys.path under pytest

    assert "ok" in run_in_interpreter("extend_attention_cases", "check_kernel_cases")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (it is optional; the other attentions cover CPU)")
def test_extend_with_the_kernel_reading_slots_in_place_equals_the_matmul_form_in_the_interpreter():
    """`extend` as it runs on CUDA with the default attention (the kernel reads each row's slot of the cache, no
    gathered copy), in TRITON_INTERPRET=1 on CPU, against the masked matmuls over gathered slots."""
    from decode_attention_cases import run_in_interpreter  # tests/ is on sys.path under pytest

    assert "ok" in run_in_interpreter("extend_attention_cases", "check_extend_in_place")


def test_the_compiled_pieces_are_called_with_dynamic_dimensions_that_exist(monkeypatch):
    """`compiled_decode_functions` marks rows, length and key length dynamic on the extend pieces' tensors; with
    torch.compile standing aside (identity), a wrong dimension index would raise here and the result must not change."""
    marked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda tensor, dim: marked.append(tensor.shape[dim]))
    model = make_model("qwen2")
    w, kv, cos, sin, contexts = filled_cache(model, 0)
    new, input_ids, lengths, starts, slots_t, kv_end = resume_batch(contexts, [2, 0, 1], 0, model.config.vocab_size)
    functions = llama_forward.compiled_decode_functions()
    got = extend(w, kv.clone(), cos, sin, input_ids, lengths, starts, slots_t, kv_end, functions)
    want = extend(w, kv.clone(), cos, sin, input_ids, lengths, starts, slots_t, kv_end, EAGER_DECODE)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    rows, length = input_ids.shape
    per_layer = [rows, length, rows, length, rows, length,  # extend_inputs: h, cos, sin
                 rows, length, rows, length, rows, kv_end, rows, length]  # extend_attention_and_mlp
    assert marked == per_layer * len(w.layers) + [rows]  # + final_logits' rows


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"),
                    reason="set HYBRIDRL_SLOW_TESTS=1 (~2 min of C++ compilation)")
def test_compiled_extend_equals_the_reference_on_cpu_and_compiles_once_for_every_shape():
    """torch.compile for real (inductor, C++ on CPU): several seeds, uneven rows, row counts and key lengths; after
    the first shapes no new compilation."""
    model = make_model("qwen2")
    functions = llama_forward.compiled_decode_functions()
    frames = []
    for seed, slots in enumerate(([1, 4, 2, 0], [3, 0, 4], [4, 1], [0, 1, 2, 3, 4])):
        w, kv, cos, sin, contexts = filled_cache(model, seed)
        new, input_ids, lengths, starts, slots_t, kv_end = resume_batch(contexts, slots, seed, model.config.vocab_size)
        with torch.no_grad():
            want = extend_reference(w, kv.clone(), cos, sin, input_ids, lengths, starts, slots_t, kv_end)
            got = extend(w, kv.clone(), cos, sin, input_ids, lengths, starts, slots_t, kv_end, functions)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[-1] == frames[-2] == frames[-3], frames


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", list(llama_forward.EXTEND_ATTENTIONS))
def test_compiled_extend_in_bf16_is_as_close_to_float32_as_the_reference_is(attention, monkeypatch):
    """On the GPU, in the engine's dtype: the compiled fast path is no further from a float32 run than the slow
    reference in bf16 is (both round the scores to bf16 once and softmax in float32), for several shapes, and
    compiles at most twice for all of them (rows and lengths are dynamic; 1-row waves may specialise); with each of
    `extend`'s attentions."""
    monkeypatch.setattr(llama_forward, "extend_attention", attention)
    model = make_model("qwen2").cuda()
    functions = llama_forward.compiled_decode_functions()
    frames = []
    for seed, slots in enumerate(([1, 4, 2, 0], [3, 0, 4], [4, 1], [0, 1, 2, 3, 4], [2, 3])):
        w, kv, cos, sin, contexts = filled_cache(model, seed)
        new, input_ids, lengths, starts, slots_t, kv_end = resume_batch(contexts, slots, seed, model.config.vocab_size)
        args = [t.cuda() for t in (input_ids, lengths, starts, slots_t)]
        with torch.no_grad():
            exact = extend_reference(w, kv, cos, sin, *args, kv_end)
            model.to(torch.bfloat16)
            w, kv, cos, sin, _ = filled_cache(model, seed)
            slow = extend_reference(w, kv.clone(), cos, sin, *args, kv_end)
            fast = extend(w, kv, cos, sin, *args, min(MAX_LEN, kv_end + 9), functions)
            model.float()
        slow_error, fast_error = (slow - exact).abs().max().item(), (fast - exact).abs().max().item()
        assert fast_error <= 1.5 * slow_error + 1e-2, (fast_error, slow_error)
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[-1] == frames[-2] == frames[-3], frames


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"),
                    reason="set HYBRIDRL_SLOW_TESTS=1 (~3 min of C++ compilation)")
def test_compiled_engine_episodes_equal_the_hf_reference_on_cpu():
    """The whole engine compiled (decode and extend pieces) on CPU: greedy episodes equal the HF reference loop."""
    engine, episodes, reference = both(make_model("qwen2"), compile=True)
    assert engine.last_stats["compiled"] and engine.last_stats["observation_prefills"] > 0
    assert_same_episodes(episodes, reference)


def test_a_small_last_chunk_of_resumes_joins_the_one_before():
    """512 resumes of 33 ids at the default budget are one forward (16,896 padded tokens, within 9/8 of 16,384), not
    496 + 16 rows; 600 are two; in general every resume once, each chunk within 9/8 of the budget (or one row)."""
    assert [len(chunk) for chunk in resume_chunks([33] * 512, 16384)] == [512]
    assert [len(chunk) for chunk in resume_chunks([33] * 600, 16384)] == [496, 104]
    assert [len(chunk) for chunk in resume_chunks([33] * 496 + [1000], 16384)] == [496, 1]  # a long tail stays apart
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 400)
        chunks = resume_chunks(lengths, budget)
        assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
        assert all(len(chunk) == 1 or 8 * max(lengths[i] for i in chunk) * len(chunk) <= 9 * budget
                   for chunk in chunks)
