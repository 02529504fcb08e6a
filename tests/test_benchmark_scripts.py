"""The GPU benchmark scripts still run, on CPU with tiny shapes, so an edit cannot break them unnoticed
and waste a device call (their figures come only from GPU runs; these tests check the code paths)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import grpo_step, long_tail, rollout, scaling
from benchmarks.profiling.gaps import gap_report, kernel_table
from benchmarks.profiling.step_profiling import update_with_gap_report

ROOT = Path(__file__).resolve().parents[1]


def run_script(args: list[str], out_dir: Path, timeout: int = 300) -> str:
    env = dict(os.environ, OUT=str(out_dir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def script_command_lines(script: Path) -> list[tuple[str, list[str]]]:
    """(module, arguments) of each `python3 -m benchmarks.X ...` a shell script runs (comment lines skipped):
    continuation lines joined, the arguments cut at the first redirection, pipe or command separator (variables
    stay as written)."""
    text = script.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"-m (benchmarks(?:\.\w+)+)", line):
            arguments = []
            for token in shlex.split(line[match.end():]):
                if any(mark in token for mark in (">", "|", ";", "&&")) or token == ")":
                    break
                arguments.append(token)
            commands.append((match.group(1), arguments))
    return commands


PARSERS = {"benchmarks.grpo_step": lambda args: grpo_step.build_parser().parse_args(args),
           "benchmarks.rollout": lambda args: rollout.parse_args(args),
           "benchmarks.scaling": lambda args: scaling.parse_args(args),
           "benchmarks.long_tail": lambda args: long_tail.parse_args(args)}


@pytest.mark.parametrize("script, expected", [
    ("gpu_checks.sh", {"benchmarks.grpo_step", "benchmarks.rollout", "benchmarks.long_tail"}),
    ("node_runs.sh", {"benchmarks.grpo_step"}),
    ("two_gpu_runs.sh", {"benchmarks.scaling"})])
def test_shell_scripts_pass_arguments_their_scripts_accept(script, expected):
    """Every grpo_step / rollout / scaling command line in the device-call scripts parses with that script's own
    argparse parser (an unknown flag or a flag without its value exits here, not in a device call)."""
    commands = [(module, args) for module, args in script_command_lines(ROOT / "benchmarks" / script)
                if module in PARSERS]
    assert {module for module, _ in commands} == expected
    for module, args in commands:
        try:
            PARSERS[module](args)
        except SystemExit as error:
            raise AssertionError(f"{script}: python3 -m {module} {shlex.join(args)} does not parse") from error


def test_rollout_with_no_agreement_sequences_skips_the_agreement_check(tmp_path):
    """`--agreement-sequences 0` runs the rest of the benchmark and says the agreement check was skipped."""
    stdout = run_script(["-m", "benchmarks.rollout", "--tiny", "--quick", "--prompts", "2", "--n", "2",
                         "--prompt-len", "8", "--response-len", "4", "--hf-sequences", "2", "--agreement-sequences", "0",
                         "--repeats", "1", "--no-eager-baseline", "--no-triton"], tmp_path)
    assert "greedy agreement skipped" in stdout and "floor (computed)" in stdout
    result = json.loads((tmp_path / "rollout_benchmark.json").read_text())
    assert result["greedy_agreement"] is None and result["hf_bf16_vs_float32_equal_fraction"] is None


def test_long_tail_tiny_runs_both_layouts_on_forced_long_tailed_lengths(tmp_path):
    """`long_tail.py --tiny` on CPU: both layouts run every response to its drawn length (the script asserts it) and
    report a floor; the default draw is the benchmark's shape: median about 1k, a few at the 8k cap."""
    lengths = long_tail.response_lengths(512, 1024, 1.0, 16, 8192)
    assert 900 <= sorted(lengths)[256] <= 1150 and max(lengths) == 8192 and min(lengths) >= 16
    stdout = run_script(["-m", "benchmarks.long_tail", "--tiny", "--trace"], tmp_path)
    assert "paged / contiguous:" in stdout and "floor (computed)" in stdout
    result = json.loads((tmp_path / "long_tail.json").read_text())
    assert set(result["layouts"]) == {"contiguous", "paged"} and result["floor"]["seconds"] > 0
    for layout in result["layouts"].values():  # --trace: every decode step in some window, by batch bucket
        assert layout["windows"]["totals"]["steps"] == layout["stats"]["decode_steps"]
    assert result["layouts"]["paged"]["stats"]["kv_blocks_peak"] > 0
    assert result["layouts"]["paged"]["tokens"] == result["layouts"]["contiguous"]["tokens"] == result["lengths"]["total"]


