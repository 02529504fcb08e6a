"""End-to-end trainer behaviour on tiny CPU models: it learns, it is deterministic, it fails clearly."""

import gc
import math
import shutil

import pytest
import torch
from conftest import contains_seven, tiny_actor, toy_prompts

from hybridrl import algorithms
from hybridrl.config.schema import ConfigError
from hybridrl.data.datasets import PromptDataset
from hybridrl.models.loading import decoder_layers
from hybridrl.rewards import RewardError
from hybridrl.training.trainer import RLTrainer
from hybridrl.training.update import TrainingError

FAST = dict(rollout__max_new_tokens=4, rollout__num_samples_per_prompt=4, trainer__prompts_per_step=8,
            actor__micro_batch_size=16, trainer__device="cpu", logging__sinks=["jsonl"], trainer__save_model=False)


def make_trainer(tmp_path, reward=contains_seven, **overrides):
    actor = tiny_actor()
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    settings = {**FAST, "trainer__output_dir": str(tmp_path), **overrides}
    return RLTrainer(actor=actor, reward_fn=reward, dataset=dataset, **settings)


def test_gspo_with_rollout_correction_trains_and_logs_the_weights(tmp_path):
    trainer = make_trainer(tmp_path, trainer__total_steps=2, actor__lr=1e-3, algorithm__ratio_level="sequence",
                           algorithm__clip_ratio_low=3e-4, algorithm__clip_ratio_high=4e-4,
                           algorithm__rollout_correction_cap=2.0)
    history = trainer.train()
    # float32 on CPU: the sampler's log-probs equal the trainer's (1e-7), so the weights are 1 and none is capped.
    assert all(abs(row["actor/rollout_correction_weight"] - 1.0) < 1e-4 for row in history)
    assert all(row["actor/rollout_correction_capped"] == 0.0 for row in history)


def test_mask_truncated_leaves_cut_responses_out_of_the_loss_and_its_normaliser(tmp_path):
    from hybridrl.rollout.base import Generation
    from hybridrl.training.batch import build_rollout_batch
    from hybridrl.training.update import mini_batch_normalizers

    trainer = make_trainer(tmp_path, algorithm__mask_truncated=True, rollout__num_samples_per_prompt=2)
    generations = [Generation(0, [5, 6, 7], [-1.0] * 3, "length"), Generation(0, [5, 2], [-1.0] * 2, "stop"),
                   Generation(1, [8], [-1.0], "stop"), Generation(1, [9, 9, 9], [-1.0] * 3, "length")]
    batch = build_rollout_batch([[1, 2], [3]], generations, pad_token_id=0, max_new_tokens=3,
                                sampling=trainer.sampling_params())  # 2 samples per prompt
    batch.scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    trainer.compute_advantages(batch)
    assert batch.loss_mask.tolist() == [[0, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]]
    assert batch.advantages[0, 0] > 0  # the cut answer still sets its group's baseline
    assert mini_batch_normalizers(batch, torch.arange(4), batch.loss_mask)["num_tokens"] == 3
    assert mini_batch_normalizers(batch, torch.tensor([0, 3]), batch.loss_mask)["num_tokens"] == 1  # none left: 1
    # Through the trainer: runs, and a step whose responses are all cut changes nothing.
    run = make_trainer(tmp_path / "run", trainer__total_steps=1, algorithm__mask_truncated=True,
                       rollout__max_new_tokens=1, actor__lr=1e-2)
    before = [p.detach().clone() for p in run.parts.actor.parameters()]
    history = run.train()
    assert history[-1]["rollout/truncation_rate"] == 1.0 and history[-1]["actor/policy_loss"] == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, run.parts.actor.parameters()))
    with pytest.raises(ConfigError, match="rollout.ignore_eos=true cuts every one of them"):
        make_trainer(tmp_path, algorithm__mask_truncated=True, rollout__ignore_eos=True)


