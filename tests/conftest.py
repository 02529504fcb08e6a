"""Shared fixtures: tiny seeded models and a toy prompt set, all built locally (no downloads)."""

from __future__ import annotations

import gc

import pytest
import torch

from hybridrl.models.loading import build_tiny_model

torch.set_num_threads(2)


def tiny_actor(family: str = "llama", seed: int = 0, hidden_size: int = 32):
    """hidden_size=64 gives heads of 16, the least FlexAttention compiles for on CUDA."""
    return build_tiny_model(family, seed=seed, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, **({"head_dim": 8} if family == "qwen3" else {}))


@pytest.fixture(autouse=True)
def unfreeze_after_each_test():
    """A trainer's first step freezes the live objects out of garbage collection (`gc.freeze`, right for one
    long run); in this one process of many short runs, hand them back after each test."""
    yield
    gc.unfreeze()


@pytest.fixture
def actor():
    return tiny_actor()


def toy_prompts(num: int = 64) -> list[dict]:
    return [{"prompt": f"{i % 10}+{(i * 7) % 10}=", "answer": str(i % 10 + (i * 7) % 10)} for i in range(num)]


def contains_seven(prompts, completions, **columns):
    """A reward a random policy earns sometimes and RL can raise quickly."""
    return [float("7" in c) for c in completions]
