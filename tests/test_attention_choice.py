"""training/attention_choice.py: which SDPA backends a step may use (`trainer.cudnn_attention`), and that a step
runs with that choice and restores PyTorch's afterwards."""

from __future__ import annotations

import pytest
import torch

from hybridrl import RLTrainer
from hybridrl.config.loading import load_config
from hybridrl.data.datasets import PromptDataset
from hybridrl.training.attention_choice import uses_cudnn_attention
from tests.conftest import tiny_actor, toy_prompts

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


@pytest.mark.parametrize("choice, prompt, new_tokens, expected", [
    ("auto", 16, 6, False),  # a light run (the time-to-accuracy shape): precompiled kernels only
    ("auto", 512, 256, True),  # longer sequences keep PyTorch's order
    ("auto", 16, 64, True),  # responses long enough for the compiled engine are not light
    (True, 16, 6, True),
    (False, 512, 256, False),
])
def test_choice(choice, prompt, new_tokens, expected):
    config = load_config(None, trainer__cudnn_attention=choice, data__max_prompt_length=prompt,
                         rollout__max_new_tokens=new_tokens)
    assert uses_cudnn_attention(config, CUDA) is expected


def test_auto_on_cpu_leaves_pytorch_s_choice():
    config = load_config(None, data__max_prompt_length=16, rollout__max_new_tokens=6)
    assert uses_cudnn_attention(config, torch.device("cpu"))


@pytest.mark.parametrize("choice", [False, True])
def test_a_step_runs_with_the_choice_and_restores_pytorch_s(tmp_path, choice):
    seen = []

    def reward(prompts, completions, **columns):  # runs inside the step
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return [float("7" in c) for c in completions]

    actor = tiny_actor()
    trainer = RLTrainer(actor=actor, reward_fn=reward, dataset=PromptDataset(toy_prompts(), actor.tokenizer,
                                                                             max_length=16),
                        trainer__output_dir=str(tmp_path), trainer__total_steps=1, trainer__prompts_per_step=2,
                        trainer__device="cpu", rollout__num_samples_per_prompt=2, rollout__max_new_tokens=4,
                        trainer__cudnn_attention=choice, logging__sinks=["jsonl"])
    assert torch.backends.cuda.cudnn_sdp_enabled()
    trainer.step()
    assert seen == [choice]
    assert torch.backends.cuda.cudnn_sdp_enabled(), "PyTorch's own choice is back after the step"


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["auto", True])
def test_light_steps_on_the_gpu_launch_no_cudnn_attention(tmp_path, choice):
    """Two steps of a light run (engine rollout with its CUDA graphs, graphed update) under the profiler: with
    `auto` no cuDNN attention runs anywhere in them, captures included; with true, whether it did is printed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    actor = tiny_actor("qwen2", hidden_size=64)
    actor.model.to(device="cuda", dtype=torch.bfloat16)
    trainer = RLTrainer(actor=actor, reward_fn=lambda prompts, completions, **_: [float("7" in c) for c in completions],
                        dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16),
                        trainer__output_dir=str(tmp_path), trainer__device="cuda", trainer__prompts_per_step=4,
                        rollout__num_samples_per_prompt=2, rollout__max_new_tokens=6, rollout__backend="builtin",
                        data__max_prompt_length=16,  # light: `auto` reads the config's limit, not the dataset's
                        trainer__cudnn_attention=choice, logging__sinks=["jsonl"])
    assert uses_cudnn_attention(trainer.config, trainer.device) is (choice is True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):  # the update's graph is captured at the second step
            metrics = trainer.step()
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    cudnn = sorted(name for name in names if "cudnn" in name.lower() and "attention" in name.lower())
    print(f"cudnn_attention={choice}: cuDNN attention ops {cudnn or 'none'}")
    assert torch.isfinite(torch.tensor(metrics["actor/policy_loss"]))
    if choice == "auto":
        assert not cudnn
