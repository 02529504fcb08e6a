"""The end-of-run summary: held-out metrics first -> last, steps, time, throughput, memory, paths."""

from hybridrl.metrics.summary import run_summary


def test_run_summary_by_hand(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    history = [{"step": 0, "eval/accuracy": 0.25, "eval/reward_mean": 0.5},
               {"step": 1, "perf/tokens_per_s": 100.0, "perf/peak_memory_gib": 1.5},
               {"step": 2, "perf/tokens_per_s": 300.0, "perf/peak_memory_gib": 2.0, "eval/accuracy": 0.5,
                "eval/reward_mean": 0.75}]
    text = run_summary(history, 12.4, tmp_path, model_dir=tmp_path / "model", title="GRPO")
    lines = text.splitlines()
    assert lines[0] == "== GRPO summary"
    assert lines[1] == "  eval/accuracy: 25.0% -> 50.0% (+25.0 points)"
    assert lines[2] == "  eval/reward_mean: 0.5 -> 0.75"
    assert lines[3] == "  2 steps in 12 s, 200 generated tokens/s on average, peak memory 2.00 GiB"
    assert lines[4] == f"  model: {tmp_path / 'model'}" and "metrics.jsonl" in lines[5]


def test_run_summary_without_evaluation_or_throughput(tmp_path):
    text = run_summary([{"step": 3, "sft/loss": 1.0}], 2.0, tmp_path)
    assert text.splitlines() == ["== run summary", "  3 steps in 2 s"]
