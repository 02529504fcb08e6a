"""QLoRA (`model.load_in_4bit`): a frozen NF4 base through bitsandbytes (it has CPU kernels) with a peft
adapter: only the adapter trains, the reference is the 4-bit base, checkpoints hold the adapter, and the
settings that cannot work are refused with one sentence."""

import logging
import sys

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl.config.loading import load_config
from hybridrl.config.schema import ConfigError, MissingExtra
from hybridrl.models.loading import load_hf_model

pytest.importorskip("peft")
QLORA = dict(model__lora_rank=4, model__load_in_4bit=True)


def needs_bitsandbytes():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'hybridrl[qlora]')")


def make_trainer(out, actor=None, **overrides):
    from test_trainer import FAST

    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    actor = actor or tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    settings = {**FAST, **QLORA, "trainer__output_dir": str(out), "trainer__total_steps": 2, "actor__lr": 1e-2,
                "algorithm__kl_coef": 0.1, **overrides}
    return RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, **settings)


def test_only_the_adapter_trains_through_the_builtin_engine(tmp_path):
    needs_bitsandbytes()
    from hybridrl.models.lora import AdapterDisabled
    from hybridrl.rollout.engine.backend import BuiltinBackend

    trainer = make_trainer(tmp_path, rollout__backend="builtin", trainer__save_model=True)
    assert isinstance(trainer.parts.rollout, BuiltinBackend)  # its 4-bit path: dequantized per layer
    actor = trainer.parts.actor
    assert isinstance(trainer.parts.reference, AdapterDisabled)
    assert sum(type(m).__name__ == "Linear4bit" for m in actor.modules()) == 14  # 7 per layer, not the head
    named = dict(actor.named_parameters())
    before = {name: p.detach().clone() for name, p in named.items()}
    base_before = {k: v.clone() for k, v in actor.state_dict().items() if "lora_" not in k}
    history = trainer.train()
    moved = {name for name, p in named.items() if not torch.equal(before[name], p)}
    assert moved and all("lora_" in name for name in moved) and any("lora_A" in name for name in moved)
    base_after = {k: v for k, v in actor.state_dict().items() if "lora_" not in k}
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # packed weights and their scales
    assert history[-1]["actor/kl"] > 0
    saved = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved  # the adapter, not the base


def test_reference_is_the_4bit_base():
    needs_bitsandbytes()
    from test_logprobs import padded_batch

    from hybridrl.models.lora import AdapterDisabled, apply_lora
    from hybridrl.models.qlora import quantize_4bit
    from hybridrl.training.logprobs import response_logprobs

    model, _ = tiny_actor()
    assert quantize_4bit(model) == 14 and quantize_4bit(model) == 0
    ids, mask, positions, response = padded_batch()
    with torch.no_grad():
        base_logp, _ = response_logprobs(model, ids, mask, positions, response)
    actor = apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():  # a trained adapter: B != 0
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
        ref_logp, _ = response_logprobs(AdapterDisabled(actor), ids, mask, positions, response)
        actor_logp, _ = response_logprobs(actor, ids, mask, positions, response)
    assert torch.equal(ref_logp, base_logp)
    assert not torch.allclose(actor_logp, base_logp, atol=1e-3)


def test_checkpoint_holds_the_adapter_and_resumes_it(tmp_path):
    needs_bitsandbytes()
    from safetensors.torch import load_file

    first = make_trainer(tmp_path, trainer__save_every=2)
    first.train()
    state = load_file(tmp_path / "checkpoints" / "step_000002" / "state" / "part-00001.safetensors")
    assert state and all("lora_" in name for name in state)  # no 4-bit base weights in the checkpoint
    resumed = make_trainer(tmp_path, trainer__save_every=2)  # the same base, rebuilt; a fresh adapter
    assert resumed.train() == first.logger.history and resumed.step_count == 2
    trained = [p for p in first.parts.actor.parameters() if p.requires_grad]
    restored = [p for p in resumed.parts.actor.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(trained, restored))
    old, new = first.parts.actor_optimizer.state, resumed.parts.actor_optimizer.state
    for a, b in zip(trained, restored):
        assert all(torch.equal(torch.as_tensor(old[a][k]), torch.as_tensor(new[b][k])) for k in old[a])


