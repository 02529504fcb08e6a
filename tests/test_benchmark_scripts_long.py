"""`long_update.py` and `full_7b_one_gpu.py` (issue 31) run on CPU with tiny shapes, and the FLOPs their MFU divides
are the FLOPs the update performs (counted by torch's FlopCounterMode on a tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks import full_7b_one_gpu, long_update
from benchmarks.grpo_step import SHAPES
from hybridrl.training.logprobs import response_logprobs
from test_benchmark_scripts import run_script

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000)


def test_update_flops_by_hand():
    """hidden 4, vocab 10, 2 layers, tied, 100 parameters; sequences of 3 and 5 tokens, 4 response tokens:
    body 100 - 40 = 60 -> 6 * 60 * 8 = 2880; head 6 * 10 * 4 * 4 = 960; attention 6 * 2 * 4 * (9 + 25) = 1632."""
    shape = dict(hidden_size=4, vocab_size=10, num_hidden_layers=2, tie_word_embeddings=True)
    flops = long_update.update_flops(shape, 100, [3, 5], 4)
    assert (flops["body_params"], flops["matmul"], flops["head"], flops["attention"]) == (60, 2880, 960, 1632)
    assert flops["total"] == 5472
    untied = long_update.update_flops({**shape, "tie_word_embeddings": False}, 140, [3, 5], 4)
    assert untied["body_params"] == 60 and untied["total"] == 5472  # an untied head is counted once, at its positions


@pytest.mark.parametrize("tied", [True, False])
def test_update_flops_match_what_the_update_computes(tied):
    """Forward + backward of the update's log-prob pass on a tiny Qwen2 (eager attention, so every product is a
    counted matmul) costs what `update_flops` says plus the work it leaves out as recompute: attention counted in full
    (the eager kernel computes the whole square where causal attention needs half) and the LM head's logits made
    again in its backward (8 instead of 6 x vocab x hidden per position). Biases and norms are in the parameter count
    but are not matmuls (<1%)."""
    torch.manual_seed(0)
    config = Qwen2Config(**TINY, tie_word_embeddings=tied, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    sequences, length, response = 3, 96, 24
    input_ids = torch.randint(0, TINY["vocab_size"], (sequences, length))
    mask = torch.ones_like(input_ids)
    positions = torch.arange(length).expand(sequences, length)
    with FlopCounterMode(display=False) as counter:
        logp, _ = response_logprobs(model, input_ids, mask, positions, response, real_tokens=sequences * length)
        logp.sum().backward()
    params = sum(p.numel() for p in model.parameters())
    flops = long_update.update_flops({**TINY, "tie_word_embeddings": tied}, params, [length] * sequences,
                                     sequences * response)
    expected = flops["matmul"] + flops["head"] * 8 / 6 + 2 * flops["attention"]
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)
    assert flops["attention"] > 0.05 * flops["total"]  # the test would notice the attention term missing


def test_long_update_tiny_runs_each_variant_and_reports_mfu(tmp_path):
    """`long_update.py --tiny`: every variant runs its updates in its own process on the synthetic batch, with
    gradient checkpointing really on where the variant asks for it (HF checkpoints only in train mode), and reports
    the FLOPs of the batch it trained on."""
    stdout = run_script(["-m", "benchmarks.long_update", "--tiny", "--variants", "ckpt,nockpt-compile"], tmp_path)
    assert "FLOPs per update:" in stdout and "MFU" in stdout
    variants = {r["variant"]: r for r in json.loads((tmp_path / "long_update.json").read_text())["variants"]}
    assert set(variants) == {"ckpt", "nockpt-compile"}
    for name, result in variants.items():
        assert result["checkpointing_active"] == (name == "ckpt") and result["train_mode"]
        assert len(result["updates"]) == 2 and result["mfu"] > 0 and result["tokens"] == 4 * 64
        assert all(torch.isfinite(torch.tensor(update["loss"])) for update in result["updates"])
        assert result["flops"] == long_update.update_flops({**TINY, "tie_word_embeddings": True}, result["params"],
                                                           [64] * 4, 4 * 48)


def test_full_7b_one_gpu_tiny_runs_each_variant(tmp_path):
    """`full_7b_one_gpu.py --tiny`: full GRPO steps (rollout + update) per variant, the update's MFU from the
    same FLOP count, with its floors."""
    stdout = run_script(["-m", "benchmarks.full_7b_one_gpu", "--tiny", "--variants", "ckpt,nockpt-mb4k"], tmp_path)
    assert "7b-full-one-gpu:" in stdout and "floor s" in stdout
    variants = {r["variant"]: r for r in json.loads((tmp_path / "full_7b_one_gpu.json").read_text())["variants"]}
    assert set(variants) == {"ckpt", "nockpt-mb4k"}
    for result in variants.values():
        assert len(result["steps"]) == 2 and result["generated_per_step"] == 4 * 2 * 8
        assert result["update_mfu"] > 0 and result["step_floor_s"] > result["update_floor_s"] > 0
        assert result["flops"] == long_update.update_flops(SHAPES["tiny"], result["params"], [24] * 8, 8 * 8)
    assert variants["nockpt-mb4k"]["spec"]["settings"]["model__gradient_checkpointing"] is False


def test_the_scripts_refuse_an_unknown_variant(capsys):
    for script in (long_update, full_7b_one_gpu):
        with pytest.raises(SystemExit):
            script.parse_args(["--variants", "ckpt,fast"])
        assert "unknown variant 'fast'" in capsys.readouterr().err


def test_budget_bounds_each_variant_by_what_is_left_and_starts_none_short_of_a_minute(monkeypatch, capsys):
    """`--budget 200`: the first variant may use 150 s (its --timeout), the second only the 80 s left after the first
    took 120 s, and a third with 20 s left is not started (its process would outlive the device call)."""
    clock = iter([0.0, 0.0, 120.0, 180.0])  # the deadline, then before each variant
    monkeypatch.setattr(long_update.time, "monotonic", lambda: next(clock))
    calls = []
    monkeypatch.setattr(long_update, "child", lambda name, timeout, *rest, **options: calls.append((name, timeout))
                        or {"mode": name, "error": "stopped here"})
    args = long_update.parse_args(["--variants", "ckpt,ckpt-compile,nockpt-compile", "--budget", "200"])
    results = []
    long_update.run_variants(args, "benchmarks.long_update", (), None, lambda found, _: results.extend(found))
    assert calls == [("ckpt", 150), ("ckpt-compile", 80)]
    assert results[2] == {"mode": "nockpt-compile", "error": "not started: 20 s of --budget 200 left"}
