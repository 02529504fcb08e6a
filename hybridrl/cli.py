"""Command line: `hybridrl train|sft|demo|make-data|export|plot|watch|config show`.

Every user mistake the library reports as a typed error (config, data, model, reward, training)
is printed as one line and exit code 2; anything else is a bug and keeps its traceback. A run stopped
by SIGTERM/SIGINT, after it saved its checkpoint, exits with 128 + the signal's number (143, 130).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

import torch

from hybridrl.checkpoint.export import export_checkpoint
from hybridrl.checkpoint.run_lock import RunLockError, output_dir_lock
from hybridrl.checkpoint.store import CheckpointError
from hybridrl.config.explain import explained_yaml
from hybridrl.config.loading import load_config
from hybridrl.config.schema import ConfigError, MissingExtra
from hybridrl.data.datasets import DataError
from hybridrl.data.tasks import write_arithmetic_task
from hybridrl.data.tool_task import write_tool_task
from hybridrl.envs.builtin_tools import BUILTIN_TOOLS
from hybridrl.metrics.plot import PlotError, plot_run
from hybridrl.metrics.watch import watch
from hybridrl.models.loading import ModelError
from hybridrl.parallel import launch
from hybridrl.parallel.launch import LaunchError, StoppedBySignal
from hybridrl.rewards import RewardError, RewardSpecError
from hybridrl.training.sft import run_sft
from hybridrl.training.trainer import RLTrainer
from hybridrl.training.update import TrainingError

USER_ERRORS = (LaunchError, ConfigError, MissingExtra, DataError, ModelError, RewardError, RewardSpecError, TrainingError,
               CheckpointError, PlotError, RunLockError)
DEMO_CONFIGS = Path(__file__).resolve().parent / "config" / "demo"
"""The demo's SFT, GRPO and PPO configs: package data, so `hybridrl demo` runs from an installed wheel too
(examples/arithmetic_*.yaml link to them)."""
DEMO_PERIOD_RATE = 0.5  # see tasks.py: half the SFT answers end with a period the verifier rejects
DEMO_SLIP_RATE = 0.5  # see tasks.py: the teacher forgets the carry or borrow on this share of the problems needing one
DEMO_TEACHERS = {"arithmetic": {"period_rate": DEMO_PERIOD_RATE}, "carry": {"slip_rate": DEMO_SLIP_RATE}}
"""The arithmetic demos' teachers (write_arithmetic_task's keyword arguments): `arithmetic` slips in the answer's
format, `carry` in the arithmetic itself (docs/benchmarks.md#rl-on-the-arithmetic-skill-the-carry-task)."""
DEMO_SFT_OVERRIDES = {"arithmetic": [], "carry": ["sft.lr=1e-3"]}
"""Overrides of the SFT config per arithmetic demo: at the demo's 3e-3 the tiny model, taught by a teacher that slips
on carries, had not learned the arithmetic after 3,000 steps (most of its errors were not the slip, so RL had only
the slip to fix and little else to select from); at 1e-3 it learns all but the slip."""
DEMO_RL_STEPS = {"arithmetic": [], "carry": ["trainer.total_steps=100", "trainer.eval_every=25", "actor.lr=1e-4"]}
"""Overrides of the GRPO/PPO config per arithmetic demo: the carry task's gains were measured over 100 steps at 1e-4."""
DEMO_DIRS = {"arithmetic": "demo", "carry": "demo_carry", "tools": "demo_tools"}
"""The demo's tasks and their default output directories under runs/."""
DEMO_TOOL_RATE = 0.4  # see tool_task.py: the teacher calls calc on this share of problems
DEMO_TOOL_TRAIN, DEMO_TOOL_EVAL = 4000, 200


def cmd_train(args: argparse.Namespace) -> int | None:
    """Exit status 128 + the signal's number when a SIGTERM/SIGINT stopped the run (after saving), as the launcher's."""
    config = load_config(args.config, args.overrides)
    t = config.trainer
    relaunching = t.num_gpus > 1 and not launch.is_worker()  # then this process holds the run's lock for its workers
    with output_dir_lock(t.output_dir, enabled=relaunching):
        code = launch.maybe_relaunch(["train", args.config, *args.overrides], t.num_gpus, t.launcher, t.hang_timeout_s,
                                     entry=main)
    if code is None:
        trainer = RLTrainer(config)
        trainer.train()
        stopped_by = getattr(trainer, "stopped_by", None)  # a signal's name, or None when the run finished
        if stopped_by in signal.Signals.__members__ and not launch.is_worker():  # a worker's launcher says it
            return 128 + signal.Signals[stopped_by]
    elif code:
        raise launch.LaunchError(f"the {t.num_gpus}-process run failed (exit status {code}); the failing rank "
                                 "and its error are printed above.")


def cmd_sft(args: argparse.Namespace) -> None:
    path = run_sft(load_config(args.config, args.overrides))
    print(f"saved SFT model to {path}")


def cmd_config_show(args: argparse.Namespace) -> None:
    overrides = list(args.overrides)
    path = args.config
    if path is not None and "=" in path and not Path(path).exists():  # `config show rollout.n=4`: no file given
        path, overrides = None, [path, *overrides]
    config = load_config(path, overrides)
    if args.explain:
        print(explained_yaml(config), end="")
    else:
        print(config.to_yaml(), end="")


def cmd_make_data(args: argparse.Namespace) -> None:
    if args.task == "tools":
        paths = write_tool_task(args.out_dir, num_train=args.num_train or DEMO_TOOL_TRAIN, num_eval=args.num_eval or
                                DEMO_TOOL_EVAL, seed=args.seed, tool_rate=args.tool_rate)
    else:
        paths = write_arithmetic_task(args.out_dir, num_train=args.num_train or 9500, num_eval=args.num_eval or 500,
                                      seed=args.seed, period_rate=args.period_rate, slip_rate=args.slip_rate)
    print(" ".join(f"{split}={path}" for split, path in paths.items()))


def cmd_demo(args: argparse.Namespace) -> None:
    """SFT a tiny model, then RL it; prints held-out accuracy (and, for the tool task, the tool-call rate) before
    and after."""
    if not (DEMO_CONFIGS / "arithmetic_sft.yaml").is_file():
        raise ConfigError(f"the demo configs are not at {DEMO_CONFIGS}: this hybridrl install is incomplete; "
                          "reinstall it (`pip install --force-reinstall hybridrl`).")
    out = Path(args.out_dir or f"runs/{DEMO_DIRS[args.task]}")
    if args.task == "tools":
        demo_tools(args, out)
    else:
        demo_arithmetic(args, out)


def demo_arithmetic(args: argparse.Namespace, out: Path) -> None:
    start = time.time()
    data = write_arithmetic_task(out / "data", **DEMO_TEACHERS[args.task])
    data_overrides = [f"data.train_path={data['train']}", f"data.eval_path={data['eval']}"]
    sft_model = out / "sft" / "model"
    if (sft_model / "config.json").is_file():
        print(f"== 1/2 SFT: reusing {sft_model} (delete it to train it again)", flush=True)
    else:
        print("== 1/2 SFT: tiny random Llama -> arithmetic answers", flush=True)
        sft_model = run_sft(load_config(DEMO_CONFIGS / "arithmetic_sft.yaml",
                                        data_overrides + DEMO_SFT_OVERRIDES[args.task] +
                                        [f"trainer.output_dir={out / 'sft'}"] + args.overrides))
    rl_config = DEMO_CONFIGS / f"arithmetic_{args.algorithm}.yaml"
    print(f"== 2/2 RL ({args.algorithm}) from the SFT model, exact-match reward", flush=True)
    history = RLTrainer(load_config(rl_config, data_overrides + DEMO_RL_STEPS[args.task] + [
        f"model.path={sft_model}", f"trainer.output_dir={out / args.algorithm}"] + args.overrides)).train()
    evals = [row for row in history if "eval/accuracy" in row]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(f"held-out accuracy (greedy, {args.algorithm}): before RL {before:.1%} -> after RL {after:.1%} "
          f"({(after - before) * 100:+.1f} points); total wall time {time.time() - start:.0f} s; "
          f"metrics in {out / args.algorithm / 'metrics.jsonl'}")


def demo_tools(args: argparse.Namespace, out: Path) -> None:
    """The tool task: SFT on a teacher's conversations (the calc tool on some problems), then GRPO on episodes."""
    if args.algorithm != "grpo":
        raise ConfigError(f"the tool demo runs GRPO only (it has no {args.algorithm} config); drop --algorithm.")
    if not torch.cuda.is_available():
        # The tiny model's matmuls gain little from a second thread, while on a busy 2-core machine two spinning
        # OpenMP threads made each SFT step about 5x slower (docs/benchmarks.md#cpu-tool-demo).
        torch.set_num_threads(1)
    start = time.time()
    data = write_tool_task(out / "data", num_train=DEMO_TOOL_TRAIN, num_eval=DEMO_TOOL_EVAL, tool_rate=DEMO_TOOL_RATE)
    tools = [f"env.tools=[{BUILTIN_TOOLS}:calc]"]
    sft_model = out / "sft" / "model"
    if (sft_model / "config.json").is_file():
        print(f"== 1/2 SFT: reusing {sft_model} (delete it to train it again)", flush=True)
    else:
        print(f"== 1/2 SFT: tiny random Llama -> a teacher's conversations (calc tool on {DEMO_TOOL_RATE:.0%})",
              flush=True)
        sft_model = run_sft(load_config(DEMO_CONFIGS / "tools_sft.yaml", tools + [
            f"data.train_path={data['sft']}", f"trainer.output_dir={out / 'sft'}"] + args.overrides))
    print("== 2/2 RL (grpo) on multi-turn episodes with the calc tool, exact-match reward", flush=True)
    history = RLTrainer(load_config(DEMO_CONFIGS / "tools_grpo.yaml", tools + [
        f"data.train_path={data['train']}", f"data.eval_path={data['eval']}", f"model.path={sft_model}",
        f"trainer.output_dir={out / 'grpo'}"] + args.overrides)).train()
    evals = [row for row in history if "eval/accuracy" in row]
    (before, after), (rate_before, rate_after) = ((evals[0][key], evals[-1][key])
                                                  for key in ("eval/accuracy", "eval/reward/called_tool"))
    print(f"held-out (greedy, {DEMO_TOOL_EVAL} problems): accuracy before RL {before:.1%} -> after RL {after:.1%} "
          f"({(after - before) * 100:+.1f} points); tool-call rate {rate_before:.1%} -> {rate_after:.1%}; total wall "
          f"time {time.time() - start:.0f} s; metrics in {out / 'grpo' / 'metrics.jsonl'}")


def cmd_export(args: argparse.Namespace) -> None:
    path = export_checkpoint(args.checkpoint, args.out_dir, merge_lora=not args.adapter)
    print(f"wrote a Hugging Face model to {path} (load it with AutoModelForCausalLM.from_pretrained)")


def cmd_watch(args: argparse.Namespace) -> None:
    watch(args.run_dir, interval_s=args.interval, once=args.once)


def cmd_plot(args: argparse.Namespace) -> None:
    print(f"wrote {plot_run(args.run_dir, args.out)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrl", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (("train", cmd_train, "RL training (PPO, GRPO, ...) from a YAML config"),
                                ("sft", cmd_sft, "supervised fine-tuning from a YAML config")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("config", help="YAML config file")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=200")
        sub.set_defaults(fn=fn)
    config = commands.add_parser("config", help="inspect configs").add_subparsers(dest="action", required=True)
    show = config.add_parser("show", help="print the resolved config (the defaults when no file is given)")
    show.add_argument("config", nargs="?", help="a YAML config file")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.temperature=0.7")
    show.add_argument("--explain", action="store_true", help="write each key's documentation above it")
    show.set_defaults(fn=cmd_config_show)
    data = commands.add_parser("make-data", help="write a synthetic task (train/eval JSONL; tools: also sft.jsonl)")
    data.add_argument("out_dir")
    data.add_argument("--task", choices=list(DEMO_DIRS), default="arithmetic")
    data.add_argument("--num-train", type=int, default=None, help="default 9500 (arithmetic), 4000 (tools)")
    data.add_argument("--period-rate", type=float, default=0.5,
                      help="fraction of SFT targets the teacher ends with a period, which exact match rejects")
    data.add_argument("--slip-rate", type=float, default=0.0,
                      help="fraction of the problems needing a carry or borrow on which the teacher forgets it "
                           f"(`hybridrl demo --task carry`: {DEMO_SLIP_RATE})")
    data.add_argument("--tool-rate", type=float, default=DEMO_TOOL_RATE,
                      help="tools: fraction of problems the teacher solves with the calc tool")
    data.add_argument("--num-eval", type=int, default=None, help="default 500 (arithmetic), 200 (tools)")
    data.add_argument("--seed", type=int, default=1234)
    data.set_defaults(fn=cmd_make_data)
    demo = commands.add_parser("demo", help="the CPU demo: SFT a tiny model on arithmetic (or a tool task), then RL it")
    demo.add_argument("--task", choices=list(DEMO_DIRS), default="arithmetic",
                      help="carry: a teacher that forgets carries, so RL must improve the arithmetic itself; "
                           "tools: multiplication with a calc tool, multi-turn episodes")
    demo.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    demo.add_argument("--out-dir", default=None, help="default runs/demo (arithmetic), runs/demo_carry, runs/demo_tools")
    demo.add_argument("overrides", nargs="*", help="dotted overrides applied to both stages")
    demo.set_defaults(fn=cmd_demo)
    export = commands.add_parser("export", help="write a checkpoint's actor as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoints/step_* directory, or a run's output_dir (newest checkpoint)")
    export.add_argument("out_dir")
    lora = export.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", dest="adapter", action="store_false", help="LoRA: merge into the weights (default)")
    lora.add_argument("--adapter", dest="adapter", action="store_true", help="LoRA: write a peft adapter directory")
    export.set_defaults(fn=cmd_export, adapter=False)
    plot = commands.add_parser("plot", help="PNG curves (reward, KL, entropy, length, tokens/s) from metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(fn=cmd_plot)
    watch = commands.add_parser("watch", help="live terminal view of a run: curves, latest samples (needs [watch])")
    watch.add_argument("run_dir")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    watch.add_argument("--once", action="store_true", help="print one frame and exit")
    watch.set_defaults(fn=cmd_watch)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except StoppedBySignal as stop:
        print(f"hybridrl: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