def test_two_gpu_async_tiny_runs_each_side_on_forced_lengths_and_times_the_push(tmp_path):
    """`two_gpu_async.py --tiny` on CPU (rollout_device=cpu): the async runs at staleness 1 and 2 and the synchronous
    loop on the same drawn lengths (the script asserts each step's mean length), the weight push, and the rollout
    process's push over a gloo link between two processes."""
    stdout = run_script(["-m", "benchmarks.two_gpu_async", "--tiny"], tmp_path)
    assert "async-1 / sync:" in stdout and "| push |" in stdout
    result = json.loads((tmp_path / "two_gpu_async.json").read_text())
    runs = {run["run"]: run for run in result["runs"]}
    assert set(runs) == {"async-1", "async-2", "sync"}
    assert runs["async-1"]["staleness_mean"] == 1.0 and runs["sync"]["staleness_mean"] == 0.0
    assert runs["async-2"]["rollout_device"] == "cpu" and runs["async-2"]["staleness_mean"] == 1.5  # steps 2, 3
    assert len({run["generated_per_step"] for run in runs.values()}) == 1  # the same batch in every run
    assert result["pushes"][0]["publish_s"] > 0
    assert "| link |" in stdout and result["links"][0]["backend"] == "gloo" and result["links"][0]["push_s"] > 0


def test_multiturn_benchmark_runs_three_turns_against_one(tmp_path):
    """`multiturn.py` on the tiny model: every episode has its 3 turns, the same tokens are sampled both ways, and
    the prefill counts only the prompts once and then each resume's observation plus the turn's last token."""
    stdout = run_script(["-m", "benchmarks.multiturn", "--tiny", "--quick", "--prompts", "2", "--n", "2",
                         "--prompt-len", "16", "--turn-len", "8", "--observation-len", "4", "--tool-latency-ms", "5",
                         "--repeats", "1", "--both-definitions"], tmp_path)
    assert "multi-turn / single-turn tokens/s" in stdout and "tool after last turn" in stdout
    result = json.loads((tmp_path / "multiturn_benchmark.json").read_text())
    multi, single = result["multi"], result["single"]
    assert [run["tool_after_last_turn"] for run in result["multi_runs"]] == [False, True]  # the default first
    assert multi["sampled_tokens"] == single["sampled_tokens"] == 2 * 2 * 3 * 8
    assert multi["observation_prefills"] == 2 * 2 * 2  # two resumes per episode
    assert multi["prefill_tokens"] == 2 * 16 + 2 * 2 * 2 * (4 + 1) == result["floor_multi"]["prefill_tokens"]
    assert multi["idle_s"] >= 0 and result["ratio"] > 0


def test_multiturn_benchmark_calls_no_tool_after_the_last_turn_unless_asked():
    """The benchmark's episode: turn, tool, turn, tool, turn; the step after the last turn ends the episode at once
    (a final answer calls no tool), and only `--tool-after-last-turn` (the earlier definition) waits for the tool."""
    import asyncio

    from benchmarks.multiturn import SlowTool

    def step_within_a_second(tool: SlowTool):
        return asyncio.run(asyncio.wait_for(tool.step(""), timeout=1.0))

    with pytest.raises(asyncio.TimeoutError):  # a middle step: the tool's 60 s
        step_within_a_second(SlowTool({"ids": [1]}, turns=2, latency_s=60))
    tool = SlowTool({"ids": [1]}, turns=2, latency_s=60)
    tool.steps = 1  # past the middle step
    assert step_within_a_second(tool).done
    old = SlowTool({"ids": [1]}, turns=2, latency_s=60, tool_after_last_turn=True)
    old.steps = 1
    with pytest.raises(asyncio.TimeoutError):
        step_within_a_second(old)


