"""What the asynchronous rollout worker hands the trainer (`Trajectories`: one step's scored batch with the policy
version of each sequence, and of each token with partial rollouts), its exact JSON form for checkpoints, and the
staleness it is logged with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from hybridrl.rollout.base import SamplingParams
from hybridrl.training.batch import RolloutBatch


def staleness_metrics(versions: torch.Tensor, trainer_version: int, token_versions: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None) -> dict[str, float]:
    """Lag of each sequence (its oldest token) behind the weights that train on it (versions, (B,)); with partial
    rollouts also per response token (token_versions and mask, (B, R))."""
    lag = (trainer_version - versions).float()
    metrics = {"rollout/staleness_mean": lag.mean().item(), "rollout/staleness_max": lag.max().item()}
    if token_versions is not None:
        token_lag = (trainer_version - token_versions).float() * mask
        metrics["rollout/staleness_token_mean"] = (token_lag.sum() / mask.sum()).item()
    return metrics


@dataclass
class Trajectories:
    """One step's scored rollout, as the worker hands it to the trainer."""

    step: int
    """The trainer step that consumes it."""
    versions: torch.Tensor
    """(B,) policy version that sampled each sequence."""
    indices: list[int]
    """The prompts' positions in the training data set."""
    batch: RolloutBatch
    """On the CPU, with `scores`, `texts` and the behaviour log-probs (`sampler_logp`)."""
    reward_metrics: dict[str, float]
    sampler_state: dict[str, int]
    """The data sampler's position after these prompts were drawn."""
    generate_s: float = 0.0
    reward_s: float = 0.0
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """Multi-turn episodes' `rollout/*` metrics (turns, tool calls, ...) and dynamic sampling's counts."""
    samples: list[list] = field(default_factory=list)
    """[prompts, completions, rewards] to show with the step that trains on the batch (`logging.num_samples_to_print`
    of them), not with whichever step the trainer is in when the worker scores it."""
    token_versions: torch.Tensor | None = None
    """(B, R) version of each response token, with partial rollouts (`partial_rollout.py`); `versions` is then each
    sequence's oldest."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (floats round-trip exactly through Python's float repr)."""
        batch = {}
        for f in fields(self.batch):
            value = getattr(self.batch, f.name)
            if isinstance(value, torch.Tensor):
                batch[f.name] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                                 "values": value.flatten().tolist()}
            elif f.name == "sampling":
                batch[f.name] = asdict(value)
            elif value is not None:
                batch[f.name] = value
        return {"step": self.step, "versions": self.versions.tolist(), "indices": self.indices, "batch": batch,
                "reward_metrics": {key: float(value) for key, value in self.reward_metrics.items()},
                "rollout_metrics": {key: float(value) for key, value in self.rollout_metrics.items()},
                "samples": self.samples, "sampler_state": self.sampler_state,
                **({"token_versions": self.token_versions.tolist()} if self.token_versions is not None else {})}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Trajectories:
        values: dict[str, Any] = {}
        for name, value in record["batch"].items():
            if name == "sampling":
                values[name] = SamplingParams(**value)
            elif name == "columns":  # episodes' trajectory columns: plain JSON already
                values[name] = value
            elif isinstance(value, dict):
                dtype = getattr(torch, value["dtype"])
                values[name] = torch.tensor(value["values"], dtype=dtype).reshape(value["shape"])
            else:
                values[name] = value
        return cls(step=record["step"], versions=torch.tensor(record["versions"]), indices=record["indices"],
                   batch=RolloutBatch(**values), reward_metrics=record["reward_metrics"],
                   sampler_state=record["sampler_state"], rollout_metrics=record.get("rollout_metrics", {}),
                   samples=record.get("samples", []),
                   token_versions=torch.tensor(record["token_versions"]) if "token_versions" in record else None)
