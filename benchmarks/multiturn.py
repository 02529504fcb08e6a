"""Multi-turn rollout throughput: episodes of 3 turns with a 50 ms tool between them, against one turn of the
same number of sampled tokens, on the built-in engine and the grpo-0.5b shape.

    python -m benchmarks.multiturn                 # 64 prompts x 8 episodes, prompt 256, 3 turns x 85 tokens
    python -m benchmarks.multiturn --quick         # 16 prompts, 3 turns x 32 tokens
    python -m benchmarks.multiturn --tiny --quick --prompts 2 --n 2   # CPU: checks the script, measures nothing

A random-init model calls no tools, so turns end at a fixed length (`ignore_eos`, `max_new_tokens` per turn) and
the environment is synthetic: 3 assistant turns per episode (`--turns`) with a tool call between each two (turn,
tool, turn, tool, turn), each sleeping `--tool-latency-ms` (asynchronously, as a remote tool would) and returning a
fixed `--observation-len`-token observation; the step after the last turn ends the episode at once (a final answer
calls no tool). `--tool-after-last-turn` is the definition used before: that step runs the tool too, only to say the
episode ended (every episode then waits one more tool latency at its end); `--both-definitions` times both, each
with its own row and ratio. The single-turn run
samples `turns x turn_len` tokens per sequence from the same prompts with `generate` (n samples per prompt), the
path a single-turn GRPO step takes. Both are timed after a warm-up call (compilation, CUDA graphs), the best of
`--repeats`; after the warm-up, as the trainer after its first step, the objects alive are collected and frozen
(`freeze_warm_up_objects`): otherwise a full garbage collection that walks everything compiling made can land in a
timed call (a large share of a call after compiling has made many objects) and the figure depends on where it lands.

Reported: sampled tokens/s of each and their ratio (the goal is >= 0.8; the seconds include each call's
CUDA-graph capture, `warm-up s`, as in `rollout.py`), the engine's idle time (waiting with
nothing to decode: every sequence paused on its tool), the prefill tokens (prompts once each, then only the
observations and each turn's last sampled token: no context is recomputed), and the hardware floor of each,
computed as in `benchmarks/rollout.py` (every decode step reads the weights and each sequence's KV; prefill at
peak FLOPs); the multi-turn floor adds the observation prefills and longer contexts, and no tool latency (which
other sequences' decoding can hide).

Prints a table last; writes JSON to $OUT/multiturn_benchmark.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch

from benchmarks.rollout import GRPO_05B, TINY, add_engine_arguments, build_model, parse_with_quick, sync
from hybridrl.envs.base import EnvironmentSession, StepResult
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine import llama_forward
from hybridrl.rollout.engine.backend import BuiltinBackend
from hybridrl.rollout.multiturn import EpisodeBudget
from hybridrl.training.trainer import freeze_warm_up_objects


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multiturn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    parser.add_argument("--n", type=int, default=8, help="episodes (samples) per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3, help="assistant turns per episode")
    parser.add_argument("--turn-len", type=int, default=85, help="sampled tokens per turn (forced)")
    parser.add_argument("--observation-len", type=int, default=32, help="tokens of each tool observation")
    parser.add_argument("--tool-latency-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each (the best is reported)")
    parser.add_argument("--tool-after-last-turn", action="store_true",
                        help="the earlier definition: the environment's step after the last turn runs the tool too")
    parser.add_argument("--both-definitions", action="store_true",
                        help="time multi-turn with and without the tool after the last turn (a row each; the "
                             "earlier definition with the first --extend-attention only)")
    parser.add_argument("--budget-slack", default="0",
                        help="tokens of episode budget over an episode's own (`episode_tokens`), or several "
                             "comma-separated (a row each, the first attention only): 33 is the budget used before, "
                             "with room for a third observation")
    parser.add_argument("--extend-attention", default=llama_forward.extend_attention,
                        help="the observation prefill's attention, or several comma-separated (a row each): "
                             f"{', '.join(llama_forward.EXTEND_ATTENTIONS)}")
    add_engine_arguments(parser, quick="16 prompts, 3 turns x 32 tokens")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_with_quick(build_parser(), argv, prompts=16, turn_len=32)
    args.extend_attentions = args.extend_attention.split(",")
    try:
        args.budget_slacks = [int(value) for value in args.budget_slack.split(",")]
    except ValueError:
        raise SystemExit(f"--budget-slack takes whole numbers of tokens, comma-separated; got {args.budget_slack!r}.")
    unknown = [name for name in args.extend_attentions if name not in llama_forward.EXTEND_ATTENTIONS]
    if unknown:
        raise SystemExit(f"--extend-attention {','.join(unknown)} is not one of "
                         f"{', '.join(llama_forward.EXTEND_ATTENTIONS)}; name one or several, comma-separated.")
    return args


def set_up(args: argparse.Namespace) -> tuple[str, object, list[list[int]], BuiltinBackend]:
    """The device, the model (grpo-0.5b shape, or `--tiny`), the seeded random prompts and the engine."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device, TINY if args.tiny else GRPO_05B)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
    engine = BuiltinBackend(model, kv_cache_memory=args.kv_cache_memory, use_cuda_graphs=not args.no_cuda_graphs,
                            compile=False if args.no_compile else None, attention="sdpa")
    return device, model, prompts, engine