def test_optimizer_step_quick_times_each_offload_share_and_the_baseline(tmp_path):
    baseline = tmp_path / "baseline_optim.py"
    baseline.write_text((ROOT / "hybridrl/training/optim.py").read_text())
    run_script(["-m", "benchmarks.kernels.optimizer_step", "--quick", "--steps", "1", "--baseline", str(baseline)], tmp_path)
    rows = json.loads((tmp_path / "optimizer_step.json").read_text())["rows"]
    assert [(r["offload"], r["version"]) for r in rows] == [(share, version) for share in (1.0, 0.5, 0.0)
                                                            for version in ("this", "baseline")]
    assert all(r["step_s"] > 0 for r in rows)


def test_host_batch_times_this_batch_builder_beside_a_baseline_and_the_decoding(tmp_path):
    baseline = tmp_path / "baseline_batch.py"
    baseline.write_text((ROOT / "hybridrl/training/batch.py").read_text())
    out = run_script(["-m", "benchmarks.profiling.host_batch", "--baseline", str(baseline), "--repeats", "1"], tmp_path)
    for row in ("harvest into lists", "harvest as numpy rows (the engine)", "build_rollout_batch (this, lists)",
                "build_rollout_batch (this, numpy)", "build_rollout_batch (baseline)", "decode_responses (512, lists)",
                "decode_responses (512, numpy)"):
        assert row in out


def test_flex_layouts_quick_times_every_layout(tmp_path):
    stdout = run_script(["-m", "benchmarks.kernels.flex_layouts", "--quick"], tmp_path)
    results = json.loads((tmp_path / "flex_layouts.json").read_text())["results"]
    assert {(r["layout"], r["kv"]) for r in results} == {(layout, kv) for layout in ("separate", "shared", "causal")
                                                         for kv in ("gqa", "repeat")}
    pairs = {r["layout"]: r["visible_pairs"] for r in results}
    # 2 prompts x 2 samples, P = R = 8: separate rows 4 x 16*17/2; shared: both groups in one row of 128,
    # 2 x (8*9/2 + 2 (8*8 + 8*9/2)), and the 80 padding tokens see themselves
    assert pairs["separate"] == pairs["causal"] == 4 * 136
    assert pairs["shared"] == 2 * (36 + 2 * (64 + 36)) + 80
    assert "fwd floor" in stdout


@pytest.mark.slow
def test_grpo_step_quick_runs_and_writes_its_table(tmp_path):
    """The recommended mode (compiled layers, offloaded moments, fused projections) for two steps."""
    stdout = run_script(["-m", "benchmarks.grpo_step", "--quick", "--modes", "grpo-0.5b-fused", "--steps", "2"], tmp_path)
    assert "mode                 step s" in stdout and "grpo-0.5b-fused" in stdout.split("mode                 step s")[1]
    result = json.loads((tmp_path / "grpo_step.json").read_text())
    assert "grpo-0.5b-fused" in json.dumps(result)


@pytest.mark.slow
def test_rollout_benchmark_runs_every_engine_variant(tmp_path):
    """Every engine variant of `rollout.py` on the tiny model (on CPU the attention kernels' PyTorch references) and
    HF generate."""
    stdout = run_script(["-m", "benchmarks.rollout", "--tiny", "--quick", "--prompts", "2", "--n", "2", "--prompt-len",
                         "8", "--response-len", "4", "--hf-sequences", "2", "--agreement-sequences", "2",
                         "--agreement-tokens", "4", "--repeats", "1", "--no-eager-baseline"], tmp_path)
    assert "floor (computed)" in stdout and "+ fused gate/up" in stdout
    assert json.loads((tmp_path / "rollout_benchmark.json").read_text())["engine_triton_fused_qkv_gate_up"]


def test_gap_report_sums_idle_time_by_size_and_kernel_pair(capsys):
    """`gaps.gap_report` (decode_gaps.py, grpo_step.py --gaps) on a hand-made timeline (µs): overlapping kernels leave no gap."""
    gap_report([(0, 10, "gemm"), (11.5, 20, "attn"), (19, 25, "norm"), (125, 130, "gemm"), (131, 140, "attn")])
    out = capsys.readouterr().out
    assert "idle between kernels: 0.1 ms in 3 gaps" in out
    assert "gaps    1-2    us:     0.0 ms in      2" in out and "gaps  100-inf  us:     0.1 ms in      1" in out
    assert out.index("norm") < out.index("gemm                                   -> attn")


