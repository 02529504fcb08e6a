"""Shared prompts (`shared_prompt.py`): the rows of one prompt in one pass give each row's own log-probs,
entropies and gradients (float32, every attention implementation that takes the mask)."""

import pytest
import torch
from conftest import tiny_actor, toy_prompts

from hybridrl.training.batch import RolloutBatch
from hybridrl.training.logprobs import response_logprobs
from hybridrl.training.shared_prompt import (
    GROUP_STRIDE,
    PADDING,
    PROMPT,
    PromptLayout,
    attention_mask_for,
    flex_kernel_options,
    pack_shared_prompts,
    visible,
)

TOL = dict(atol=2e-5, rtol=1e-5)


def grouped_batch(seed=0, prompt_width=6, response_width=5, vocab=90):
    """Rows 0, 2, 5 answer prompt A (4 tokens), rows 1, 4 prompt B (6 tokens), row 3 prompt C (1 token);
    responses of several lengths, one empty; rows deliberately interleaved."""
    generator = torch.Generator().manual_seed(seed)
    prompts = {7: torch.randint(3, vocab, (4,), generator=generator), 3: torch.randint(3, vocab, (6,), generator=generator),
               9: torch.randint(3, vocab, (1,), generator=generator)}
    prompt_ids = [7, 3, 7, 9, 3, 7]
    response_lengths = [5, 2, 0, 3, 5, 1]
    ids = torch.zeros(len(prompt_ids), prompt_width + response_width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, length) in enumerate(zip(prompt_ids, response_lengths)):
        tokens = prompts[prompt]
        ids[row, prompt_width - len(tokens):prompt_width] = tokens
        ids[row, prompt_width:prompt_width + length] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, prompt_width - len(tokens):prompt_width + length] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions, response_width, prompt_ids


def test_packing_layout_positions_and_targets():
    ids, mask, _, response, prompt_ids = grouped_batch()
    rows = pack_shared_prompts(ids, ids.shape[1] - response, PromptLayout.of(mask, ids.shape[1] - response, prompt_ids))
    assert rows.input_ids.shape == (3, 6 + 2 + 5)  # groups in order of first appearance: A, B, C; B is widest
    assert rows.segments[0].tolist() == [PROMPT] * 4 + [1] * 5 + [3] + [PADDING] * 3
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 4, 10, 11, 12]
    assert rows.segments[2].tolist()[:4] == [PROMPT, 1, 1, 1] and rows.position_ids[2].tolist()[:4] == [0, 1, 2, 3]
    # row 5's single response token is predicted at prompt A's last position, like row 0's first
    flat = rows.input_ids.flatten()
    assert rows.targets.tolist() == [ids[r, 6 + t].item() for r in (0, 5, 1, 4, 3) for t in range(mask[r, 6:].sum())]
    assert rows.logit_positions.tolist()[:7] == [3, 4, 5, 6, 7, 3, 13 + 6 - 1]
    assert flat[rows.logit_positions[0]] == ids[0, 5]  # the prompt's last token


def test_visibility_rules():
    ids, mask, _, response, prompt_ids = grouped_batch()
    rows = pack_shared_prompts(ids, ids.shape[1] - response, PromptLayout.of(mask, ids.shape[1] - response, prompt_ids))
    model, _ = tiny_actor()
    dense = attention_mask_for(model, rows)[0, 0]  # group A: prompt 0-3, response 1 at 4-8, response 3 at 9
    assert dense[9].tolist() == [True] * 4 + [False] * 5 + [True] + [False] * 3  # the prompt and itself, not response 1
    assert dense[6].tolist() == [True] * 7 + [False] * 6
    assert dense[2].tolist() == [True] * 3 + [False] * 10
    group_c = attention_mask_for(model, rows)[2, 0]  # prompt 0, response at 1-3, padding from 4
    assert group_c[-1, -1] and not group_c[-1, :-1].any()  # a padding query sees itself only


