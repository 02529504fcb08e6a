"""Reading, formatting, filtering, sampling and SFT labelling of `hybridrl.data.datasets`, on a character tokenizer."""

import json
import logging
import sys

import pandas as pd
import pytest
import torch
from tokenizers import Regex, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from hybridrl.config.schema import DataConfig
from hybridrl.data.datasets import (
    IGNORE_INDEX,
    DataError,
    PromptDataset,
    PromptSampler,
    SFTDataset,
    collate,
    collate_sft,
    read_records,
)

ROWS = [
    {"prompt": "1+1=", "answer": "2", "source": "a"},
    {"prompt": "2+3=", "answer": "5", "source": "b"},
    {"prompt": "what is 10*10?", "answer": "100", "source": "c"},
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character, so token counts equal string lengths."""
    tokens = ["<unk>", "<pad>", "<eos>"] + [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def char_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def write(path, fmt: str, rows: list[dict]) -> None:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame(rows).to_parquet(path)


# ----------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_read_each_format(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    write(path, fmt, ROWS)
    assert read_records(path) == ROWS
    assert read_records(str(path)) == ROWS


def test_read_json_lines_saved_as_json_and_blank_lines(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert read_records(path) == ROWS[:2]


def test_read_in_memory_sources():
    class FakeDataset:  # the parts of datasets.Dataset that read_records uses
        column_names = ["prompt", "answer", "source"]

        def to_list(self):
            return list(ROWS)

    class FakeDatasetDict:
        column_names = {"train": FakeDataset.column_names, "test": FakeDataset.column_names}

        def __getitem__(self, split):
            assert split == "train"
            return FakeDataset()

    assert read_records(FakeDataset()) == ROWS
    assert read_records(FakeDatasetDict()) == ROWS
    assert read_records(pd.DataFrame(ROWS)) == ROWS
    assert read_records(ROWS) == ROWS


def _error(source) -> str:
    with pytest.raises(DataError) as info:
        read_records(source)
    return str(info.value)


def test_read_errors_name_file_and_problem(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert "nope.jsonl" in _error(missing) and "does not exist" in _error(missing)

    text = tmp_path / "data.txt"
    text.write_text("hello")
    message = _error(text)
    assert "data.txt" in message and "'.txt'" in message and ".jsonl" in message

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    message = _error(bad)
    assert "bad.jsonl" in message and "line 2" in message

    not_object = tmp_path / "list.jsonl"
    not_object.write_text("[1, 2]\n")
    assert "line 1" in _error(not_object) and "not an object" in _error(not_object)

    for name, content in [("empty.jsonl", ""), ("empty.json", "[]"), ("empty.csv", "prompt,answer\n")]:
        (tmp_path / name).write_text(content)
        message = _error(tmp_path / name)
        assert name in message and "no rows" in message

    folder = tmp_path / "folder"
    folder.mkdir()
    assert "not a saved Hugging Face dataset" in _error(folder)

    assert "list of records" in _error([{"prompt": "x"}, "y"]) and "record 2 is a str" in _error([{"prompt": "x"}, "y"])


def test_missing_optional_packages_name_the_extra(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    parquet = tmp_path / "data.parquet"
    write(parquet, "parquet", ROWS)
    for module in ("datasets", "pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    assert "hybridrl[datasets]" in _error(saved)
    assert "hybridrl[parquet]" in _error(parquet)


# ----------------------------------------------------------------------------------------------
# Prompts


def test_prompt_items_keep_raw_prompt_and_other_columns():
    tokenizer = make_tokenizer()
    dataset = PromptDataset(ROWS, tokenizer)
    item = dataset[2]
    assert item["prompt"] == item["raw_prompt"] == "what is 10*10?"
    assert item["prompt_ids"] == char_ids(tokenizer, "what is 10*10?")  # no BOS/EOS added
    assert item["columns"] == {"answer": "100", "source": "c"}

    batch = collate([dataset[0], dataset[2]])
    assert batch["prompts"] == ["1+1=", "what is 10*10?"]
    assert batch["prompt_ids"] == [char_ids(tokenizer, "1+1="), char_ids(tokenizer, "what is 10*10?")]
    assert batch["raw_prompts"] == ["1+1=", "what is 10*10?"]
    assert batch["columns"] == {"answer": ["2", "100"], "source": ["a", "c"]}


def test_prompt_key_selects_column():
    rows = [{"question": "q?", "answer": "a"}]
    item = PromptDataset(rows, make_tokenizer(), prompt_key="question")[0]
    assert item["raw_prompt"] == "q?" and item["columns"] == {"answer": "a"}


def test_prompt_template_may_name_other_columns():
    template = "[{source}] Q: {prompt}\nA:"
    dataset = PromptDataset(ROWS, make_tokenizer(chat_template=CHAT_TEMPLATE), prompt_template=template)
    assert dataset[1]["prompt"] == "[b] Q: 2+3=\nA:"  # the template wins over the chat template
    assert len(dataset[1]["prompt_ids"]) == len("[b] Q: 2+3=\nA:")


@pytest.mark.parametrize("template, expected", [
    ("Q: {question}", "{question}"),
    ("Q: {prompt", "not a valid format string"),
    ("Always the same", "no {prompt} placeholder"),
])
def test_bad_prompt_template_is_a_data_error(template, expected):
    with pytest.raises(DataError, match="data.prompt_template") as info:
        PromptDataset(ROWS, make_tokenizer(), prompt_template=template)
    assert expected in str(info.value)


def test_chat_template_wraps_prompt_as_user_turn():
    tokenizer = make_tokenizer(chat_template=CHAT_TEMPLATE)
    item = PromptDataset(ROWS, tokenizer)[0]
    assert item["prompt"] == "<|user|>1+1=\n<|assistant|>"
    assert item["prompt_ids"] == char_ids(tokenizer, "<|user|>1+1=\n<|assistant|>")
    assert item["raw_prompt"] == "1+1="
    assert PromptDataset(ROWS, tokenizer, use_chat_template=False)[0]["prompt"] == "1+1="


def test_over_long_prompts_are_dropped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridrl.data.datasets"):
        dataset = PromptDataset(ROWS, make_tokenizer(), max_length=4)
    assert dataset.num_filtered == 1
    assert [item["raw_prompt"] for item in dataset] == ["1+1=", "2+3="]
    assert "dropped 1 of 3 prompts" in caplog.text


def test_prompt_dataset_errors():
    with pytest.raises(DataError) as info:
        PromptDataset(ROWS, make_tokenizer(), max_length=3)
    assert "all 3 prompts" in str(info.value) and "data.max_prompt_length" in str(info.value)

    with pytest.raises(DataError) as info:
        PromptDataset(ROWS, make_tokenizer(), prompt_key="question")
    message = str(info.value)
    assert "no column 'question'" in message and "prompt, answer, source" in message and "data.prompt_key" in message

    with pytest.raises(DataError, match="record 2 has no value in column 'prompt'"):
        PromptDataset([{"prompt": "x"}, {"prompt": None}], make_tokenizer())


def test_every_bad_row_is_reported_at_once_with_one_based_lines(tmp_path):
    """One error names every bad line of a file, numbered as an editor shows them (from 1)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{oops\n\n[1]\n{"prompt": "2+2="}\n{"prompt": 3}\n{"prompt": "  "}\n')
    with pytest.raises(DataError) as info:
        read_records(bad)
    message = str(info.value)
    assert "2 bad rows" in message and "line 2 is not valid JSON" in message and "line 4 holds a JSON list" in message

    bad.write_text('{"prompt": "1+1="}\n{"answer": "2"}\n\n{"prompt": 3}\n{"prompt": "  "}\n{"prompt": "ok"}\n')
    with pytest.raises(DataError) as info:
        PromptDataset(bad, make_tokenizer())
    message = str(info.value)
    assert "3 bad rows" in message
    assert "line 2 has no value in column 'prompt'" in message and "line 4 has a value of type int in column 'prompt'" in message
    assert "line 5 has an empty 'prompt'" in message and "line 1" not in message and "line 6" not in message

    table = tmp_path / "bad.csv"
    table.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(DataError, match="line 3 has an empty 'prompt'"):
        PromptDataset(table, make_tokenizer())


def test_a_data_error_lists_twenty_rows_then_a_count():
    rows = [{"prompt": ""} for _ in range(25)]
    with pytest.raises(DataError) as info:
        PromptDataset(rows, make_tokenizer())
    message = str(info.value)
    assert "25 bad rows" in message and "record 20 has" in message and "record 21" not in message
    assert "and 5 more" in message


def test_an_empty_prompt_is_refused():
    with pytest.raises(DataError, match="record 2 has an empty 'prompt'"):
        PromptDataset([{"prompt": "1+1="}, {"prompt": ""}], make_tokenizer())


def test_from_config(tmp_path):
    path = tmp_path / "train.jsonl"
    write(path, "jsonl", ROWS)
    config = DataConfig(train_path=str(path), max_prompt_length=6, prompt_template="Q {prompt}", shuffle=False)
    dataset = PromptDataset.from_config(config, make_tokenizer(), config.train_path, seed=3)
    assert [item["prompt"] for item in dataset] == ["Q 1+1=", "Q 2+3="]
    assert dataset.num_filtered == 1 and dataset.seed == 3 and dataset.shuffle is False


# ----------------------------------------------------------------------------------------------
# Sampling


def take(sampler, count: int) -> list[list[int]]:
    return [next(sampler) for _ in range(count)]


def test_sampler_is_seeded_and_covers_each_epoch():
    batches = take(PromptSampler(10, 3, seed=1), 9)  # 3 batches per epoch, 1 index dropped per epoch
    assert batches == take(PromptSampler(10, 3, seed=1), 9)
    assert batches != take(PromptSampler(10, 3, seed=2), 9)
    epochs = [sum(batches[i:i + 3], []) for i in (0, 3, 6)]
    for indices in epochs:
        assert len(set(indices)) == 9 and set(indices) <= set(range(10))
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert take(PromptSampler(5, 2, shuffle=False), 3) == [[0, 1], [2, 3], [0, 1]]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 7])  # mid-epoch, at the boundary, across it
def test_sampler_resumes_exactly(stop_after):
    uninterrupted = take(PromptSampler(10, 3, seed=5), 10)
    first = PromptSampler(10, 3, seed=5)
    head = take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(10, 3, seed=5)
    resumed.load_state_dict(state)
    assert head + take(resumed, 10 - stop_after) == uninterrupted


