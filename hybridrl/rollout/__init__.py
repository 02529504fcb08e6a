"""Rollout backends behind one interface (see `base.py`)."""

from hybridrl.rollout.base import FinishReason, Generation, RolloutBackend, SamplingParams

__all__ = ["FinishReason", "Generation", "RolloutBackend", "SamplingParams"]
