"""The sync point reads back only the rows of the sequences that finished (`ModelRunner.read_outputs(slots=...)`),
and the outputs are the same as when every row is read."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.engine.runner import ModelRunner, SlotRows

sys.path.insert(0, str(Path(__file__).parent))
from test_builtin_engine import make_model  # noqa: E402


def test_slot_rows_index_like_the_full_array():
    full = np.arange(40).reshape(8, 5)
    slots = [6, 1, 3]
    rows = SlotRows(full[slots], slots)
    for slot in slots:
        assert (rows[slot, :3] == full[slot, :3]).all() and rows[slot, 4] == full[slot, 4]
        assert (rows[slot] == full[slot]).all()
    with pytest.raises(KeyError):
        rows[0, :2]  # a slot that was not read


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_only_finished_rows_are_read_and_outputs_equal_full_reads(layout, monkeypatch):
    """Uneven forced lengths, fewer slots than sequences: each sequence's row is read once, when it finishes, and the
    tokens and log-probs equal those of an engine that reads every row at every such sync (the path before)."""
    model = make_model("qwen2")
    prompts = [[3 + p, 4, 5 + p] for p in range(6)]
    params = SamplingParams(max_new_tokens=24, n=3, temperature=1.0, seed=4, ignore_eos=True)
    lengths = [1 + (7 * i) % 24 for i in range(18)]
    options = dict(sync_every=3, kv_cache=layout, kv_block_size=4, max_num_seqs=7, attention="triton")
    read = ModelRunner.read_outputs
    rows_read = []

    def counting(self, batch, columns=None, slots=None):
        rows_read.append(batch if slots is None else len(slots))
        return read(self, batch, columns, slots)

    monkeypatch.setattr(ModelRunner, "read_outputs", counting)
    outputs = BuiltinBackend(model, **options).generate(prompts, params, response_lengths=lengths)
    assert sum(rows_read) == len(lengths)
    monkeypatch.setattr(ModelRunner, "read_outputs", lambda self, batch, columns=None, slots=None:
                        read(self, batch, columns))
    full = BuiltinBackend(model, **options).generate(prompts, params, response_lengths=lengths)
    assert [len(output.token_ids) for output in outputs] == lengths
    assert [output.token_ids for output in outputs] == [output.token_ids for output in full]
    assert [list(output.logprobs) for output in outputs] == [list(output.logprobs) for output in full]
