"""Multi-turn episodes in training: the run's environment, one session per sample, and episodes -> `RolloutBatch`.

An episode is one token sequence: the prompt the environment's first messages render to, then assistant turns
(sampled; in the loss) and observations (rendered by the chat template; out of the loss). It becomes a batch row
in the single-turn layout, so every later phase runs unchanged:

    [ left padding | prompt ids ][ turn 1 | observation 1 | turn 2 | ... | right padding ]
                    prompt part   "response": response_mask = the episode's loss mask (holes over observations)

Choices:
- The row holds `Episode.token_ids` as they are and `sampler_logp` holds the episode's behaviour log-probs: the
  trainer scores and trains on exactly the ids the engine fed and sampled; no text is tokenized here.
- `response_mask` is the episode's loss mask, so every loss, advantage, KL and entropy mean, and the token
  counts and normalisers, count sampled tokens only; the attention mask covers observations as well (the model
  reads them). Advantage recursions (GAE, return-to-go) pass over the holes (see `algorithms.py`).
- `truncated` is an episode that a budget ended (`max_tokens`, `max_turns`) rather than its environment.
- Reward functions score the episode: the completion they get is the final assistant turn's text, and the
  columns `messages` (the whole conversation), `tool_calls` (one dict per call: name, arguments, result, error,
  timed_out, malformed, latency_s, where) and `env_reward` (the environment's last reward, or None) are added to the
  data's columns (replacing any of the same name).
- Groups are episodes: the `n` episodes of one data row are adjacent (prompt-major sessions), so GRPO/RLOO
  groups and `prompt_index` work as for single-turn samples.
- With several processes each generates the episodes of a contiguous share of the rows (its own environments,
  seeds offset by rank, as `sharding.generate_sharded`) and every rank gets all of them; an environment error on
  one rank (a chat template failing on an observation is one, `ObservationTemplateError`) is raised on every rank,
  so none waits for a rank that failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.config.schema import Config, ConfigError
from hybridrl.envs.base import EnvironmentCodeError, EnvironmentFactory, EnvironmentSession, load_environment
from hybridrl.envs.episode import Episode, episode_metrics
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.envs.sandbox import python
from hybridrl.envs.tools import ToolBox, ToolCallFormat
from hybridrl.parallel.process_group import DistributedSetup
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.multiturn import EpisodeBudget
from hybridrl.training.batch import RolloutBatch

EPISODE_COLUMNS = ("messages", "tool_calls", "env_reward")
"""Columns reward functions get for episodes, besides the data's own."""

ENGINE_STATS = {"prefill_tokens": "rollout/prefill_tokens", "observation_prefills": "rollout/observation_prefills",
                "idle_s": "rollout/engine_idle_s"}
"""The built-in engine's `last_stats` logged each multi-turn step (key -> metric): tokens prefilled (prompts once,
then only each observation), resumes after observations, and the time it waited with nothing to decode."""


def final_assistant_text(episode: Episode) -> str:
    """The text of the episode's last assistant turn (what reward functions get as the completion)."""
    return next((m["content"] for m in reversed(episode.messages) if m.get("role") == "assistant"), "")


def episode_columns(episodes: list[Episode]) -> dict[str, list]:
    """The trajectory columns for reward functions, one value per episode."""
    return {"messages": [[dict(m) for m in e.messages] for e in episodes],
            "tool_calls": [[asdict(record) for record in e.tool_calls] for e in episodes],
            "env_reward": [e.reward for e in episodes]}