def test_drop_uniform_groups_leaves_groups_that_scored_alike_out_of_the_loss(tmp_path):
    from hybridrl.rollout.base import Generation
    from hybridrl.training.batch import build_rollout_batch

    generations = [Generation(0, [5, 6, 7], [-1.0] * 3, "length"), Generation(0, [5, 2], [-1.0] * 2, "stop"),
                   Generation(1, [8], [-1.0], "stop"), Generation(1, [9, 9, 9], [-1.0] * 3, "length")]
    for extra, expected in (({}, [[1, 1, 1], [1, 1, 0], [0, 0, 0], [0, 0, 0]]),
                            ({"algorithm__mask_truncated": True}, [[0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]])):
        trainer = make_trainer(tmp_path, algorithm__drop_uniform_groups=True, rollout__num_samples_per_prompt=2, **extra)
        batch = build_rollout_batch([[1, 2], [3]], generations, pad_token_id=0, max_new_tokens=3,
                                    sampling=trainer.sampling_params())  # 2 samples per prompt
        batch.scores = torch.tensor([1.0, 0.0, 1.0, 1.0])  # prompt 1's two samples scored alike
        trainer.compute_advantages(batch)
        assert batch.loss_mask.tolist() == expected
    history = make_trainer(tmp_path / "run", trainer__total_steps=1, algorithm__drop_uniform_groups=True).train()
    assert 0.0 <= history[-1]["reward/uniform_group_fraction"] <= 1.0
    with pytest.raises(ConfigError, match="needs rollout.num_samples_per_prompt > 1"):
        make_trainer(tmp_path, algorithm__drop_uniform_groups=True, rollout__num_samples_per_prompt=1)


def test_two_steps_change_parameters(tmp_path):
    trainer = make_trainer(tmp_path, trainer__total_steps=2, actor__lr=1e-3)
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    history = trainer.train()
    assert len(history) == 2
    changed = [not torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters())]
    assert all(changed), "every trainable tensor should move after two updates"
    for key in ("reward/mean", "actor/policy_loss", "actor/grad_norm", "actor/entropy", "actor/clipfrac",
                "rollout/response_length_mean", "rollout/truncation_rate", "rollout/logprob_diff_max",
                "perf/tokens_per_s", "timing/step_s", "reward/contains_seven"):
        assert key in history[-1] and math.isfinite(history[-1][key]), key
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_the_builtin_engine_splits_the_rollout_time_and_hf_does_not(tmp_path):
    """`timing/rollout_{before_decode,decode,after_decode}_s` from the engine's timeline: three stretches that fit
    inside the rollout phase; the hf backend reports none."""
    history = make_trainer(tmp_path / "builtin", trainer__total_steps=1, rollout__backend="builtin").train()
    phases = [history[-1][f"timing/rollout_{name}_s"] for name in ("before_decode", "decode", "after_decode")]
    assert all(seconds >= 0 for seconds in phases) and phases[1] > 0
    assert sum(phases) <= history[-1]["timing/rollout_s"]
    history = make_trainer(tmp_path / "hf", trainer__total_steps=1, rollout__backend="hf").train()
    assert not any(key.startswith("timing/rollout_") and key != "timing/rollout_s" for key in history[-1])


def mean_reward(history, steps):
    return sum(row["reward/mean"] for row in steps(history)) / len(steps(history))


@pytest.mark.parametrize("algorithm, extra", [
    ("grpo", {}),
    ("rloo", {}),
    ("ppo", {"critic__lr": 1e-2, "actor__ppo_epochs": 2, "actor__mini_batch_size": 16}),
])
def test_reward_rises(tmp_path, algorithm, extra):
    trainer = make_trainer(tmp_path, algorithm=algorithm, trainer__total_steps=16, actor__lr=1e-2, **extra)
    history = trainer.train()
    first = mean_reward(history, lambda h: h[:4])
    last = mean_reward(history, lambda h: h[-4:])
    assert last > first + 0.2, f"{algorithm}: reward {first:.2f} -> {last:.2f} did not rise"