def shared_and_separate(model, implementation: str, device: str = "cpu", gradients: bool = True):
    """(log-probs, entropies, parameter gradients) with shared prompts under `implementation`, and with one
    row per sequence under sdpa."""
    ids, mask, positions, response, prompt_ids = (t.to(device) if torch.is_tensor(t) else t for t in grouped_batch())
    weights = torch.randn(ids.shape[0], response, generator=torch.Generator().manual_seed(1)).to(device)

    def run(implementation, **kwargs):
        model.config._attn_implementation = implementation
        model.zero_grad()
        with torch.set_grad_enabled(gradients):
            logp, entropy = response_logprobs(model, ids, mask, positions, response, temperature=0.7,
                                              with_entropy=True, chunk_tokens=5, **kwargs)
        if gradients:
            ((logp * weights).sum() + 0.3 * (entropy * weights).sum()).backward()
        return logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()] if gradients else []

    layout = PromptLayout.of(mask, ids.shape[1] - response, prompt_ids)
    return run(implementation, prompt_layout=layout), run("sdpa", pack=False)


def assert_same(shared, separate):
    assert torch.allclose(shared[0], separate[0], **TOL)
    assert torch.allclose(shared[1], separate[1], **TOL)
    assert (shared[0][2] == 0).all() and (shared[0][0] != 0).all()  # the empty response stays empty
    for mine, reference in zip(shared[2], separate[2]):
        assert torch.allclose(mine, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_shared_prompts_equal_separate_rows_values_and_gradients(implementation):
    model, _ = tiny_actor()
    assert_same(*shared_and_separate(model, implementation))


def test_flex_attention_block_mask_gives_the_same_values():
    """FlexAttention has no backward on CPU; its gradients are checked on CUDA below."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model, _ = tiny_actor()
    assert_same(*shared_and_separate(model, "flex_attention", gradients=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden_size", [64, 256])  # heads of 16 (torch's tiles) and of 64 (the tuned ones on Hopper)
def test_flex_attention_on_cuda_values_and_gradients(hidden_size):
    model, _ = tiny_actor(hidden_size=hidden_size)
    model.cuda()
    tuned = torch.cuda.get_device_capability() == (9, 0) and hidden_size == 256
    model.config._attn_implementation = "flex_attention"
    assert bool(flex_kernel_options(model, torch.device("cuda"))) == tuned
    assert_same(*shared_and_separate(model, "flex_attention", device="cuda"))


def test_tuned_flex_tiles_only_where_measured(monkeypatch):
    """Hopper with 64-dim heads gets the measured tiles; other GPUs, head sizes, sdpa and CPU get none."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    model, _ = tiny_actor(hidden_size=256)  # 4 heads of 64
    model.config._attn_implementation = "flex_attention"
    options = flex_kernel_options(model, cuda)["kernel_options"]
    assert options["fwd_BLOCK_M"] == 64 and options["bwd_BLOCK_M1"] == 32
    assert flex_kernel_options(model, torch.device("cpu")) == {}
    narrow, _ = tiny_actor(hidden_size=64)  # heads of 16
    narrow.config._attn_implementation = "flex_attention"
    assert flex_kernel_options(narrow, cuda) == {}
    model.config._attn_implementation = "sdpa"
    assert flex_kernel_options(model, cuda) == {}
    model.config._attn_implementation = "flex_attention"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert flex_kernel_options(model, cuda) == {}


def test_flash_attention_is_refused_with_the_fix():
    ids, mask, _, response, prompt_ids = grouped_batch()
    rows = pack_shared_prompts(ids, ids.shape[1] - response, PromptLayout.of(mask, ids.shape[1] - response, prompt_ids))
    model, _ = tiny_actor()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="model.attn_implementation=flex_attention"):
        attention_mask_for(model, rows)


