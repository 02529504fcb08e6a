import pytest

from hybridrl.cli import main
from hybridrl.config.loading import load_config, parse_override
from hybridrl.config.schema import Config, ConfigError


def test_defaults_and_overrides_and_kwargs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temperature: 0.7\ntrainer:\n  total_steps: 5\n")
    config = load_config(path, ["rollout.temperature=0.9", "reward.functions=[{fn: exact_match, weight: 2}]"],
                         algorithm="rloo", trainer__seed=3)
    assert isinstance(config, Config)
    assert config.rollout.temperature == 0.9  # CLI beats YAML
    assert config.trainer.total_steps == 5
    assert config.trainer.seed == 3
    assert config.algorithm.name == "rloo"
    assert config.reward.functions[0].fn == "exact_match" and config.reward.functions[0].weight == 2.0


def test_python_api_shorthands():
    config = load_config(None, algorithm="rloo", use_gradient_checkpointing=True, device_mesh={"actor": [0]})
    assert config.algorithm.name == "rloo" and config.model.gradient_checkpointing
    assert config.trainer.device_mesh == {"actor": [0]}


def test_int_and_yaml11_exponent_are_accepted_for_float():
    assert load_config(None, ["actor.lr=1"]).actor.lr == 1.0
    assert load_config(None, ["actor.lr=2e-4"]).actor.lr == 2e-4
    assert load_config(None, ["trainer.resume=off"]).trainer.resume == "off"  # not the YAML boolean


@pytest.mark.parametrize("override, expected", [
    ("rollout.temprature=1", "Did you mean 'rollout.temperature'"),
    ("rolout.temperature=1", "Did you mean 'rollout'"),
    ("rollout.top_k=1.5", "rollout.top_k must be an integer"),
    ("trainer.total_steps=abc", "trainer.total_steps must be an integer"),
    ("algorithm.name=ppo2", "algorithm.name must be one of"),
    ("rollout.engine.fuse_gate_up=maybe", "rollout.engine.fuse_gate_up must be true or false or one of 'auto'; got 'maybe'"),
    ("rollout.engine.dequantize_4bit=maybe",
     "rollout.engine.dequantize_4bit must be true or false or one of 'auto'; got 'maybe'"),
    ("rollout.attention=sdpa", "'rollout.attention' is now 'rollout.engine.attention'; set that key instead."),
    ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1]"),
    ("rollout.temperature=-1", "rollout.temperature must be >= 0"),
    ("actor.mini_batch_size=7", "actor.mini_batch_size=7 must divide the rollout batch of 256"),
    ("algorithm.dual_clip=0.5", "algorithm.dual_clip must be > 1"),
    ("trainer.device=tpu", "trainer.device must be auto, cpu, cuda"),
    ("model.gradient_checkpointing=maybe", "model.gradient_checkpointing must be true or false"),
    ("logging.sinks=[console, mlflow]", "unknown sink 'mlflow'"),
])
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_group_algorithms_need_several_samples():
    with pytest.raises(ConfigError, match="num_samples_per_prompt must be at least 2"):
        load_config(None, ["rollout.num_samples_per_prompt=1", "algorithm.name=grpo"])
    assert load_config(None, ["rollout.num_samples_per_prompt=1", "algorithm.name=ppo"]).rollout_batch_size == 32


def test_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        parse_override("trainer.total_steps")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_cli_config_show_and_error_exit(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 7\n")
    assert main(["config", "show", str(path), "rollout.n_samples=3"]) == 2
    assert "unknown config key 'rollout.n_samples'" in capsys.readouterr().err
    assert main(["config", "show", str(path), "actor.lr=0.5"]) == 0
    shown = capsys.readouterr().out
    assert "total_steps: 7" in shown and "lr: 0.5" in shown


def test_config_show_explain_documents_every_key_and_loads_back(tmp_path, capsys):
    import dataclasses

    from hybridrl.config.explain import field_docs

    docs, config = field_docs(), Config()
    undocumented = [f"{s.name}.{f.name}" for s in dataclasses.fields(config)
                    for f in dataclasses.fields(getattr(config, s.name))
                    if not docs.get(type(getattr(config, s.name)).__name__, {}).get(f.name)]
    assert undocumented == [], "every config field needs a docstring under it"
    main(["config", "show", "--explain", "rollout.temperature=0.5"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    at = lines.index("  temperature: 0.5")
    assert lines[at - 1].startswith("  # "), "the key's documentation is written above it"
    path = tmp_path / "explained.yaml"
    path.write_text(text)
    assert load_config(path).to_dict() == load_config(None, ["rollout.temperature=0.5"]).to_dict()


@pytest.mark.parametrize("name", ["arithmetic_grpo", "arithmetic_ppo", "arithmetic_sft", "gsm8k_grpo",
                                  "gsm8k_grpo_1.5b_24gb", "gsm8k_grpo_7b_lora_24gb"])
def test_example_configs_load_and_validate(name):
    from pathlib import Path

    config = load_config(Path(__file__).parents[1] / "examples" / f"{name}.yaml")
    assert isinstance(config, Config)

