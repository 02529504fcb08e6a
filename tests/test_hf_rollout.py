"""The `hf` rollout backend: its log-probs agree with the trainer's forward pass, and its stop logic is right."""

import pickle

import numpy as np
import pytest
import torch
from conftest import tiny_actor

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.hf import HFBackend
from hybridrl.training.batch import build_rollout_batch
from hybridrl.training.logprobs import response_logprobs


def encode(tokenizer, texts):
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def test_sampler_logprobs_equal_the_trainer_forward():
    model, tokenizer = tiny_actor()
    prompts = encode(tokenizer, ["12+7=", "3-1=", "45+45="])
    for temperature in (0.0, 0.7):
        params = SamplingParams(max_new_tokens=5, temperature=temperature, n=2, seed=1)
        generations = HFBackend(model, tokenizer).generate(prompts, params)
        assert [g.prompt_index for g in generations] == [0, 0, 1, 1, 2, 2]
        batch = build_rollout_batch(prompts, generations, tokenizer.pad_token_id, params.max_new_tokens)
        logp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                    batch.response_length, temperature=temperature or 1.0)
        mask = batch.response_mask.bool()
        assert torch.allclose(logp[mask], batch.sampler_logp[mask], atol=1e-5)


def test_seeded_sampling_repeats_and_ignore_eos_forces_length():
    model, tokenizer = tiny_actor()
    prompts = encode(tokenizer, ["1+1=", "9-4="])
    backend = HFBackend(model, tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=5, ignore_eos=True)
    first, second = backend.generate(prompts, params), backend.generate(prompts, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert all(len(g.token_ids) == 6 and g.finish_reason == "length" for g in first)


def test_stop_token_is_kept_and_ends_the_response():
    model, tokenizer = tiny_actor()
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make eos the argmax everywhere: greedy stops at once
        model.get_output_embeddings().weight[eos] += 100.0
    generations = HFBackend(model, tokenizer).generate(encode(tokenizer, ["2+2="]),
                                                         SamplingParams(max_new_tokens=4, temperature=0.0))
    assert generations[0].token_ids == [eos] and generations[0].finish_reason == "stop"


def test_rollout_batch_layout_by_hand():
    """Prompts left-padded, responses right-padded (an empty one too), positions from 0 at each first real
    token and repeating the last real position over right padding, as a per-row cumsum would give."""
    from hybridrl.rollout.base import Generation

    prompts = [[5, 6, 7], [8]]
    generations = [Generation(0, [9, 10], [-0.5, -0.25], "length"), Generation(1, [], [], "stop"),
                   Generation(1, [11], [-1.0], "stop")]
    batch = build_rollout_batch(prompts, generations, pad_token_id=0, max_new_tokens=2)
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10], [0, 0, 8, 0, 0], [0, 0, 8, 11, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1], [0, 0], [1, 0]]
    assert batch.sampler_logp.tolist() == [[-0.5, -0.25], [0.0, 0.0], [-1.0, 0.0]]
    assert batch.truncated.tolist() == [True, False, False] and batch.prompt_index.tolist() == [0, 1, 1]


def test_rollout_batch_equals_a_row_by_row_reference_on_ragged_batches():
    """The vectorised layout against plain per-row loops: unsorted and unused prompts, empty prompts and responses."""
    import random

    from hybridrl.rollout.base import Generation

    rng = random.Random(0)
    for trial in range(100):
        prompts = [[rng.randrange(1, 99) for _ in range(rng.randint(0 if trial % 5 == 0 else 1, 7))]
                   for _ in range(rng.randint(1, 5))]
        generations = []
        for _ in range(rng.randint(1, 9)):
            length = rng.randint(0, 6)
            generations.append(Generation(rng.randrange(len(prompts)), [rng.randrange(1, 99) for _ in range(length)],
                                          [-rng.random() for _ in range(length)], rng.choice(["stop", "length"])))
        batch = build_rollout_batch(prompts, generations, pad_token_id=0, max_new_tokens=6)
        # The same generations holding numpy rows, as the built-in engine hands them over: the same batch.
        held_as_arrays = [Generation(g.prompt_index, np.array(g.token_ids, dtype=np.int64),
                                     np.array(g.logprobs, dtype=np.float32), g.finish_reason) for g in generations]
        from_arrays = build_rollout_batch(prompts, held_as_arrays, pad_token_id=0, max_new_tokens=6)
        for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "sampler_logp"):
            assert torch.equal(getattr(from_arrays, name), getattr(batch, name)), name
        width = max(len(prompts[g.prompt_index]) for g in generations)
        height = max(1, max(len(g.token_ids) for g in generations))
        for row, g in enumerate(generations):
            prompt = prompts[g.prompt_index]
            padding = [0] * (width - len(prompt))
            assert batch.input_ids[row].tolist() == padding + prompt + g.token_ids + [0] * (height - len(g.token_ids))
            assert batch.attention_mask[row].tolist() == [0] * len(padding) + [1] * (len(prompt) + len(g.token_ids)) \
                + [0] * (height - len(g.token_ids))
            assert batch.sampler_logp[row, :len(g.logprobs)].tolist() == pytest.approx(g.logprobs)
            assert batch.sampler_logp[row, len(g.logprobs):].abs().sum() == 0


