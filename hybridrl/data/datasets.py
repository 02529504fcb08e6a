"""Prompt and SFT data: read records, format and tokenize prompts, and draw them in a resumable order.

Choices made here:
- A record is a plain dict. `read_records` reads .jsonl, .json, .csv, .parquet and directories saved
  with `datasets`' `save_to_disk`; pyarrow, pandas and `datasets` are imported only when such a source
  is read. CSV goes through the standard library, so every CSV value is a string.
- A prompt is formatted once, at load time: with `prompt_template` when given (it may name any
  column), else with the tokenizer's chat template as one user turn plus the generation prompt, else
  as the raw text. Tokenizing adds no special tokens: a BOS token, if the model wants one, comes from
  the chat template (most include it) or the prompt template. `prompt_ids` is exactly what the model sees.
- Bad rows are reported all at once, not one per run: every problem found in a source (up to
  `MAX_REPORTED_ROWS`, then a count) goes into one `DataError`, each row named by its 1-based line in
  the file (JSON lines, CSV) or its 1-based position (JSON lists, data sets, lists of records).
- An empty or whitespace-only prompt is refused (the model would be asked nothing).
- Prompts longer than `max_length` tokens are dropped, not truncated (a cut question has a different
  answer); the count is logged and kept as `num_filtered`.
- `PromptSampler` yields batches of indices forever; its whole state is (epoch, position), so a run
  resumed from `state_dict()` draws exactly the batches an uninterrupted run would have drawn.
- SFT tokenizes prompt and response separately, so the prompt ids are the ones RL uses, and puts the
  loss on response tokens and the closing EOS only.
"""

from __future__ import annotations

import csv
import json
import logging
import string
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SUPPORTED_SOURCES = ".jsonl, .json, .csv, .parquet, or a directory written by datasets' save_to_disk"
IGNORE_INDEX = -100
"""Label value that the cross-entropy loss skips."""


MAX_REPORTED_ROWS = 20
"""A data error lists at most this many bad rows, then how many more there are."""


class DataError(ValueError):
    """A problem with the user's data; the message names the source and the fix."""


class Records(list):
    """Rows read from a source (a list of dicts), each with the place a user finds it at: `places[i]` is
    "line 7" for a JSON-lines or CSV file, "record 7" otherwise (both 1-based)."""

    def __init__(self, rows: list[Any], places: list[str]):
        super().__init__(rows)
        self.places = places


def _records(rows: list[Any], places: list[str] | None = None) -> Records:
    return Records(rows, places if places is not None else [f"record {i}" for i in range(1, len(rows) + 1)])


def raise_row_problems(name: str, problems: list[str], fix: str) -> None:
    """One `DataError` listing every bad row of `name` ("line 3: ..."), at most `MAX_REPORTED_ROWS` of them."""
    if not problems:
        return
    shown = problems[:MAX_REPORTED_ROWS]
    more = f"; and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    count = "1 bad row" if len(problems) == 1 else f"{len(problems)} bad rows"
    raise DataError(f"{name} has {count}: {'; '.join(shown)}{more}. {fix}")


# ----------------------------------------------------------------------------------------------
# Reading records


def read_records(source: Any) -> list[dict[str, Any]]:
    """Rows of a file path, a `datasets.Dataset`-like object, a pandas DataFrame or a list of dicts."""
    return _load(source)[0]