class FixedIds:
    """Stands in for `ObservationRenderer` with a random-init model and no chat template: a row's prompt ids are
    given, every observation is the same fixed ids; decoding (only to hand text to the environment) is skipped."""

    def __init__(self, observation_ids: list[int]):
        self.observation = observation_ids
        self.tokenizer = self
        self.all_special_ids: list[int] = []

    def prompt_ids(self, messages) -> list[int]:
        return list(messages[0]["ids"])

    def observation_ids(self, messages, new_messages, sampled_ids=None) -> list[int]:
        return list(self.observation)

    def encode(self, text: str) -> list[int]:
        return self.observation[:1]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


class SlowTool:
    """An environment whose steps are tool calls of fixed latency; done after `turns` assistant turns. The step after
    the last turn calls no tool (a final answer), unless `tool_after_last_turn`."""

    def __init__(self, row: dict, turns: int, latency_s: float, tool_after_last_turn: bool = False):
        self.row, self.turns, self.latency_s, self.steps = row, turns, latency_s, 0
        self.tool_after_last_turn = tool_after_last_turn

    async def reset(self):
        return [{"role": "user", "content": "", "ids": self.row["ids"]}]

    async def step(self, assistant_text: str) -> StepResult:
        self.steps += 1
        last = self.steps >= self.turns
        if not last or self.tool_after_last_turn:
            await asyncio.sleep(self.latency_s)
        if last:
            return StepResult(reward=0.0, done=True)
        return StepResult([{"role": "tool", "name": "tool", "content": "result"}], done=False)