def test_sampler_refuses_mismatched_state():
    state = PromptSampler(10, 3).state_dict()
    with pytest.raises(DataError, match="saved for 10 prompts"):
        PromptSampler(9, 3).load_state_dict(state)
    with pytest.raises(DataError, match="fewer than one batch"):
        PromptSampler(2, 3)


def test_dataset_sampler_and_batch():
    dataset = PromptDataset(ROWS, make_tokenizer(), seed=0, shuffle=False)
    batch = dataset.batch(next(dataset.sampler(2)))
    assert batch["raw_prompts"] == ["1+1=", "2+3="] and batch["columns"]["answer"] == ["2", "5"]


# ----------------------------------------------------------------------------------------------
# SFT


def test_sft_labels_mask_prompt_and_end_with_eos():
    tokenizer = make_tokenizer()
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+30=", "answer": "32"}]
    dataset = SFTDataset(rows, tokenizer, response_key="answer", max_length=16)
    eos = tokenizer.eos_token_id
    item = dataset[0]
    assert item["input_ids"] == char_ids(tokenizer, "1+1=2") + [eos]
    assert item["labels"] == [IGNORE_INDEX] * 4 + char_ids(tokenizer, "2") + [eos]

    batch = collate_sft(list(dataset), pad_token_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 8)
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0] * 2, [1] * 8]
    assert batch["input_ids"][0, 6:].tolist() == [tokenizer.pad_token_id] * 2
    assert (batch["labels"][0, 6:] == IGNORE_INDEX).all() and batch["labels"].dtype == torch.long
    assert (batch["labels"] != IGNORE_INDEX).sum().item() == 2 + 3  # response tokens + eos only


def test_sft_filters_and_reports_errors():
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+30=", "response": "32"}]
    dataset = SFTDataset(rows, make_tokenizer(), max_length=6)
    assert len(dataset) == 1 and dataset.num_filtered == 1
    with pytest.raises(DataError, match="sft.max_length"):
        SFTDataset(rows, make_tokenizer(), max_length=5)
    with pytest.raises(DataError, match="no column 'completion'.*data.response_key"):
        SFTDataset(rows, make_tokenizer(), response_key="completion")
