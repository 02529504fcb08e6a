"""`hybridrl export`: a checkpoint becomes a Hugging Face directory whose model gives the trained logits."""

import importlib.util

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl.cli import main
from hybridrl.data.datasets import PromptDataset
from hybridrl.training.trainer import RLTrainer

SETTINGS = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=4,
                actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False,
                trainer__total_steps=2, trainer__save_every=2, actor__lr=1e-2)


def train(tmp_path, **overrides):
    actor = tiny_actor()
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven, trainer__output_dir=str(tmp_path / "run"),
                        dataset=PromptDataset(toy_prompts(), actor.tokenizer, max_length=16), **{**SETTINGS, **overrides})
    trainer.train()
    return trainer


def logits(model, tokenizer):
    ids = torch.tensor([tokenizer.encode("3+4=7\n12+5=")])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_export_loads_with_from_pretrained_and_gives_identical_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = train(tmp_path)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "wrote a Hugging Face model" in capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("3+4=7") == trainer.parts.tokenizer.encode("3+4=7")
    assert torch.equal(logits(model, tokenizer), logits(trainer.parts.actor, trainer.parts.tokenizer))


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "error: checkpoint=" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (pip install 'hybridrl[peft]')")
def test_lora_export_merged_and_adapter(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = train(tmp_path, model__lora_rank=4)
    merged = tmp_path / "merged"
    assert main(["export", str(tmp_path / "run"), str(merged), "--merge-lora"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert torch.allclose(logits(model, trainer.parts.tokenizer), logits(trainer.parts.actor, trainer.parts.tokenizer),
                          atol=1e-5)
    adapter = tmp_path / "adapter"
    assert main(["export", str(tmp_path / "run"), str(adapter), "--adapter"]) == 0
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