def episodes_to_batch(episodes: list[Episode], group_size: int, pad_token_id: int,
                      sampling: SamplingParams | None = None) -> RolloutBatch:
    """Episodes (prompt-major, `group_size` per data row) -> a padded `RolloutBatch` on the host, with the episodes'
    ids, loss masks and behaviour log-probs as they are, the final turns' texts and the trajectory columns."""
    if not episodes or len(episodes) % group_size:
        raise ValueError(f"got {len(episodes)} episodes for groups of {group_size}; give group_size per data row.")
    prompt_lens = np.array([e.spans[0].end for e in episodes], dtype=np.int64)
    total_lens = np.array([len(e.token_ids) for e in episodes], dtype=np.int64)
    prompt_len, response_len = int(prompt_lens.max()), max(1, int((total_lens - prompt_lens).max()))
    ids = np.full((len(episodes), prompt_len + response_len), pad_token_id, dtype=np.int64)
    response_mask = np.zeros((len(episodes), response_len), dtype=np.float32)
    sampler_logp = np.zeros((len(episodes), response_len), dtype=np.float32)
    for row, (episode, p, n) in enumerate(zip(episodes, prompt_lens, total_lens)):
        ids[row, prompt_len - p:prompt_len + n - p] = episode.token_ids
        response_mask[row, :n - p] = episode.loss_mask[p:]
        sampler_logp[row, :n - p] = episode.behaviour_logprobs[p:]
    first = torch.from_numpy(prompt_len - prompt_lens)[:, None]
    end = torch.from_numpy(prompt_len + total_lens - prompt_lens)[:, None]
    column = torch.arange(prompt_len + response_len)
    attention_mask = ((column >= first) & (column < end)).long()
    position_ids = torch.minimum((column - first).clamp(min=0), end - first - 1)  # as `build_rollout_batch`
    batch = RolloutBatch(
        input_ids=torch.from_numpy(ids), attention_mask=attention_mask, position_ids=position_ids,
        response_mask=torch.from_numpy(response_mask), sampler_logp=torch.from_numpy(sampler_logp),
        truncated=torch.tensor([e.done_reason in ("max_tokens", "max_turns") for e in episodes]),
        prompt_index=torch.arange(len(episodes)) // group_size,
        sampling=sampling if sampling is not None else SamplingParams(n=group_size))
    batch.texts = [final_assistant_text(e) for e in episodes]
    batch.columns = episode_columns(episodes)
    return batch


def check_shared_prompts(episodes: list[Episode], group_size: int) -> None:
    """`actor.share_prompt_tokens` trains each row's prompt once for its episodes, so they must begin alike."""
    for start in range(0, len(episodes), group_size):
        prompts = {tuple(e.span_ids(e.spans[0])) for e in episodes[start:start + group_size]}
        if len(prompts) > 1:
            raise ConfigError(f"actor.share_prompt_tokens needs the {group_size} episodes of a data row to start with "
                              f"the same prompt, but the environment's reset gave data row {start // group_size} "
                              "different first messages; set actor.share_prompt_tokens=false.")


def engine_metrics(stats: dict[str, Any] | None) -> dict[str, float]:
    return {metric: float(stats[key]) for key, metric in ENGINE_STATS.items() if stats and key in stats}


