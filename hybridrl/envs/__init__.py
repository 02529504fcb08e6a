"""Environments for multi-turn episodes: the interface user code implements, the built-in tool environment,
token-exact observation rendering, the sandbox for running code, and the episode record.

This layer is standalone: the rollout engine and the trainer call it, it calls neither. An episode alternates
assistant turns (sampled) with observations from an environment (rendered by the chat template); see
docs/environments.md.
"""

from hybridrl.envs.base import StepResult

__all__ = ["StepResult"]