def test_an_oversized_dense_mask_is_refused_with_the_fix(monkeypatch):
    from hybridrl.training import shared_prompt

    ids, mask, _, response, prompt_ids = grouped_batch()
    rows = pack_shared_prompts(ids, ids.shape[1] - response, PromptLayout.of(mask, ids.shape[1] - response, prompt_ids))
    model, _ = tiny_actor()
    from hybridrl.config.schema import ConfigError

    monkeypatch.setattr(shared_prompt, "DENSE_MASK_LIMIT", 3 * 13 * 13 - 1)  # one element short of these rows
    with pytest.raises(ConfigError, match="set model.attn_implementation=flex_attention"):  # a CLI user error
        attention_mask_for(model, rows)
    monkeypatch.setattr(shared_prompt, "DENSE_MASK_LIMIT", 3 * 13 * 13)
    assert attention_mask_for(model, rows).shape == (3, 1, 13, 13)


def test_heads_too_small_for_flex_attention_on_cuda_are_refused_with_the_fix():
    from hybridrl.training.shared_prompt import attention_problem

    model, _ = tiny_actor()  # heads of 8
    model.config._attn_implementation = "flex_attention"
    assert "at least 16 dimensions" in attention_problem(model, torch.device("cuda"))
    assert attention_problem(model, torch.device("cpu")) is None  # CPU FlexAttention takes them
    wider, _ = tiny_actor(hidden_size=64)  # heads of 16
    wider.config._attn_implementation = "flex_attention"
    assert attention_problem(wider, torch.device("cuda")) is None


def test_regrouping_keeps_a_prompts_rows_together_and_counts_the_prompt_once():
    from hybridrl.training.update import regroup_by_tokens

    ids, mask, positions, response, prompt_ids = grouped_batch()
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, position_ids=positions,
                         response_mask=mask[:, -response:].float(), sampler_logp=torch.zeros(6, response),
                         truncated=torch.zeros(6, dtype=torch.bool), prompt_index=torch.tensor(prompt_ids))
    micros = [torch.tensor([4, 0, 3]), torch.tensor([5, 1, 2])]
    # costs with the prompt once: A 4 + 5 + 0 + 1 = 10, B 6 + 2 + 5 = 13, C 1 + 3 = 4
    groups = regroup_by_tokens(batch, micros, max_tokens=14, share_prompts=True)
    assert sorted(sorted(g.tolist()) for g in groups) == [[0, 2, 3, 5], [1, 4]]
    assert len(regroup_by_tokens(batch, micros, max_tokens=14)) > 2  # per row, A's rows alone need 27 tokens


def test_ranks_get_whole_prompts_balanced_by_shared_tokens():
    """Data parallelism with shared prompts: each prompt's rows on one rank (else both ranks compute it);
    row sharding where prompts cannot be dealt out (fewer prompts than ranks, or unequal rows when required)."""
    from hybridrl.parallel.process_group import DistributedSetup
    from hybridrl.training.update import shard_by_prompt

    ids, mask, positions, response, prompt_ids = grouped_batch()  # A: rows 0, 2, 5; B: 1, 4; C: 3
    batch = RolloutBatch(input_ids=ids, attention_mask=mask, position_ids=positions,
                         response_mask=mask[:, -response:].float(), sampler_logp=torch.zeros(6, response),
                         truncated=torch.zeros(6, dtype=torch.bool), prompt_index=torch.tensor(prompt_ids))
    rows = torch.arange(6)
    shards = [shard_by_prompt(batch, rows, DistributedSetup(rank=rank, world_size=2)).tolist() for rank in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(6))
    # prompt counts per rank differ by at most one: B (13 tokens) + C (4) against A (10)
    assert sorted(map(sorted, shards)) == [[0, 2, 5], [1, 3, 4]]
    uneven = torch.tensor([0, 2, 5, 1])  # A's 3 rows and B's 1
    by_rows = [shard_by_prompt(batch, uneven, DistributedSetup(rank=rank, world_size=2), equal_rows=True).tolist()
               for rank in (0, 1)]
    assert [len(shard) for shard in by_rows] == [2, 2] and sorted(sum(by_rows, [])) == [0, 1, 2, 5]
    assert len(shard_by_prompt(batch, uneven, DistributedSetup(rank=0, world_size=2)).tolist()) in (1, 3)
    first_four = torch.arange(4)  # 3 prompts for 4 ranks: rows are dealt, one each
    four = [shard_by_prompt(batch, first_four, DistributedSetup(rank=rank, world_size=4)).tolist() for rank in range(4)]
    assert sorted(sum(four, [])) == [0, 1, 2, 3] and all(len(shard) == 1 for shard in four)
    one = torch.tensor([4, 0, 3])
    assert shard_by_prompt(batch, one, DistributedSetup()) is one