def time_best(fn, repeats: int, before=lambda: None, after=lambda seconds: None) -> tuple[float, object]:
    """The best wall time of `repeats` calls of `fn` (GPU work included) and the last result; `before()` and
    `after(seconds)` run around each timed call, outside its time (the trace tool's recording). The previous call's
    result is let go before the next call is timed: rebinding it to the next result would free it inside the next
    call's time (512 episodes' token, mask and log-prob lists: milliseconds of deallocation)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        before()
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        seconds = time.perf_counter() - start
        after(seconds)
        best = min(best, seconds)
    return best, result


def episode_tokens(args: argparse.Namespace) -> int:
    """The episode budget: an episode's tokens exactly (prompt, the turns, an observation between each two), as the
    single-turn side's sequences get their prompt and response exactly. The engine sizes each slot by it and the decode
    steps' key length stops at it, so slack there (an observation after the last turn, which no episode shows: it
    ends) would be read as keys by every step of the last turn."""
    return args.prompt_len + args.turns * args.turn_len + (args.turns - 1) * args.observation_len


def definitions(args: argparse.Namespace) -> list[bool]:
    """The episode definitions to time, as `tool_after_last_turn` values: the one asked for, or both."""
    return [False, True] if args.both_definitions else [args.tool_after_last_turn]


def run_multiturn(engine: BuiltinBackend, prompts: list[list[int]], args, tool_after_last_turn: bool | None = None,
                  slack: int = 0, **hooks) -> dict:
    """The timed multi-turn calls (`hooks`: `time_best`'s before/after); `tool_after_last_turn` (default: the flag's)
    picks the episode definition, `slack` the budget's tokens over an episode's own."""
    if tool_after_last_turn is None:
        tool_after_last_turn = args.tool_after_last_turn
    renderer = FixedIds(list(range(10, 10 + args.observation_len)))
    budget = EpisodeBudget(max_turns=args.turns, max_observation_tokens=args.observation_len,
                           max_episode_tokens=episode_tokens(args) + slack)
    params = SamplingParams(max_new_tokens=args.turn_len, temperature=1.0, ignore_eos=True, seed=0)

    def episodes(rows):
        factory = lambda row: SlowTool(row, args.turns, args.tool_latency_ms / 1000, tool_after_last_turn)  # noqa: E731
        sessions = [EnvironmentSession(factory, {"ids": prompt}, name="slow-tool", sample=i * args.n + j)
                    for i, prompt in enumerate(rows) for j in range(args.n)]
        return engine.generate_episodes(sessions, renderer, params, budget)

    episodes(prompts[:2])  # warm-up: compilation, CUDA graphs
    freeze_warm_up_objects()  # as the trainer after its first step (see there)
    seconds, result = time_best(lambda: episodes(prompts), args.repeats, **hooks)
    sampled = sum(e.num_sampled_tokens for e in result)
    turns = [e.num_turns for e in result]
    assert all(t == args.turns for t in turns), f"episodes ended early: turns {sorted(set(turns))}"
    stats = dict(engine.last_stats)
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds, stats=stats,
                idle_s=stats.get("idle_s"), prefill_tokens=stats.get("prefill_tokens"),
                observation_prefills=stats.get("observation_prefills"), tool_after_last_turn=tool_after_last_turn)


def run_single(engine: BuiltinBackend, prompts: list[list[int]], args, **hooks) -> dict:
    """The timed single-turn calls of the same sampled tokens (`hooks`: `time_best`'s before/after)."""
    params = SamplingParams(max_new_tokens=args.turns * args.turn_len, temperature=1.0, n=args.n, ignore_eos=True,
                            seed=0)
    engine.generate(prompts[:2], params)  # warm-up
    freeze_warm_up_objects()
    seconds, result = time_best(lambda: engine.generate(prompts, params), args.repeats, **hooks)
    sampled = sum(len(g.token_ids) for g in result)
    stats = dict(engine.last_stats)
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds, stats=stats,
                idle_s=0.0, prefill_tokens=stats.get("prefill_tokens"))