@dataclass
class EpisodeRollout:
    """How a multi-turn run turns a step's prompt rows into a batch: its environment factory, renderer and budget."""

    factory: EnvironmentFactory
    name: str
    """The environment as the user named it (in error messages)."""
    renderer: ObservationRenderer
    budget: EpisodeBudget
    pad_token_id: int
    prompt_key: str = "prompt"
    stop_strings: list[str] = field(default_factory=list)
    """Extra strings that end an assistant turn (the tool environment's closing tag)."""
    share_prompt_tokens: bool = False
    setup: DistributedSetup = field(default_factory=DistributedSetup)

    def __enter__(self) -> EpisodeRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Calls the factory's optional `close()`: a `ToolBox` stops its worker processes (`RLTrainer.train` does
        this when it ends, normally or by an error, so no tool process outlives the run)."""
        close = getattr(self.factory, "close", None)
        if callable(close):
            close()

    def generate(self, backend: Any, prompts: dict[str, Any], params: SamplingParams
                 ) -> tuple[RolloutBatch, dict[str, float]]:
        """`params.n` episodes per prompt row of `prompts` (a `PromptDataset.batch`): the batch with its texts and
        trajectory columns, and its rollout metrics (`episode_metrics` and the engine's counters)."""
        columns = prompts["columns"]
        rows = [{**{key: values[i] for key, values in columns.items()}, self.prompt_key: raw}
                for i, raw in enumerate(prompts["raw_prompts"])]
        turn = replace(params, n=1, stop_strings=[*params.stop_strings,
                                                  *(s for s in self.stop_strings if s not in params.stop_strings)])
        episodes = self.generate_sharded(backend, rows, turn, params.n)
        if self.share_prompt_tokens:
            check_shared_prompts(episodes, params.n)
        batch = episodes_to_batch(episodes, params.n, self.pad_token_id, sampling=params)
        return batch, {**episode_metrics(episodes), **engine_metrics(getattr(backend, "last_stats", None))}

    def generate_sharded(self, backend: Any, rows: list[dict[str, Any]], params: SamplingParams,
                         n: int) -> list[Episode]:
        """`n` episodes per row, prompt-major; each rank makes the sessions of its share of the rows (sample numbers
        are places in the whole batch) and the episodes are gathered in rank order."""
        setup = self.setup
        start, stop = (len(rows) * r // setup.world_size for r in (setup.rank, setup.rank + 1))
        sessions = []
        try:  # making an environment runs user code too
            sessions = [EnvironmentSession(self.factory, row, name=self.name, sample=(start + i) * n + j)
                        for i, row in enumerate(rows[start:stop]) for j in range(n)]
            if setup.is_distributed and params.seed is not None:
                params = replace(params, seed=params.seed + 1_000_003 * setup.rank)
            local = backend.generate_episodes(sessions, self.renderer, params, self.budget) if sessions else []
            error = None
        except EnvironmentCodeError as failure:
            if not setup.is_distributed:
                raise
            local, error = [], str(failure)
        if not setup.is_distributed:
            return local
        gathered: list[Any] = [None] * setup.world_size
        dist.all_gather_object(gathered, (local, error))
        errors = [error for _, error in gathered if error]
        if errors:
            raise EnvironmentCodeError(errors[0])
        return [episode for part, _ in gathered for episode in part]


def build_environment(config: Config) -> tuple[EnvironmentFactory, str] | None:
    """The environment factory of `env` (a `ToolBox` for `env.tools`, else the user's `env.environment`) and its
    name, or None when multi-turn is off. Cheap checks first: a bad spec fails here, before any model loads."""
    e = config.env
    if not e.enabled:
        return None
    if e.environment:
        return load_environment(e.environment), e.environment
    tools = [python if spec == "python" else spec for spec in e.tools]
    # The budget (`EpisodeBudget`, env.max_turns) ends an episode whose last turn still called tools, as
    # `max_turns` (truncated); the tool environment's own limit, one turn later, never comes first to call it done.
    toolbox = ToolBox(tools, timeout_s=e.tool_timeout_s, num_workers=e.num_tool_workers,
                      format=ToolCallFormat(e.tool_call_start, e.tool_call_end), max_turns=e.max_turns + 1,
                      system_prompt=e.system_prompt or None, prompt_key=config.data.prompt_key)
    return toolbox, "env.tools"


def build_episode_rollout(config: Config, environment: tuple[EnvironmentFactory, str] | None, tokenizer: Any,
                          backend: Any, pad_token_id: int, setup: DistributedSetup | None = None
                          ) -> EpisodeRollout | None:
    """The run's `EpisodeRollout`, or None when multi-turn is off; refuses a backend without `generate_episodes`
    and (through `ObservationRenderer`) a chat template without a tool role."""
    if environment is None:
        return None
    if not callable(getattr(backend, "generate_episodes", None)):
        raise ConfigError(f"the {type(backend).__name__} rollout backend cannot generate multi-turn episodes "
                          "(env.environment or env.tools is set); use rollout.backend=builtin or hf.")
    factory, name = environment
    e = config.env
    tools = factory.schemas if isinstance(factory, ToolBox) else None
    return EpisodeRollout(
        factory=factory, name=name, renderer=ObservationRenderer(tokenizer, tools=tools),
        budget=EpisodeBudget(e.max_turns, e.max_episode_tokens, e.max_observation_tokens), pad_token_id=pad_token_id,
        prompt_key=config.data.prompt_key, stop_strings=[e.tool_call_end] if tools is not None else [],
        share_prompt_tokens=config.actor.share_prompt_tokens, setup=setup or DistributedSetup())