def test_kernel_table_sums_gpu_time_by_kernel_name_per_unit(capsys):
    """`gaps.kernel_table` (decode_gaps.py's profile): total, count and µs per call and per unit (decode step)."""
    kernel_table([(0, 30, "attn"), (40, 50, "gemm"), (60, 90, "attn"), (100, 104, "norm")], per=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "GPU time by kernel (0.1 ms in all; us per unit: of 2):"
    assert lines[1].split() == ["0.06", "ms", "2", "x", "30.00", "us", "30.0", "us/unit", "attn"]
    assert [line.split()[-1] for line in lines[1:]] == ["attn", "gemm", "norm"]


def test_grpo_step_gap_report_wraps_the_update_and_returns_its_metrics(capsys):
    """`grpo_step.py --gaps` swaps in a profiled update; without a GPU it still returns the update's metrics."""
    calls = []
    traced = update_with_gap_report(lambda batch: calls.append(batch) or {"actor/policy_loss": 0.5}, "mode", False)
    assert traced("batch") == {"actor/policy_loss": 0.5} and calls == ["batch"]
    assert "the update's GPU idle time" in capsys.readouterr().out


def test_grpo_step_refuses_gaps_with_too_few_steps(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "benchmarks.grpo_step", "--quick", "--gaps", "--steps", "3"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--gaps needs --steps 4 or more" in result.stderr


def test_trace_report_names_the_operator_that_waited_and_the_phase_gaps(tmp_path):
    """`trace_report.py` on a hand-made Chrome trace (µs): a 5 ms stream sync inside `index_put_` is listed with the
    operators around it, the 6 ms idle gap inside the rollout phase is listed, and the 0.1 ms one is not."""
    def op(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7}

    events = [
        op("phase:rollout", 1000, 20000, "gpu_user_annotation"),
        op("gemm", 1000, 2000, "kernel"), op("attn", 3100, 900, "kernel"),  # 0.1 ms gap
        op("Memcpy HtoD (Pageable -> Device)", 10000, 50, "gpu_memcpy"), op("attn", 10050, 3050, "kernel"),
        op("aten::index_put_", 4000, 5200), op("aten::copy_", 4050, 5100),
        op("cudaStreamSynchronize", 4100, 5000, "cuda_runtime"), op("cudaLaunchKernel", 9500, 10, "cuda_runtime"),
    ]
    path = tmp_path / "trace.json.gz"
    import gzip
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)
    out = run_script(["-m", "benchmarks.profiling.trace_report", str(path), "--gap-ms", "1", "--wait-ms", "1"], tmp_path)
    assert "== rollout: 0.0-20.0 ms" in out and "GPU activity 6.0 ms in 4 kernels and copies" in out
    assert "idle   6.00 ms from     3.00 ms, then Memcpy HtoD" in out
    assert "idle   0.10" not in out
    assert "cudaStreamSynchronize  in  aten::copy_ < aten::index_put_" in out
    assert "cudaLaunchKernel" not in out


def test_trace_report_host_window_lists_outermost_operations_and_untraced_stretches(tmp_path):
    """`--host`: the main thread's outermost operations (not what runs inside them, not the phase range around
    them, not another thread's), the gaps between them with no traced operation, and the GPU's busy share."""
    def op(name, ts, dur, cat="cpu_op", tid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [
        op("gemm", 1000, 2500, "kernel"), op("attn", 9000, 500, "kernel"),
        op("phase:rollout", 1000, 20000, "user_annotation"),
        op("Torch-Compiled Region: 0/0", 2000, 1500), op("cudaLaunchKernel", 2100, 1200, "cuda_runtime"),
        op("aten::zeros", 6500, 300),  # shorter than --host-ms
        op("aten::item", 9000, 1100), op("worker op", 3600, 4000, tid=9), op("worker op", 8000, 10, tid=9),
    ]
    path = tmp_path / "trace.json.gz"
    import gzip
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)
    out = run_script(["-m", "benchmarks.profiling.trace_report", str(path), "--host", "0-10", "--host-ms", "1"], tmp_path)
    assert "GPU busy 30% of the window" in out  # 2.5 + 0.5 ms of 10 ms
    assert "1.00 ms     1.50 ms  Torch-Compiled Region: 0/0" in out
    assert "2.50 ms     3.00 ms  (no traced operation)" in out  # 3.5 -> 6.5 ms
    assert "5.80 ms     2.20 ms  (no traced operation)" in out and "8.00 ms     1.10 ms  aten::item" in out
    for hidden in ("cudaLaunchKernel", "aten::zeros", "worker op", "phase:rollout"):
        assert hidden not in out
    bad = subprocess.run([sys.executable, "-m", "benchmarks.profiling.trace_report", str(path), "--host", "5"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--host takes a window in ms like 540-640" in bad.stderr


def test_trace_report_rates_each_matrix_product_by_shape(tmp_path):
    """With recorded shapes, kernels are tied to their mm/addmm by External id: a split-K product's two kernels
    add their time and count its FLOPs once, an addmm's bias is not a matrix, and ops without shapes are skipped."""
    import gzip

    def event(name, cat, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7, "args": args}

    events = [
        event("phase:update", "gpu_user_annotation", 0, 10_000),
        event("aten::mm", "cpu_op", 0, 5, **{"External id": 1, "Input Dims": [[4096, 4096], [4096, 4096]]}),
        event("k1", "kernel", 10, 150, **{"External id": 1}), event("k1b", "kernel", 170, 50, **{"External id": 1}),
        event("aten::addmm", "cpu_op", 300, 5, **{"External id": 2, "Input Dims": [[1024], [2048, 1024], [1024, 1024]]}),
        event("k2", "kernel", 310, 20, **{"External id": 2}),
        event("aten::mm", "cpu_op", 400, 5, **{"External id": 3}),  # no shapes recorded
        event("k3", "kernel", 410, 20, **{"External id": 3}),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)
    out = run_script(["-m", "benchmarks.profiling.trace_report", str(path)], tmp_path)
    # 2*4096^3 = 137.4 GFLOP in 200 us = 687 TFLOP/s; 2*2048*1024*1024 = 4.29 GFLOP in 20 us = 215 TFLOP/s.
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[-3:] for line in out.splitlines()
            if line.strip().startswith("aten::")}
    assert rows == {"aten::mm (4096,": ["1", "0.20", "687"], "aten::addmm (2048,": ["1", "0.02", "215"]}
    assert "matrix products: 0.2 ms of kernels, 644 TFLOP/s on average" in out  # (137.4 + 4.3) GFLOP / 220 us


def test_engine_ab_parses_named_option_sets():
    from benchmarks.profiling.engine_ab import parse_option_set  # imports the engine: here, not at collection

    assert parse_option_set("default:") == ("default", {})
    assert parse_option_set("mixed:attention=sdpa,sync_every=32,use_cuda_graphs=False") == (
        "mixed", {"attention": "sdpa", "sync_every": 32, "use_cuda_graphs": False})


def check_decode_attention_launches_script() -> None:
    """Run by the test below in Triton's interpreter: `decode_attention.py`'s check of a launch (the engine's call:
    raw q and K/V, RoPE, bias, cache write) passes for the default and another launch, fails for a kernel that
    zeroes the new key and value, and leaves the module's launch constants as they were."""
    import torch
    from decode_attention_cases import make_case, rope_inputs, with_new_kv

    from benchmarks.kernels import decode_attention as script
    from hybridrl.rollout.kernels import decode_attention, decode_launch

    case, new_kv = with_new_kv(make_case(0, 6, 2, 7, 64, 3, 40, 30, dtype=torch.float16))
    cos, sin, bias = rope_inputs(case, with_bias=True)
    before = decode_launch.BLOCK_N, decode_launch.NUM_WARPS
    for config in (script.DEFAULT, {"block_n": 16, "num_warps": 2}):
        script.check(config, case, (new_kv, (cos, sin), bias))
    assert (decode_launch.BLOCK_N, decode_launch.NUM_WARPS) == before

    def zeroed(*args, new_kv, **kwargs):
        return decode_attention.triton_decode_attention(*args, new_kv=new_kv * 0, **kwargs)

    try:
        script.check(script.DEFAULT, case, (new_kv, (cos, sin), bias), attention=zeroed)
    except AssertionError:
        pass
    else:
        raise AssertionError("check() accepted a kernel that attends and writes the wrong keys")
    print("decode_attention launch checks passed")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
def test_decode_attention_benchmark_checks_each_launch_against_the_reference():
    from decode_attention_cases import run_in_interpreter  # tests/ is on sys.path under pytest

    output = run_in_interpreter("test_benchmark_scripts", "check_decode_attention_launches_script")
    assert "decode_attention launch checks passed" in output