def floor(model, args, multiturn: bool, bandwidth: float, peak: float) -> dict:
    """Seconds the hardware needs at least: decode steps bound by reading weights and KV (or by FLOPs), prefill
    of each distinct prompt (and, multi-turn, of each observation) at peak FLOPs. Tool latency not included."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    sequences = args.prompts * args.n
    prefill_tokens = args.prompts * args.prompt_len
    context, decode = args.prompt_len, 0.0
    turns = args.turns if multiturn else 1
    turn_len = args.turn_len if multiturn else args.turns * args.turn_len
    for turn in range(turns):
        if turn:
            context += args.observation_len
            prefill_tokens += sequences * (args.observation_len + 1)
        for step in range(turn_len - 1):  # a turn's first token comes from the prefill logits
            step_bytes = weight_bytes + sequences * (context + 1 + step) * kv_bytes_per_token
            decode += max(step_bytes / bandwidth, 2 * params * sequences / peak)
        context += turn_len
    prefill = max(2 * params * prefill_tokens / peak, turns * weight_bytes / bandwidth)
    seconds = prefill + decode
    return dict(prefill_s=prefill, decode_s=decode, seconds=seconds, prefill_tokens=prefill_tokens,
                tokens_per_s=sequences * args.turns * args.turn_len / seconds)


def multiturn_runs(engine: BuiltinBackend, prompts: list[list[int]], args, report=print, on_run=lambda run: None,
                   **hooks) -> list[dict]:
    """Multi-turn timed for each `--extend-attention`, episode definition and budget slack asked for (the other
    definition and slacks with the first attention only), each with a `name` and passed to `on_run` once timed; a
    variant that fails (a kernel that does not compile on this machine, say) is reported and skipped, so one run
    still times the others."""
    runs = []
    variants = [(attention, definition, slack) for index, attention in enumerate(args.extend_attentions)
                for definition in definitions(args)[:None if index == 0 else 1]
                for slack in args.budget_slacks[:None if index == 0 else 1]]
    for attention, tool_after_last_turn, slack in variants:
        llama_forward.extend_attention = attention
        name = (f"{args.turns} turns + tool{', tool after last turn' if tool_after_last_turn else ''}"
                f"{f', extend {attention}' if len(args.extend_attentions) > 1 else ''}"
                f"{f', budget +{slack}' if slack else ''}")
        try:
            run = run_multiturn(engine, prompts, args, tool_after_last_turn, slack, **hooks)
        except Exception as error:  # noqa: BLE001: reported, the other variants still run
            report(f"{name}: FAILED: {type(error).__name__}: {str(error)[:2000]}")
            continue
        run.update(name=name, extend_attention=attention)
        on_run(run)
        report(f"{name}: {run['seconds']:.3f} s, stats {run['stats']}")
        runs.append(run)
    llama_forward.extend_attention = args.extend_attentions[0]
    return runs


def summary(model, args: argparse.Namespace, device: str, single: dict, runs: list[dict]) -> dict:
    """The runs, their ratios and both floors: what `print_table` shows and the JSON holds (`multi` and `ratio`: the
    first multi-turn run, the default definition)."""
    bandwidth, peak = args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12
    for run in runs:
        run["ratio"] = run["tokens_per_s"] / single["tokens_per_s"]
    return dict(args=vars(args), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, single=single, multi=runs[0], ratio=runs[0]["ratio"], multi_runs=runs,
                floor_single=floor(model, args, False, bandwidth, peak),
                floor_multi=floor(model, args, True, bandwidth, peak))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, model, prompts, engine = set_up(args)
    print(f"{args.prompts} prompts x {args.n} episodes, prompt {args.prompt_len}, {args.turns} turns x "
          f"{args.turn_len} tokens, observation {args.observation_len} tokens after a {args.tool_latency_ms:g} ms "
          f"tool; single turn: {args.turns * args.turn_len} tokens", flush=True)
    single = run_single(engine, prompts, args)
    print(f"single turn: {single['seconds']:.3f} s, stats {single['stats']}", flush=True)
    result = summary(model, args, device, single, multiturn_runs(engine, prompts, args))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "multiturn_benchmark.json"), "w") as handle:
            json.dump(result, handle, indent=2, default=str)
    print_table(result)


def print_table(result: dict) -> None:
    rows = [("run", "sampled tokens", "seconds", "tokens/s", "engine idle s", "prefill tokens", "warm-up s", "floor s",
             "% of floor", "ratio")]
    for run in [dict(result["single"], name="single turn"), *result["multi_runs"]]:
        bound = result["floor_multi" if "ratio" in run else "floor_single"]
        rows.append((run["name"], f"{run['sampled_tokens']}", f"{run['seconds']:.3f}", f"{run['tokens_per_s']:,.0f}",
                     f"{run['idle_s'] or 0:.3f}", f"{run['prefill_tokens']}", f"{run['stats'].get('warmup_s', 0):.3f}",
                     f"{bound['seconds']:.3f}", f"{100 * bound['seconds'] / run['seconds']:.1f}",
                     f"{run['ratio']:.2f}" if "ratio" in run else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"\n== multi-turn vs single-turn on {result['device']} (goal: ratio >= 0.8)")
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    print(f"multi-turn / single-turn tokens/s: {result['ratio']:.2f}")


if __name__ == "__main__":
    main()