def _load(source: Any) -> tuple[list[dict[str, Any]], str]:
    """(rows, a name for the source to put in error messages)."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        name = f"data file '{path}'"
        rows = _read_path(path, name)
    elif isinstance(source, list):
        name, rows = "the given list of records", source
    elif hasattr(source, "column_names"):
        name = f"the given {type(source).__name__}"
        rows = _dataset_rows(source, name)
    elif hasattr(source, "to_dict") and hasattr(source, "columns"):
        name, rows = "the given DataFrame", source.to_dict("records")
    else:
        raise DataError(f"cannot read prompts from a {type(source).__name__}; pass a file path "
                        f"({SUPPORTED_SOURCES}), a datasets.Dataset, or a list of dicts.")
    if not isinstance(rows, Records):
        rows = _records(list(rows))
    if len(rows) == 0:
        raise DataError(f"{name} has no rows; it needs at least one record.")
    raise_row_problems(name, [f"{place} is a {type(row).__name__}, not a record with named columns"
                              for row, place in zip(rows, rows.places) if not isinstance(row, Mapping)],
                       "Each row must be an object such as {\"prompt\": \"...\"}.")
    return Records([dict(row) for row in rows], rows.places), name


def _read_path(path: Path, name: str) -> list[Any]:
    if not path.exists():
        raise DataError(f"{name} does not exist; check the path (data.train_path or data.eval_path).")
    if path.is_dir():
        return _read_saved_dataset(path, name)
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise DataError(f"{name} has unsupported extension '{suffix}'; use {SUPPORTED_SOURCES}.")
    try:
        return reader(path, name)
    except UnicodeDecodeError:
        raise DataError(f"{name} is not UTF-8 text; re-save it with UTF-8 encoding.") from None


def _read_jsonl(path: Path, name: str) -> Records:
    rows, places, problems = [], [], []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                problems.append(f"line {number} is not valid JSON ({error.msg})")
                continue
            if not isinstance(row, dict):
                problems.append(f"line {number} holds a JSON {type(row).__name__}, not an object")
                continue
            rows.append(row)
            places.append(f"line {number}")
    raise_row_problems(name, problems, "Each line must hold one JSON object, such as {\"prompt\": \"...\"}.")
    return Records(rows, places)


def _read_json(path: Path, name: str) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # one object per line in a .json file: read it as JSON lines
            return _read_jsonl(path, name)
        raise DataError(f"{name} is not valid JSON (line {error.lineno}: {error.msg}); "
                        "it must hold a list of objects.") from None
    if not isinstance(data, list):
        raise DataError(f"{name} holds a JSON {type(data).__name__}, not a list of records; "
                        "write it as [{\"prompt\": \"...\"}, ...] or as .jsonl.")
    return data


def _read_csv(path: Path, name: str) -> Records:
    with path.open(encoding="utf-8-sig", newline="") as file:  # -sig drops the BOM Excel writes
        reader = csv.DictReader(file)
        rows, places = [], []
        for row in reader:
            rows.append(row)
            places.append(f"line {reader.line_num}")  # the row's last line: the header is line 1
        return Records(rows, places)


def _read_parquet(path: Path, name: str) -> list[Any]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        parquet = None
    try:
        if parquet is not None:
            return parquet.read_table(path).to_pylist()
        import pandas

        return pandas.read_parquet(path).to_dict("records")
    except ImportError:
        raise DataError(f"reading {name} needs pyarrow; install it with pip install 'hybridrl[parquet]'.") from None
    except Exception as error:  # pyarrow raises its own error types for corrupt files
        raise DataError(f"{name} is not a readable parquet file ({error}); "
                        "check that it was written completely.") from None


_READERS: dict[str, Callable[[Path, str], list[Any]]] = {
    ".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet,
}


def _read_saved_dataset(path: Path, name: str) -> list[Any]:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((path / marker).exists() for marker in markers):
        raise DataError(f"{name} is a directory but not a saved Hugging Face dataset (it has no "
                        f"dataset_info.json or dataset_dict.json); point to {SUPPORTED_SOURCES}.")
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading the saved dataset {name} needs the datasets package; "
                        "install it with pip install 'hybridrl[datasets]'.") from None
    return _dataset_rows(datasets.load_from_disk(str(path)), name)


def _dataset_rows(dataset: Any, name: str) -> list[Any]:
    if isinstance(dataset.column_names, dict):  # a DatasetDict: {split: column names}
        splits = list(dataset.column_names)
        if "train" not in splits and len(splits) != 1:
            raise DataError(f"{name} has splits {', '.join(splits)} and none is 'train'; "
                            "save the split you want on its own.")
        dataset = dataset["train" if "train" in splits else splits[0]]
    return dataset.to_list() if hasattr(dataset, "to_list") else [dict(row) for row in dataset]


def _require_text_column(rows: Records, key: str, name: str, config_key: str) -> None:
    """Every row has non-empty text in column `key`; all rows that do not are reported together."""
    if all(key not in row for row in rows):
        columns = ", ".join(dict.fromkeys(k for row in rows[:100] for k in row))
        raise DataError(f"{name} has no column '{key}' (its columns are: {columns}); "
                        f"set {config_key} to the column that holds the text.")
    problems = []
    for row, place in zip(rows, rows.places):
        value = row.get(key)
        if not isinstance(value, str):
            found = "no value" if value is None else f"a value of type {type(value).__name__}"
            problems.append(f"{place} has {found} in column '{key}' where text is expected")
        elif not value.strip():
            problems.append(f"{place} has an empty '{key}'")
    raise_row_problems(name, problems, "Fix or remove those rows.")


# ----------------------------------------------------------------------------------------------
# Formatting and tokenizing


def check_prompt_template(template: str, columns: list[str], name: str) -> None:
    """Fail before formatting when the template is malformed or names a column the data lacks."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:
        raise DataError(f"data.prompt_template {template!r} is not a valid format string ({error}); "
                        "write literal braces as {{ and }}.") from None
    if not fields:
        raise DataError(f"data.prompt_template {template!r} has no {{prompt}} placeholder, so every prompt "
                        "would be the same text; add {prompt} where the prompt goes.")
    known = ["prompt", *columns]
    for field in fields:
        column = field.split(".")[0].split("[")[0]
        if column not in known:
            raise DataError(f"data.prompt_template names {{{field}}}, but {name} has no such column; "
                            f"use {{prompt}} or one of: {', '.join(columns)}.")