def test_same_seed_same_numbers(tmp_path):
    runs = []
    for name in ("a", "b"):
        history = make_trainer(tmp_path / name, trainer__total_steps=3, actor__lr=1e-3,
                               algorithm__kl_coef=0.1).train()
        runs.append([{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in history])
    assert runs[0] == runs[1]
    assert "actor/kl" in runs[0][-1]


def test_micro_batches_match_one_batch(tmp_path):
    """Gradient accumulation over micro-batches gives the same update as one big batch, and the same logged
    token means (entropy, KL, clip fraction: weighted by each micro-batch's tokens, not averaged per micro-batch)."""
    params, logged = [], []
    for micro in (32, 4):
        trainer = make_trainer(tmp_path / str(micro), trainer__total_steps=2, actor__lr=1e-3, algorithm__kl_coef=0.1,
                               actor__micro_batch_size=micro, actor__max_grad_norm=0.0)
        logged.append(trainer.train())
        params.append(torch.cat([p.detach().flatten() for p in trainer.parts.actor.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6)
    assert logged[0][-1]["actor/kl"] > 0
    for key in ("actor/entropy", "actor/kl", "actor/clipfrac", "actor/approx_kl"):
        assert logged[1][-1][key] == pytest.approx(logged[0][-1][key], rel=1e-4, abs=1e-7), key


def test_eval_runs_before_and_after(tmp_path):
    actor = tiny_actor()
    data = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, reward_fn="exact_match", dataset=data, eval_dataset=data,
                        trainer__total_steps=2, trainer__eval_every=1, trainer__output_dir=str(tmp_path),
                        **{k: v for k, v in FAST.items() if k != "trainer__output_dir"})
    history = trainer.train()
    assert [row["step"] for row in history if "eval/accuracy" in row] == [0, 1, 2]


def test_eval_accuracy_is_exact_agreement_not_a_positive_reward(tmp_path):
    """A partial-credit reward is positive for every answer; eval/accuracy still counts exact answers only, and
    each reward's mean is reported beside it. Without an answer column there is no accuracy to report."""
    actor = tiny_actor()
    rows = toy_prompts(16)
    rows[0]["answer"] = "x"  # no completion of the tiny model's (at most 4 characters of digits) equals it
    data = PromptDataset(rows, actor.tokenizer, max_length=16)
    completions = []

    def partial_credit(prompts, completions_, answer, **columns):
        completions.extend(completions_)
        return [1.0 if c.strip() == a else 0.5 for c, a in zip(completions_, answer)]

    trainer = RLTrainer(actor=actor, reward_fn=partial_credit, dataset=data, eval_dataset=data,
                        trainer__output_dir=str(tmp_path), **{k: v for k, v in FAST.items() if k != "trainer__output_dir"})
    metrics = trainer.evaluate()
    exact = [c.strip() == row["answer"] for c, row in zip(completions, rows)]
    assert metrics["eval/accuracy"] == pytest.approx(sum(exact) / len(rows))
    assert metrics["eval/reward/partial_credit"] == pytest.approx((sum(exact) + 0.5 * (len(rows) - sum(exact))) / len(rows))
    assert metrics["eval/accuracy"] < 1.0 and metrics["eval/reward_mean"] >= 0.5

    unanswered = PromptDataset([{"prompt": row["prompt"]} for row in rows], actor.tokenizer, max_length=16)
    trainer = RLTrainer(actor=actor, reward_fn=contains_seven, dataset=data, eval_dataset=unanswered,
                        trainer__output_dir=str(tmp_path / "b"),
                        **{k: v for k, v in FAST.items() if k != "trainer__output_dir"})
    assert "eval/accuracy" not in trainer.evaluate()


def test_a_reward_that_raises_mid_run_saves_the_finished_steps_and_resume_matches(tmp_path):
    """The user's reward fails at step 3: steps 1-2 are checkpointed first (step 3 rolled back), and after the fix
    the resumed run's steps 3-4 are exactly those of a run that never failed."""
    calls = {"n": 0}

    def fails_at_step_three(prompts, completions, **columns):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("a bug in the reward")
        return contains_seven(prompts, completions)

    settings = dict(trainer__total_steps=4, trainer__save_every=0)
    clean = make_trainer(tmp_path / "clean", reward=contains_seven, **settings).train()
    with pytest.raises(RewardError, match=r"a bug in the reward.* The 2 finished step\(s\) are saved in .*step_0*2"):
        make_trainer(tmp_path / "run", reward=fails_at_step_three, **settings).train()
    resumed = make_trainer(tmp_path / "run", reward=contains_seven, **settings).train()
    keys = ("reward/mean", "actor/policy_loss", "actor/grad_norm", "actor/entropy")
    assert [[row.get(k) for k in keys] for row in resumed] == [[row.get(k) for k in keys] for row in clean]
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]


def test_the_banner_names_the_model_actually_loaded(tmp_path):
    from hybridrl.models.loading import load_hf_model, save_hf_model

    actor = tiny_actor()
    save_hf_model(actor.model, actor.tokenizer, tmp_path / "local_model")
    loaded = load_hf_model(str(tmp_path / "local_model"))
    trainer = RLTrainer(actor=loaded, reward_fn=contains_seven, dataset=PromptDataset(toy_prompts(), loaded.tokenizer,
                        max_length=16), trainer__output_dir=str(tmp_path / "run"),
                        **{k: v for k, v in FAST.items() if k != "trainer__output_dir"})
    banner = trainer.describe()
    assert f"with {tmp_path / 'local_model'} (" in banner and "tiny:llama" not in banner


def test_reward_that_raises_names_function_and_sample(tmp_path):
    def picky(prompts, completions, **columns):
        if any(p.startswith("3+") for p in prompts):
            raise ValueError("cannot score threes")
        return [0.0] * len(completions)

    trainer = make_trainer(tmp_path, reward=picky, trainer__total_steps=1)
    with pytest.raises(RewardError, match=r"'picky' raised ValueError: cannot score threes \(at .*\) on sample \d+") as info:
        trainer.train()
    index = int(str(info.value).split("on sample ")[1].split()[0])
    assert index < 32


@pytest.mark.parametrize("lean", [False, True])  # torch AdamW; LeanAdamW (offloaded moments), whose skip is a device flag
def test_nan_loss_stops_with_weights_intact(tmp_path, monkeypatch, lean):
    trainer = make_trainer(tmp_path, trainer__total_steps=2, actor__optimizer_offload=lean)
    before = [p.detach().clone() for p in trainer.parts.actor.parameters()]
    real = algorithms.policy_loss
    monkeypatch.setattr(algorithms, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    with pytest.raises(TrainingError, match="actor loss became nan at step 1.*weights are unchanged"):
        trainer.train()
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.parts.actor.parameters()))
    optimizer = trainer.parts.actor_optimizer
    assert type(optimizer).__name__ == ("LeanAdamW" if lean else "AdamW")
    for state in optimizer.state.values():  # moments untouched and, for LeanAdamW, the step count taken back
        assert int(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_invisible_device_is_refused_before_loading(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        make_trainer(tmp_path, trainer__device="cuda:0")


def test_missing_reward_and_data_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no reward is configured"):
        RLTrainer(trainer__device="cpu", data__train_path=str(tmp_path / "x.jsonl"))
    with pytest.raises(Exception, match="does not exist|not found|no such"):
        RLTrainer(trainer__device="cpu", data__train_path=str(tmp_path / "x.jsonl"),
                  reward__functions=[{"fn": "exact_match"}], model__path="tiny:llama")


def test_a_missing_relative_model_directory_is_named_not_sent_to_the_hub(tmp_path, monkeypatch):
    from hybridrl.models.loading import ModelError, load_hf_model

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="model path 'runs/demo/sft/model' does not exist; check model.path"):
        load_hf_model("runs/demo/sft/model", device="cpu")


def test_on_policy_reuse_of_update_logprobs_matches_the_extra_pass(tmp_path):
    """One optimizer step per rollout: taking the old log-probs from the update's own forward (skipping the
    no-grad pass) gives the same update and the same sampler-mismatch metric as computing them first."""
    results = []
    for reuse in (True, False):
        trainer = make_trainer(tmp_path / str(reuse), trainer__total_steps=2, actor__lr=1e-3,
                               actor__reuse_logprobs_on_policy=reuse)
        assert trainer.reuses_update_logprobs(32) is reuse
        history = trainer.train()
        results.append((history, [p.detach().clone() for p in trainer.parts.actor.parameters()]))
    (reused, params_reused), (computed, params_computed) = results
    for a, b in zip(params_reused, params_computed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for key in ("actor/policy_loss", "actor/grad_norm", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
        assert reused[-1][key] == pytest.approx(computed[-1][key], rel=1e-5, abs=1e-7), key
    assert reused[-1]["actor/clipfrac"] == 0.0


def test_old_logprob_pass_still_runs_when_needed(tmp_path):
    several_steps = make_trainer(tmp_path / "a", actor__ppo_epochs=2)
    assert not several_steps.reuses_update_logprobs(32)
    mini_batches = make_trainer(tmp_path / "b", actor__mini_batch_size=16)
    assert not mini_batches.reuses_update_logprobs(32)


def test_train_prints_what_it_is_about_to_do(tmp_path, capsys):
    trainer = make_trainer(tmp_path, trainer__total_steps=1, trainer__save_model=True)
    trainer.train()
    out = capsys.readouterr().out
    assert out.startswith("hybridrl: grpo with ")
    assert "on cpu; rollout: hf; 8 prompts x 4 samples per step, 1 steps" in out
    assert f"saved the trained model to {tmp_path / 'model'}" in out
    assert "compiles" not in out  # nothing compiles on CPU by default
    compiled = make_trainer(tmp_path, model__compile=True).describe()
    assert compiled.endswith("; the first step compiles the model's layers (a minute or so; later steps reuse it)")


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on CPU needs a C++ compiler")
def test_compiled_layers_train_like_eager_ones(tmp_path):
    """`model.compile=true` end to end: the trainer compiles the actor's layers and one step lands on the
    parameters the eager trainer reaches (float32, same seed)."""
    results = []
    for compiled in (False, True):
        trainer = make_trainer(tmp_path / str(compiled), trainer__total_steps=1, actor__lr=1e-3,
                               model__compile=compiled)
        trainer.train()
        layers = decoder_layers(trainer.parts.actor)
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        results.append([p.detach().clone() for p in trainer.parts.actor.parameters()])
    for eager, compiled in zip(*results):
        assert torch.allclose(eager, compiled, atol=1e-5)


def test_reference_offload_trains_like_a_resident_reference(tmp_path):
    """`model.reference_offload`: the reference's parameters sit in host memory between passes and the run
    (with a KL term, so the reference matters) lands on the same parameters and KL as without it."""
    results = []
    for offload in (False, True):
        trainer = make_trainer(tmp_path / str(offload), trainer__total_steps=2, actor__lr=1e-3,
                               algorithm__kl_coef=0.5, model__reference_offload=offload)
        history = trainer.train()
        assert (trainer.parts.reference_offload is not None) == offload
        results.append(([p.detach().clone() for p in trainer.parts.actor.parameters()], history[-1]["actor/kl"]))
    for resident, offloaded in zip(results[0][0], results[1][0]):
        assert torch.equal(resident, offloaded)
    assert results[0][1] == results[1][1] and results[0][1] > 0


def test_reference_offload_with_several_processes_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.reference_offload works with one process only"):
        make_trainer(tmp_path, model__reference_offload=True, trainer__num_gpus=2)


def test_the_first_step_freezes_what_warm_up_built_and_later_steps_do_not(tmp_path, monkeypatch):
    from hybridrl.training import trainer as trainer_module

    calls = []
    freeze = trainer_module.freeze_warm_up_objects
    monkeypatch.setattr(trainer_module, "freeze_warm_up_objects", lambda: calls.append(1) or freeze())
    trainer = make_trainer(tmp_path, trainer__total_steps=2)
    gc.unfreeze()
    trainer.step()
    assert calls == [1] and gc.get_freeze_count() > 0, "the first step moves what is alive out of full collections"
    trainer.step()
    assert calls == [1], "only once: what later steps allocate stays collectable"


def test_freezing_collects_the_young_generations_only(monkeypatch):
    """A full collection walks every object the imports made (a large share of a short first step); the young
    generations hold what the step just left dead."""
    import weakref

    from hybridrl.training import trainer as trainer_module

    class Cycle:
        pass

    dead = Cycle()
    dead.self = dead
    gone = weakref.ref(dead)
    del dead
    generations, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or collect(generation))
    gc.unfreeze()
    trainer_module.freeze_warm_up_objects()
    assert generations == [1], "no full collection"
    assert gone() is None, "the cycle the step left dead was collected, not frozen"
    assert gc.get_freeze_count() > 0


def test_activation_checkpointing_is_switched_on_without_a_deprecation_warning():
    """transformers 5.2x renamed `gradient_checkpointing_enable`; the old name warned on every run."""
    import warnings

    from hybridrl.models.loading import enable_activation_checkpointing

    model = tiny_actor().model
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
    assert any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def test_train_refuses_an_output_directory_another_run_holds(tmp_path):
    from hybridrl.checkpoint.run_lock import RunLockError, output_dir_lock

    trainer = make_trainer(tmp_path, trainer__total_steps=1)
    with output_dir_lock(tmp_path), pytest.raises(RunLockError, match="is in use by another hybridrl run"):
        trainer.train()
    assert trainer.step_count == 0 and not (tmp_path / "metrics.jsonl").read_text().strip()
