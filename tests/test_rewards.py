"""Reward functions, loading, composition and the reward-model scorer, on hand-made examples and a tiny random model."""

import math
import string

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from hybridrl.config.schema import RewardConfig, RewardSpec
from hybridrl.rewards import (
    BUILTIN_REWARDS,
    RewardComposer,
    RewardError,
    RewardModelScorer,
    RewardSpecError,
    exact_match,
    extract_number,
    format_reward,
    length_penalty,
    load_reward_function,
    numeric_match,
)

# ----------------------------------------------------------------------------------------------
# Built-ins


def test_exact_match_strips_and_uses_answer_key():
    completions = [" Paris\n", "paris", "Lyon"]
    assert exact_match(["q"] * 3, completions, answer=["Paris", "Paris", "Paris"], extra=[1, 2, 3]) == [1.0, 0.0, 0.0]
    assert exact_match(["q"], ["4"], gold=[4], answer_key="gold") == [1.0]
    with pytest.raises(ValueError, match="'gold'"):
        exact_match(["q"], ["4"], answer=["4"], answer_key="gold")


@pytest.mark.parametrize("text, expected", [
    ("so the total is 1,234 apples\n#### 1,234", 1234.0),
    ("#### $1,234.50", 1234.5),
    ("#### 18 (that is 2 * 9)", 18.0),
    ("\\boxed{42}, checked in 3 steps", 42.0),
    ("The answer is \\boxed{42}.", 42.0),
    ("first \\boxed{1} then \\boxed{\\text{x} = -7}", -7.0),
    ("It dropped to -3.5 degrees", -3.5),
    ("costs -$12 in total", -12.0),
    ("3 apples and 5 pears make 8.", 8.0),
    ("difference 10-4 is 6.0", 6.0),
    ("1,2345", 2345.0),
    ("no digits here", None),
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_numeric_match_tolerant_to_formatting():
    completions = ["#### 1,234", "\\boxed{42}", "we get -5", "so $72.00", "no number at all", "#### 73"]
    answers = ["1234", 42, "-5", "Natalia sold 48+24 = 72 clips.\n#### 72", 3, "72"]
    assert numeric_match([""] * 6, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_numeric_match_rejects_ground_truth_without_number():
    with pytest.raises(ValueError, match="sample 1"):
        numeric_match(["", ""], ["1", "2"], answer=["1", "n/a"])


def test_format_reward_search_and_fullmatch():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = ["<think>a\nb</think>\n<answer>4</answer>", "junk <think>x</think><answer>4</answer>", "<answer>4</answer>"]
    assert format_reward([""] * 3, completions, pattern=pattern) == [1.0, 1.0, 0.0]
    assert format_reward([""] * 3, completions, pattern=pattern, fullmatch=True) == [1.0, 0.0, 0.0]


def test_length_penalty_chars_words_and_target():
    completions = ["abcd", "one two three", ""]
    assert length_penalty([""] * 3, completions, scale=2.0) == [-2.0, -6.5, 0.0]
    assert length_penalty([""] * 3, completions, target_length=2, unit="words") == [0.0, -0.001, 0.0]
    with pytest.raises(ValueError, match="unit"):
        length_penalty([""], ["x"], unit="tokens")


# ----------------------------------------------------------------------------------------------
# Loading specs


def test_load_builtin_and_user_file(tmp_path):
    assert load_reward_function("numeric_match") is numeric_match
    assert load_reward_function("format") is format_reward
    file = tmp_path / "my_rewards.py"
    file.write_text("def shouty(prompts, completions, **columns):\n    return [float(c.isupper()) for c in completions]\n")
    fn = load_reward_function(f"{file}:shouty")
    assert fn.__name__ == "shouty"
    assert fn(["p", "p"], ["YES", "no"], answer=["x", "y"]) == [1.0, 0.0]


def test_bad_specs_name_the_problem(tmp_path):
    with pytest.raises(RewardSpecError, match="unknown reward 'exact'"):
        load_reward_function("exact")
    with pytest.raises(RewardSpecError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py") + ":f")
    file = tmp_path / "r.py"
    file.write_text("def other(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardSpecError, match=r"no function 'wanted' \(functions in it: other\)"):
        load_reward_function(f"{file}:wanted")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(RewardSpecError, match="broken.py' raised ModuleNotFoundError") as info:
        load_reward_function(f"{broken}:f")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert issubclass(RewardSpecError, ValueError)


# ----------------------------------------------------------------------------------------------
# Composition


def test_weighted_sum_and_per_function_scores():
    composer = RewardComposer([
        ("exact_match", exact_match, 2.0),
        ("length_penalty", length_penalty, 0.5),
    ])
    total, per_function = composer.score(["q", "q"], ["4", "five"], {"answer": ["4", "4"]})
    assert per_function == {"exact_match": [1.0, 0.0], "length_penalty": [-0.001, -0.004]}
    assert total.shape == (2,) and total.dtype == torch.float32
    assert torch.allclose(total, torch.tensor([2.0 - 0.0005, -0.002]))


def test_from_config_kwargs_duplicate_names_and_user_file(tmp_path):
    file = tmp_path / "user.py"
    file.write_text("def bonus(prompts, completions, **columns):\n    return [1.0] * len(completions)\n")
    config = RewardConfig(functions=[
        RewardSpec(fn="format", weight=1.0, kwargs={"pattern": r"^\d+$"}),
        RewardSpec(fn="format", weight=0.5, kwargs={"pattern": "x"}),
        RewardSpec(fn=f"{file}:bonus", weight=-1.0),
    ])
    composer = RewardComposer.from_config(config)
    assert composer.names == ["format", "format_2", "bonus"]
    # The `pattern` column is shadowed by each spec's own kwarg.
    total, per_function = composer.score(["q"] * 2, ["12", "x1"], {"pattern": ["zzz", "zzz"]})
    assert per_function == {"format": [1.0, 0.0], "format_2": [0.0, 1.0], "bonus": [1.0, 1.0]}
    assert total.tolist() == [0.0, -0.5]


def test_from_config_bad_spec_names_the_key():
    config = RewardConfig(functions=[RewardSpec(fn="exact_match"), RewardSpec(fn="nope")])
    with pytest.raises(RewardSpecError, match=r"reward\.functions\[1\]\.fn: unknown reward 'nope'"):
        RewardComposer.from_config(config)
    with pytest.raises(ValueError, match="no reward functions"):
        RewardComposer.from_config(RewardConfig())


def test_raising_reward_names_function_and_first_failing_sample():
    def picky(prompts, completions, **columns):
        return [1.0 / len(c) for c in completions]

    composer = RewardComposer([("picky", picky, 1.0)])
    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError.*on sample 2 .*batch of 4") as info:
        composer.score(["q"] * 4, ["a", "bb", "", "c"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert isinstance(info.value, RuntimeError)


def test_raising_user_reward_names_its_own_file_and_line(tmp_path):
    """The message points into the user's file (innermost frame first), not into hybridrl."""
    source = tmp_path / "my_rewards.py"
    source.write_text("def parse(text):\n    return int(text)\n\n\ndef score(prompts, completions, **columns):\n"
                      "    return [float(parse(c)) for c in completions]\n")
    composer = RewardComposer([("score", load_reward_function(f"{source}:score"), 1.0)])
    with pytest.raises(RewardError) as info:
        composer.score(["q"] * 3, ["1", "x", "2"])
    message = str(info.value)
    inner, outer = message.find(f"(at {source}:2 in parse <- "), message.find(f"{source}:6 in score")
    assert 0 <= inner < outer and "on sample 1" in message
    assert "hybridrl/rewards.py" not in message


def test_missing_column_in_builtin_becomes_reward_error():
    composer = RewardComposer([("numeric_match", numeric_match, 1.0)])
    with pytest.raises(RewardError, match="'numeric_match'.*column 'answer'.*sample 0"):
        composer.score(["q"], ["1"], {"gold": ["1"]})


@pytest.mark.parametrize("returned, message", [
    ([1.0], r"'bad' returned 1 values for a batch of 2"),
    ([1.0, float("nan")], r"'bad' returned nan for sample 1"),
    ([1.0, None], r"'bad' returned None for sample 1"),
    ([1.0, "1"], r"'bad' returned '1' for sample 1"),
    (0.5, r"'bad' returned float for a batch of 2"),
])
def test_bad_return_values_raise_reward_error(returned, message):
    composer = RewardComposer([("bad", lambda prompts, completions, **c: returned, 1.0)])
    with pytest.raises(RewardError, match=message):
        composer.score(["q", "q"], ["a", "b"])


def test_tensor_return_and_column_length_check():
    composer = RewardComposer([("t", lambda prompts, completions, **c: torch.tensor([0.5, 1.5]), 2.0)])
    total, per_function = composer.score(["q", "q"], ["a", "b"])
    assert per_function["t"] == [0.5, 1.5] and total.tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        composer.score(["q", "q"], ["a", "b"], {"answer": ["x"]})


def test_builtin_names_match_config_docs():
    from hybridrl.config.explain import field_docs

    documented = field_docs()["RewardSpec"]["fn"]
    assert [name for name in BUILTIN_REWARDS if name not in documented] == []


# ----------------------------------------------------------------------------------------------
# Reward model


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level: BPE with no merges splits text into single characters."""
    vocab = {"[PAD]": 0, "[UNK]": 1}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def word_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[PAD]", "[UNK]", "what", "is", "2", "+", "?", "it", "4", "5", "maybe"]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


@pytest.fixture(scope="module")
def reward_model():
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config).eval(), tokenizer


def test_reward_model_scores_finite_deterministic_and_batch_invariant(reward_model):
    model, tokenizer = reward_model
    prompts = ["what is 2+2? ", "hi ", "a much longer prompt, with more characters in it: "]
    completions = ["4", "hello there", "ok"]
    scorer = RewardModelScorer(model, tokenizer, batch_size=2)
    scores = scorer(prompts, completions, answer=["4", "x", "y"])
    assert len(scores) == 3 and all(math.isfinite(s) for s in scores)
    assert scorer(prompts, completions) == scores
    assert len(set(scores)) == 3  # different texts, different scores
    # Padding must not leak into the score: one at a time gives the same numbers.
    one_by_one = RewardModelScorer(model, tokenizer, batch_size=1)(prompts, completions)
    assert torch.allclose(torch.tensor(one_by_one), torch.tensor(scores), atol=1e-5)


def test_reward_model_uses_its_own_tokenizer(reward_model):
    model, rm_tokenizer = reward_model
    actor_tokenizer = word_tokenizer()
    prompt_ids, completion_ids = actor_tokenizer("what is 2 + 2 ?")["input_ids"], actor_tokenizer("it is 4")["input_ids"]
    prompt, completion = actor_tokenizer.decode(prompt_ids) + " ", actor_tokenizer.decode(completion_ids)
    assert len(rm_tokenizer(prompt + completion)["input_ids"]) != len(prompt_ids) + len(completion_ids)
    [score] = RewardModelScorer(model, rm_tokenizer)([prompt], [completion])
    with torch.no_grad():
        expected = model(torch.tensor([rm_tokenizer(prompt + completion)["input_ids"]])).logits[0, 0].item()
    assert score == pytest.approx(expected, abs=1e-6)


def test_reward_model_chat_template_and_loading_from_path(reward_model, tmp_path):
    model, tokenizer = reward_model
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    plain = RewardModelScorer(model, tokenizer, use_chat_template=False)(["q "], ["a"])
    templated = RewardModelScorer(model, tokenizer)(["q "], ["a"])
    assert plain != templated
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    composer = RewardComposer.from_config(RewardConfig(reward_model=str(tmp_path), reward_model_weight=2.0))
    total, per_function = composer.score(["q "], ["a"])
    assert per_function["reward_model"] == pytest.approx(templated, abs=1e-5)
    assert total.tolist() == pytest.approx([2 * templated[0]], abs=1e-5)


def test_reward_model_rejects_missing_tokenizer_and_bad_label(reward_model):
    model, tokenizer = reward_model
    with pytest.raises(ValueError, match="without its tokenizer"):
        RewardModelScorer(model)
    with pytest.raises(ValueError, match="label_index=1 is out of range"):
        RewardModelScorer(model, tokenizer, label_index=1)


def test_columns_a_reward_reads_are_checked_before_any_model_loads(tmp_path, monkeypatch):
    """A missing answer column used to surface at step 1 as a TypeError inside the user's reward."""
    import json

    from hybridrl.rewards import WeightedReward, columns_read
    from hybridrl.training import components
    from hybridrl.training.trainer import RLTrainer

    def score(prompts, completions, answer, source, weight=1.0, **columns):
        return [0.0] * len(completions)

    assert columns_read(WeightedReward("score", score)) == {"answer", "source"}
    assert columns_read(WeightedReward("score", score, kwargs={"source": "x"})) == {"answer"}
    assert columns_read(WeightedReward("exact_match", exact_match)) == {"answer"}
    assert columns_read(WeightedReward("exact_match", exact_match, kwargs={"answer_key": "solution"})) == {"solution"}

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8)))
    monkeypatch.setattr(components, "load_hf_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    with pytest.raises(RewardSpecError) as info:
        RLTrainer(None, reward_fn=score, data__train_path=str(data), trainer__device="cpu",
                  trainer__output_dir=str(tmp_path / "run"))
    message = str(info.value)
    assert "reward function 'score' reads column 'answer'" in message and "'source'" in message
    assert "prompts.jsonl" in message and "its columns: solution" in message