def test_export_merges_into_the_full_precision_base(tmp_path, caplog):
    needs_bitsandbytes()
    from transformers import AutoModelForCausalLM

    from hybridrl.checkpoint.export import export_checkpoint

    tiny = load_hf_model("tiny:llama", dtype="float32")
    make_trainer(tmp_path / "run", actor=load_hf_model("tiny:llama", dtype="float32"), model__path="tiny:llama",
                 trainer__save_every=2).train()
    with caplog.at_level(logging.WARNING, logger="hybridrl.checkpoint.export"):
        export_checkpoint(tmp_path / "run", tmp_path / "merged")
    assert "differs from the trained policy by the 4-bit rounding error" in caplog.text
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    original = dict(tiny.model.named_parameters())
    for name, param in merged.named_parameters():
        assert torch.equal(param, original[name]) == ("proj" not in name), name  # the adapter went into the projections
    export_checkpoint(tmp_path / "run", tmp_path / "adapter", merge_lora=False)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("overrides, words", [
    ({"model__load_in_4bit": True}, "set model.lora_rank > 0"),
    ({**QLORA, "trainer__num_gpus": 2, "trainer__prompts_per_step": 2}, "set trainer.num_gpus=1"),
    ({**QLORA, "algorithm": "ppo"}, "needs critic.path"),
])
def test_settings_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(**overrides)


def test_missing_bitsandbytes_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    with pytest.raises(MissingExtra, match=r"model.load_in_4bit needs bitsandbytes.*hybridrl\[qlora\]"):
        load_hf_model("tiny:llama", load_in_4bit=True)


def test_builtin_engine_on_a_4bit_base_matches_hf_generate_and_forward():
    """The engine dequantizes each 4-bit layer as it runs it (`llama_forward.unpacked`): greedy tokens equal
    HF generate through bitsandbytes' own layers and log-probs equal HF's forward (1e-4), without and
    with a LoRA adapter on top; fusing q/k/v is skipped for packed weights."""
    needs_bitsandbytes()
    from peft import LoraConfig, get_peft_model
    from test_builtin_engine import PROMPTS, hf_greedy, hf_logprobs

    from hybridrl.models.qlora import quantize_4bit
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.engine.weights import resolve_weights

    model = load_hf_model("tiny:qwen2").model.eval()
    assert quantize_4bit(model) == 7 * model.config.num_hidden_layers
    torch.manual_seed(2)
    base = load_hf_model("tiny:qwen2").model
    quantize_4bit(base)  # then the adapter, as the trainer does: its own layers stay full precision
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)  # peft starts B at zero: make the adapter matter
    for candidate in (model, adapted.eval()):
        assert BuiltinBackend.supports(candidate) == (True, "ok")
        engine = BuiltinBackend(candidate, fuse_qkv=True)
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
        for prompt, generation in zip(PROMPTS, outputs):
            assert generation.token_ids == hf_greedy(candidate, prompt, 8)
            reference = hf_logprobs(candidate, prompt, generation.token_ids)
            torch.testing.assert_close(torch.tensor(generation.logprobs), reference, atol=1e-4, rtol=0)
        assert all(layer.qkv_weight is None for layer in resolve_weights(candidate, fuse_qkv=True).layers)


def test_auto_backend_picks_the_engine_for_a_4bit_base_on_gpu():
    """On a GPU `auto` picks the engine for a 4-bit base too (faster than HF generate at a lower peak,
    docs/benchmarks.md). On CPU `auto` keeps hf."""
    needs_bitsandbytes()
    from hybridrl.models.qlora import quantize_4bit
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.hf import HFBackend
    from hybridrl.training.components import build_rollout

    actor = tiny_actor()
    quantize_4bit(actor.model)
    assert isinstance(build_rollout(load_config(None), actor.model, actor.tokenizer, torch.device("cuda")), BuiltinBackend)
    assert isinstance(build_rollout(load_config(None), actor.model, actor.tokenizer, torch.device("cpu")), HFBackend)