@pytest.mark.parametrize("extra", [{}, {"actor__reuse_logprobs_on_policy": False, "algorithm__kl_coef": 0.1},
                                   {"model__lora_rank": 4, "actor__reuse_logprobs_on_policy": False,
                                    "algorithm__kl_coef": 0.1}])
def test_training_with_shared_prompts_equals_separate_rows(tmp_path, extra, monkeypatch):
    """Same parameters after one update (float32, lr 1e-3, atol 1e-6), also through the old-policy and
    reference passes, and with LoRA (whose reference is the actor with its adapter disabled)."""
    from test_trainer import make_trainer

    from hybridrl.training import logprobs

    groups_per_pass = []
    packer = logprobs.pack_shared_prompts
    monkeypatch.setattr(logprobs, "pack_shared_prompts", lambda *args, **kwargs: groups_per_pass.append(
        len(set(args[2].prompt_ids)) / len(args[2].prompt_ids)) or packer(*args, **kwargs))
    params = []
    for share in (False, True):
        trainer = make_trainer(tmp_path / str(share), trainer__total_steps=1, actor__lr=1e-3, actor__max_grad_norm=0.0,
                               rollout__max_new_tokens=6, actor__max_tokens_per_micro_batch=60,
                               actor__share_prompt_tokens=share, **extra)
        history = trainer.train()
        params.append(torch.cat([p.detach().flatten() for p in trainer.parts.actor.parameters()]))
        assert history[-1]["actor/policy_loss"] == history[-1]["actor/policy_loss"]
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in make_trainer(
        tmp_path / "fresh", trainer__total_steps=1, **extra).parts.actor.parameters()]))  # the update moved the weights
    assert torch.allclose(params[0], params[1], atol=1e-6)
    assert len(groups_per_pass) >= (4 if extra else 2) and max(groups_per_pass) <= 0.25  # 4 samples per prompt