def test_decoded_responses_equal_the_tokenizers_own_decode():
    """The Rust batch path and the fallback give the text `tokenizer.decode(..., skip_special_tokens=True)` gives."""
    from hybridrl.rollout.base import Generation
    from hybridrl.training.batch import decode_responses

    _, tokenizer = tiny_actor()
    eos = tokenizer.eos_token_id
    generations = [Generation(0, encode(tokenizer, ["12+7="])[0] + [eos], [], "stop"), Generation(0, [], [], "stop"),
                   Generation(0, encode(tokenizer, ["45 - 3"])[0], [], "length")]
    expected = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    assert expected[0] == "12+7=" and decode_responses(tokenizer, generations) == expected
    # Generations holding numpy rows (the built-in engine's) decode the same and keep their rows.
    held_as_arrays = [Generation(0, np.array(g.token_ids, dtype=np.int64), [], g.finish_reason) for g in generations]
    assert decode_responses(tokenizer, held_as_arrays) == expected
    assert all(isinstance(g.token_values, np.ndarray) for g in held_as_arrays)
    tokenizer.clean_up_tokenization_spaces = True  # a Python clean-up step: the fallback path
    assert decode_responses(tokenizer, generations) == [tokenizer.decode(g.token_ids, skip_special_tokens=True)
                                                        for g in generations]


def test_generation_holding_numpy_rows_reads_as_lists_and_pickles_as_arrays():
    """The engine's harvest hands over numpy rows: `token_ids`/`logprobs` are still lists (made on first access),
    equality and repr are those of the list form, and the gather across processes (pickle) keeps the arrays."""
    from hybridrl.rollout.base import Generation

    tokens, logprobs = np.array([7, 8, 9], dtype=np.int64), np.array([-0.5, -1.25, -2.0], dtype=np.float32)
    held = Generation(2, tokens, logprobs, "stop")
    copy = pickle.loads(pickle.dumps(held))
    assert isinstance(copy.token_values, np.ndarray) and isinstance(copy.logprob_values, np.ndarray)
    assert held.token_ids == [7, 8, 9] and type(held.token_ids) is list and type(held.token_ids[0]) is int
    assert held.logprobs == [-0.5, -1.25, -2.0] and type(held.logprobs[0]) is float
    assert held == Generation(2, [7, 8, 9], [-0.5, -1.25, -2.0], "stop") == copy
    assert held != Generation(2, [7, 8, 10], [-0.5, -1.25, -2.0], "stop")
    assert held != Generation(3, [7, 8, 9], [-0.5, -1.25, -2.0], "stop")
    assert repr(held) == repr(Generation(2, [7, 8, 9], [-0.5, -1.25, -2.0], "stop"))
    copy.prompt_index += 4  # what generate_sharded does to a rank's share
    copy.text = "x"
    assert (copy.prompt_index, copy.text, copy.token_ids) == (6, "x", [7, 8, 9])


def test_layers_compiled_for_training_run_eagerly_in_generate():
    """`model.compile` compiles the decoder layers for the training passes; inside HF `generate` they would
    recompile at every KV length (and per layer's cache) until dynamo's limit. The backend runs them eagerly:
    no frame is compiled during generate, the tokens equal the uncompiled model's, and training still compiles."""
    from torch._dynamo.utils import counters

    from hybridrl.models.loading import decoder_layers

    model, tokenizer = tiny_actor()
    prompts = encode(tokenizer, ["12+7=", "3-1="])
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3, ignore_eos=True)
    expected = HFBackend(model, tokenizer).generate(prompts, params)
    torch._dynamo.reset()
    counters.clear()
    for layer in decoder_layers(model):
        layer.compile(backend="eager")  # dynamo's tracing without inductor: fast, no C++ compiler needed
    generations = HFBackend(model, tokenizer).generate(prompts, params)
    assert counters["frames"]["ok"] == 0, dict(counters["frames"])
    assert [g.token_ids for g in generations] == [g.token_ids for g in expected]
    model(torch.tensor([prompts[0]]))  # a training-style forward outside generate compiles the layers
    assert counters["frames"]["ok"] > 0
    torch._dynamo.reset()