def format_prompt(row: dict[str, Any], prompt_key: str, tokenizer: Any, prompt_template: str | None = None,
                  use_chat_template: bool = True) -> str:
    """The text the model is given for `row` (see the module docstring for the order of choices)."""
    raw = row[prompt_key]
    if prompt_template is not None:
        return prompt_template.format_map({**row, "prompt": raw})
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": raw}], tokenize=False,
                                             add_generation_prompt=True)
    return raw


def _format_all(rows: Records, name: str, prompt_key: str, tokenizer: Any,
                prompt_template: str | None, use_chat_template: bool) -> list[str]:
    if prompt_template is not None:
        check_prompt_template(prompt_template, list(rows[0]), name)
    texts, problems = [], []
    for row, place in zip(rows, rows.places):
        try:
            texts.append(format_prompt(row, prompt_key, tokenizer, prompt_template, use_chat_template))
        except KeyError as error:
            problems.append(f"{place} has no column {error}, which data.prompt_template names")
    raise_row_problems(name, problems, "Fill those columns in or remove the rows.")
    return texts


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# ----------------------------------------------------------------------------------------------
# Prompts for RL


class PromptDataset:
    """Formatted, tokenized prompts; item i is a dict with keys
    `prompt` (formatted text), `prompt_ids` (list[int]), `raw_prompt` (the prompt column's text) and
    `columns` (every other column of the row, for reward functions)."""

    def __init__(self, source: Any, tokenizer: Any, prompt_key: str = "prompt", max_length: int = 512,
                 prompt_template: str | None = None, use_chat_template: bool = True, seed: int = 0,
                 shuffle: bool = True):
        rows, name = _load(source)
        _require_text_column(rows, prompt_key, name, "data.prompt_key")
        texts = _format_all(rows, name, prompt_key, tokenizer, prompt_template, use_chat_template)
        all_ids = _tokenize(tokenizer, texts)
        self.items = [
            {"prompt": text, "prompt_ids": ids, "raw_prompt": row[prompt_key],
             "columns": {k: v for k, v in row.items() if k != prompt_key}}
            for row, text, ids in zip(rows, texts, all_ids) if len(ids) <= max_length
        ]
        self.num_filtered = len(rows) - len(self.items)
        """Prompts dropped for being longer than `max_length` tokens."""
        self.seed, self.shuffle, self.name = seed, shuffle, name
        if not self.items:
            raise DataError(f"all {len(rows)} prompts in {name} are longer than {max_length} tokens (the "
                            f"shortest has {min(map(len, all_ids))}); raise data.max_prompt_length.")
        if self.num_filtered:
            logger.warning("dropped %d of %d prompts in %s longer than %d tokens (data.max_prompt_length)",
                           self.num_filtered, len(rows), name, max_length)

    @classmethod
    def from_config(cls, data_config: Any, tokenizer: Any, path: Any, seed: int = 0) -> PromptDataset:
        """Build from a `DataConfig`; `path` is `data_config.train_path` or `eval_path`."""
        return cls(path, tokenizer, prompt_key=data_config.prompt_key, max_length=data_config.max_prompt_length,
                   prompt_template=data_config.prompt_template, use_chat_template=data_config.use_chat_template,
                   seed=seed, shuffle=data_config.shuffle)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]

    def sampler(self, batch_size: int) -> PromptSampler:
        """An endless, resumable iterator of index batches over this dataset."""
        return PromptSampler(len(self), batch_size, seed=self.seed, shuffle=self.shuffle)

    def batch(self, indices: list[int]) -> dict[str, Any]:
        return collate([self.items[i] for i in indices])


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt items -> {"prompts", "prompt_ids", "raw_prompts": lists, "columns": {name: list}};
    a column missing from some rows is None there."""
    names = dict.fromkeys(name for item in items for name in item["columns"])
    return {
        "prompts": [item["prompt"] for item in items],
        "prompt_ids": [item["prompt_ids"] for item in items],
        "raw_prompts": [item["raw_prompt"] for item in items],
        "columns": {name: [item["columns"].get(name) for item in items] for name in names},
    }


class PromptSampler:
    """Batches of `batch_size` distinct indices into a dataset of `dataset_len`, forever.

    Epoch e is a permutation of range(dataset_len) from a generator seeded with (seed, e), or the
    identity order when `shuffle` is false. Each epoch is cut into dataset_len // batch_size full
    batches; the last dataset_len % batch_size indices of its permutation are skipped (drop_last), and
    since every epoch is reshuffled, different prompts are skipped in different epochs. Seeding with
    the pair rather than seed + e keeps runs with neighbouring seeds from sharing epoch orders.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
        if batch_size > dataset_len:
            raise DataError(f"the data has {dataset_len} prompts (after filtering), fewer than one batch of "
                            f"{batch_size}; lower trainer.prompts_per_step or add prompts.")
        self.dataset_len, self.batch_size, self.seed, self.shuffle = dataset_len, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0
        """Index into this epoch's order of the next prompt to hand out."""
        self._order: tuple[int, list[int]] | None = None  # (epoch, its order), cached

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self.position + self.batch_size > self.dataset_len:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position
        self.position += self.batch_size
        return self.epoch_order(self.epoch)[start:self.position]

    def epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed % 2**64, epoch])
                order = rng.permutation(self.dataset_len).tolist()
            else:
                order = list(range(self.dataset_len))
            self._order = (epoch, order)
        return self._order[1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dataset_len": self.dataset_len}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from `state`; "seed" and "dataset_len", when present, must match this sampler."""
        if state.get("dataset_len", self.dataset_len) != self.dataset_len:
            raise DataError(f"the sampler state was saved for {state['dataset_len']} prompts but the data now has "
                            f"{self.dataset_len}, so the order would differ; resume with the same data file "
                            "and data.max_prompt_length.")
        if state.get("seed", self.seed) != self.seed:
            raise DataError(f"the sampler state was saved with seed {state['seed']} but this run uses {self.seed}; "
                            "resume with the same trainer.seed.")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.dataset_len:
            raise DataError(f"sampler state {dict(state)} is out of range for {self.dataset_len} prompts.")
        self.epoch, self.position = epoch, position


# ----------------------------------------------------------------------------------------------
# Supervised fine-tuning pairs


class SFTDataset:
    """Prompt/response pairs; item i is {"input_ids": prompt + response + [eos], "labels": the same with
    IGNORE_INDEX on the prompt tokens}. Examples longer than `max_length` are dropped (`num_filtered`)."""

    def __init__(self, source: Any, tokenizer: Any, prompt_key: str = "prompt", response_key: str = "response",
                 max_length: int = 512, prompt_template: str | None = None, use_chat_template: bool = True):
        rows, name = _load(source)
        _require_text_column(rows, prompt_key, name, "data.prompt_key")
        _require_text_column(rows, response_key, name, "data.response_key")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise DataError("the tokenizer has no end-of-sequence token, so SFT responses cannot be ended; "
                            "set tokenizer.eos_token.")
        prompts = _format_all(rows, name, prompt_key, tokenizer, prompt_template, use_chat_template)
        prompt_ids = _tokenize(tokenizer, prompts)
        response_ids = _tokenize(tokenizer, [row[response_key] for row in rows])
        self.items = [
            {"input_ids": p + r + [eos], "labels": [IGNORE_INDEX] * len(p) + r + [eos]}
            for p, r in zip(prompt_ids, response_ids) if len(p) + len(r) + 1 <= max_length
        ]
        self.num_filtered = len(rows) - len(self.items)
        """Examples dropped for being longer than `max_length` tokens."""
        if not self.items:
            raise DataError(f"all {len(rows)} examples in {name} are longer than {max_length} tokens "
                            "(prompt + response + eos); raise sft.max_length.")
        if self.num_filtered:
            logger.warning("dropped %d of %d SFT examples in %s longer than %d tokens (sft.max_length)",
                           self.num_filtered, len(rows), name, max_length)

    @classmethod
    def from_config(cls, data_config: Any, sft_config: Any, tokenizer: Any, path: Any) -> SFTDataset:
        return cls(path, tokenizer, prompt_key=data_config.prompt_key, response_key=data_config.response_key,
                   max_length=sft_config.max_length, prompt_template=data_config.prompt_template,
                   use_chat_template=data_config.use_chat_template)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


def collate_sft(items: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item: input_ids, attention_mask and labels, each (B, T) int64."""
    length = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[row, :n] = torch.tensor(item["input_ids"])
        labels[row, :n] = torch.tensor(item["labels"])
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