def test_mini_batches_hold_whole_prompts_with_shared_prompts():
    from hybridrl.training.update import mini_batches

    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    epochs = list(mini_batches(16, 8, 4, 2, torch.Generator().manual_seed(0), groups))
    assert len(epochs) == 4  # 2 epochs x 2 mini-batches
    for minis in (epochs[:2], epochs[2:]):
        rows = [torch.cat(micros).tolist() for micros in minis]
        assert sorted(sum(rows, [])) == list(range(16))  # every row once per epoch
        assert all(len(mini) == 8 and len({row // 4 for row in mini}) == 2 for mini in rows)  # 2 whole prompts each
    orders = {tuple(torch.cat(m).tolist()) for m in epochs}
    assert len(orders) > 1  # shuffled


def test_shared_prompts_with_several_mini_batches_share_every_prompt(tmp_path, monkeypatch):
    """Two optimizer steps per rollout: each mini-batch holds whole prompts, so each pass sees every prompt's
    4 samples together (rows dealt at random would leave ~1-2 per prompt and little to share)."""
    from test_trainer import make_trainer

    from hybridrl.training import logprobs

    rows_per_prompt = []
    packer = logprobs.pack_shared_prompts
    monkeypatch.setattr(logprobs, "pack_shared_prompts", lambda *args, **kwargs: rows_per_prompt.append(
        len(args[2].prompt_ids) / len(set(args[2].prompt_ids))) or packer(*args, **kwargs))
    trainer = make_trainer(tmp_path, trainer__total_steps=1, actor__mini_batch_size=16, actor__share_prompt_tokens=True,
                           rollout__max_new_tokens=6, actor__max_tokens_per_micro_batch=60)
    trainer.train()
    assert rows_per_prompt and min(rows_per_prompt) == 4  # FAST: 4 samples per prompt, 8 prompts, 32 rows


def test_flash_attention_with_shared_prompts_is_refused_in_the_config():
    from hybridrl.config.loading import load_config
    from hybridrl.config.schema import ConfigError

    with pytest.raises(ConfigError, match="actor.share_prompt_tokens needs an attention that takes a mask"):
        load_config(None, ["actor.share_prompt_tokens=true", "model.attn_implementation=flash_attention_2"])


def test_rows_pad_to_a_multiple_and_short_groups_share_a_row():
    """Rows 16 wide (13 rounded up to 8s): A (10 tokens) then C (4) in row 0, B (13) in row 1."""
    ids, mask, _, response, prompt_ids = grouped_batch()
    rows = pack_shared_prompts(ids, ids.shape[1] - response, PromptLayout.of(mask, ids.shape[1] - response, prompt_ids),
                               multiple=8)
    second = GROUP_STRIDE  # the second group of a row
    assert rows.input_ids.shape == (2, 16)
    assert rows.segments[0].tolist() == [PROMPT] * 4 + [1] * 5 + [3] + [second] + [second + 1] * 3 + [PADDING] * 2
    assert rows.position_ids[0].tolist()[10:] == [0, 1, 2, 3, 14, 15]  # C's prompt and response, then padding
    assert rows.segments[1].tolist() == [PROMPT] * 6 + [1] * 2 + [2] * 5 + [PADDING] * 3
    assert rows.position_ids[1].tolist()[13:] == [13, 14, 15]
    dense = visible(rows.segments[0][:, None], rows.segments[0][None, :], torch.arange(16)[:, None], torch.arange(16)[None, :])
    assert dense[12].tolist() == [False] * 10 + [True, True, True] + [False] * 3  # C's response: C's prompt, itself
    assert dense[10].tolist() == [False] * 10 + [True] + [False] * 5  # C's prompt sees nothing of A


def test_groups_sharing_a_row_give_the_values_and_gradients_of_separate_rows(monkeypatch):
    from hybridrl.training import logprobs

    packer = logprobs.pack_shared_prompts
    monkeypatch.setattr(logprobs, "pack_shared_prompts", lambda *args, **kwargs: packer(*args, **{**kwargs, "multiple": 8}))
    model, _ = tiny_actor()
    assert_same(*shared_and_separate(model, "sdpa"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_step_with_flex_compiled_layers_and_checkpointing_on_cuda(tmp_path):
    """The path grpo_step.py's shared mode takes: FlexAttention block masks through torch.compiled decoder
    layers under gradient checkpointing, one update; parameters as with separate rows (float32, 1e-4)."""
    from test_trainer import FAST

    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    def varied(prompts, completions, **columns):  # differs within a group almost surely, so advantages are not 0
        return [float(sum(map(ord, c)) % 5) for c in completions]

    params = []
    for share in (False, True):
        actor = tiny_actor(hidden_size=64)
        initial = torch.cat([p.detach().flatten() for p in actor.model.parameters()]).cuda()
        actor.model.config._attn_implementation = "flex_attention"
        dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
        trainer = RLTrainer(actor=actor, reward_fn=varied, dataset=dataset, **{
            **FAST, "trainer__device": "cuda", "model__dtype": "float32", "trainer__output_dir": str(tmp_path / str(share)),
            "trainer__total_steps": 1, "actor__lr": 1e-3, "actor__max_grad_norm": 0.0, "rollout__max_new_tokens": 6,
            "actor__max_tokens_per_micro_batch": 60, "model__compile": True,
            "model__gradient_checkpointing": True, "actor__share_prompt_tokens": share})
        trainer.train()
        params.append(torch.cat([p.detach().flatten() for p in trainer.parts.actor.parameters()]))
        assert (params[-1] - initial).abs().max() > 1e-4  # the update moved the weights
    assert torch.allclose(params[0], params[1], atol=1e-4)


def test_compiled_layers_take_block_masks_without_recompiling():
    """`model.compile` with FlexAttention (forward; CPU has no FlexAttention backward): the values of separate
    rows, and a new block mask (another grouping, new segments) reuses the compiled layer."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import torch._dynamo

    from hybridrl.models.loading import compile_layers

    model, _ = tiny_actor()
    compile_layers(model)
    ids, mask, positions, response, prompt_ids = grouped_batch()
    torch._dynamo.utils.counters.clear()
    model.config._attn_implementation = "flex_attention"
    results = []
    # the second grouping is wrong for these rows (row 1 has another prompt); it only brings other segments
    for grouping in (prompt_ids, [7, 7, 7, 9, 3, 7]):
        with torch.no_grad():
            results.append(response_logprobs(model, ids, mask, positions, response,
                                             prompt_layout=PromptLayout.of(mask, ids.shape[1] - response, grouping))[0])
    frames = torch._dynamo.utils.counters["frames"]["total"]
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        separate, _ = response_logprobs(model, ids, mask, positions, response, pack=False)
    assert frames == 1
    assert torch.allclose(results[0], separate, **TOL)
    assert not torch.allclose(results[1][1], separate[1])  # the mask did change


def test_an_actor_loaded_with_flash_attention_is_refused_before_training(tmp_path):
    """`model.attn_implementation=auto` picks flash-attention where installed: the trainer stops at set-up with
    one sentence, not in the first update after a rollout."""
    from test_trainer import FAST, contains_seven

    from hybridrl.config.schema import ConfigError
    from hybridrl.data.datasets import PromptDataset
    from hybridrl.training.trainer import RLTrainer

    actor = tiny_actor()
    actor.model.config._attn_implementation = "flash_attention_2"
    dataset = PromptDataset(toy_prompts(), actor.tokenizer, max_length=16)
    with pytest.raises(ConfigError, match="set model.attn_implementation=flex_attention"):
        RLTrainer(actor=actor, reward_fn=contains_seven, dataset=dataset, actor__share_prompt_tokens=True,
                  **{**FAST, "trainer__output_dir": str(tmp_path)})


def test_flex_kernel_options_reach_the_attention_function(monkeypatch):
    """The tuned tiles travel as `kernel_options` through transformers' keyword arguments to every layer's
    attention call (checked with an attention function registered under a flex name that records them)."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    import hybridrl.training.logprobs as logprobs

    seen = []

    def recording_flex(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("flex_recording", recording_flex)
    monkeypatch.setattr(logprobs, "flex_kernel_options", lambda model, device: {"kernel_options": {"marker": 7}})
    model, _ = tiny_actor()
    model.config._attn_implementation = "flex_recording"
    ids, mask, positions, response, prompt_ids = grouped_batch()
    layout = PromptLayout.of(mask, ids.shape[1] - response, prompt_ids)
    with torch.no_grad():
        response_logprobs(model, ids, mask, positions, response, prompt_layout=layout)
    assert seen == [{"marker": 7}] * model.config.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_block_mask_equals_eager_for_any_shape():
    """The trainer's compiled block-mask build equals the eager one, and micro-batches of new shapes reuse
    the compiled code (dynamic shapes) rather than recompiling each time."""
    from hybridrl.training.shared_prompt import block_mask_builder, shared_block_mask

    def segments(rows, length, seed):  # two groups per row: a prompt, then responses 1..3, then padding
        generator = torch.Generator().manual_seed(seed)
        out = torch.full((rows, length), PADDING, dtype=torch.long)
        for row in range(rows):
            cuts = sorted(torch.randint(1, length - 1, (7,), generator=generator).tolist())
            for i, (a, b) in enumerate(zip([0] + cuts, cuts + [length - 3])):
                out[row, a:b] = (i // 4) * GROUP_STRIDE + i % 4
        return out.cuda()

    build = block_mask_builder(torch.device("cuda"))
    frames = []
    for rows, length, seed in ((3, 384, 0), (5, 640, 1), (2, 896, 2)):
        layout = segments(rows, length, seed)
        compiled, eager = build(layout), shared_block_mask(layout)
        assert torch.equal(compiled.to_dense(), eager.to_dense())
        assert torch.equal(compiled.full_kv_num_blocks, eager.full_kv_num_blocks)
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[2] == frames[1], "the third shape recompiled the block-mask build"