def test_dequantizing_the_4bit_base_once_gives_the_per_step_results(monkeypatch):
    """`dequantize_4bit=True` copies every 4-bit layer at full precision once per `generate` (then q/k/v can be fused
    and, on a GPU, CUDA graphs captured), `auto` as many layers as fit its budget (here: one, patched): greedy tokens
    and log-probs equal the per-layer-per-step path, with and without a LoRA adapter. The sizes are the base's
    projections at full precision; `auto` copies nothing on CPU; the budget takes whole layers from the first."""
    needs_bitsandbytes()
    from peft import LoraConfig, get_peft_model
    from test_builtin_engine import PROMPTS

    import hybridrl.rollout.engine.runner as runner
    from hybridrl.models.qlora import quantize_4bit
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine.backend import BuiltinBackend
    from hybridrl.rollout.engine.kernel_choices import auto_dequantized_layers, dequantized_layer_bytes, layers_within
    from hybridrl.rollout.engine.weights import MATRICES, is_packed_4bit, resolve_weights

    assert [layers_within([10, 10, 10], budget) for budget in (5, 10, 25, 30, 99)] == [0, 1, 2, 3, 3]
    model = load_hf_model("tiny:qwen2").model.eval()
    by_hand = [sum(layer.get_submodule(path).weight.numel() * 4 for path in (  # float32 on CPU
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")) for layer in model.model.layers]
    assert dequantized_layer_bytes(model) == [0] * len(by_hand)
    quantize_4bit(model)
    assert dequantized_layer_bytes(model) == by_hand
    assert auto_dequantized_layers(model) == 0
    torch.manual_seed(3)
    base = load_hf_model("tiny:qwen2").model
    quantize_4bit(base)
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    monkeypatch.setattr(runner, "auto_dequantized_layers", lambda model: 1)
    for candidate in (model, adapted.eval()):
        packed = [[is_packed_4bit(getattr(layer, name)) for name in MATRICES]
                  for layer in resolve_weights(candidate, fuse_qkv=True, dequantize_layers=1).layers]
        assert not any(packed[0]) and all(all(layer) for layer in packed[1:])
        engines = {flag: BuiltinBackend(candidate, dequantize_4bit=flag) for flag in (False, True, "auto")}
        expected = engines[False].generate(PROMPTS, params)
        for flag, copied in ((True, len(by_hand)), ("auto", 1)):
            outputs = engines[flag].generate(PROMPTS, params)
            assert engines[flag].last_stats["dequantized_4bit_layers"] == copied
            for reference, generation in zip(expected, outputs):
                assert generation.token_ids == reference.token_ids
                torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(reference.logprobs),
                                           atol=1e-5, rtol=0)
        assert engines[False].last_stats["dequantized_4bit_layers"] == 0
    assert resolve_weights(model, fuse_qkv=True, dequantize_layers=len(by_hand)).layers[-1].qkv_weight is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantized_copies_on_cuda_give_the_per_step_tokens_with_cuda_graphs(monkeypatch):
    """On a GPU (bf16, NF4): the engine with every layer copied (CUDA graphs captured) and with one layer copied
    gives the per-step path's greedy tokens and log-probs."""
    needs_bitsandbytes()
    import hybridrl.rollout.engine.runner as runner
    from hybridrl.models.qlora import quantize_4bit
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.engine.backend import BuiltinBackend

    model = load_hf_model("tiny:qwen2").model.to("cuda", torch.bfloat16).eval()
    quantize_4bit(model)
    prompts, params = [[5, 9, 11, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6]], SamplingParams(max_new_tokens=24, temperature=0)
    per_step = BuiltinBackend(model, dequantize_4bit=False)
    expected = per_step.generate(prompts, params)
    for option, layers in ((True, None), ("auto", 1)):
        if layers is not None:
            monkeypatch.setattr(runner, "auto_dequantized_layers", lambda model: layers)
        engine = BuiltinBackend(model, dequantize_4bit=option)
        for _ in range(2):  # the second call replays kept graphs where they were captured
            outputs = engine.generate(prompts, params)
        assert (engine.last_stats["graphs_captured"] > 0) == (option is True)
        for reference, generation in zip(expected, outputs):
            assert generation.token_ids == reference.token_ids
            torch.testing.assert_close(torch.tensor(generation.logprobs), torch.tensor(reference.logprobs),
                                       atol=1e-3, rtol=0)
