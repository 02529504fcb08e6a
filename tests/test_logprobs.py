"""Chunked log-probs/entropy equal the plain full-logits computation (values and gradients, float32)."""

import copy
import shutil

import pytest
import torch
from conftest import tiny_actor

from hybridrl.models.loading import compile_layers, enable_activation_checkpointing
from hybridrl.training.logprobs import response_logprobs, token_logprobs

TOL = dict(atol=2e-5, rtol=1e-5)  # float32: the only differences are summation order


def padded_batch(seed=0, rows=4, prompt=5, response=6, vocab=90):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left-padded prompt
    mask[1, -3:] = 0  # short response
    mask[2, :1] = 0
    mask[2, -1:] = 0
    ids[mask == 0] = 0
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0), response


def plain(model, ids, mask, positions, response, temperature):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -response - 1:-1]
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    real = mask[:, -response:].float()
    logp = logp_all.gather(-1, ids[:, -response:, None]).squeeze(-1) * real
    entropy = -(logp_all.exp() * logp_all).sum(-1) * real
    return logp, entropy


@pytest.mark.parametrize("pack", [False, True])
def test_chunked_equals_full_logits_values_and_gradients(pack):
    model, _ = tiny_actor()
    ids, mask, positions, response = padded_batch()
    weights = torch.randn(ids.shape[0], response, generator=torch.Generator().manual_seed(1))

    def grads_of(fn):
        model.zero_grad()
        logp, entropy = fn()
        ((logp * weights).sum() + 0.3 * (entropy * weights).sum()).backward()
        return logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    got = grads_of(lambda: response_logprobs(model, ids, mask, positions, response, temperature=0.7,
                                             with_entropy=True, chunk_tokens=5, pack=pack))
    want = grads_of(lambda: plain(model, ids, mask, positions, response, 0.7))
    assert torch.allclose(got[0], want[0], **TOL)
    assert torch.allclose(got[1], want[1], **TOL)
    assert got[1].abs().sum() > 0
    for mine, reference in zip(got[2], want[2]):
        assert torch.allclose(mine, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_tokens", [1, 2, 4, 16])  # with 4 chunks per weight product: 4, 2, 1 and 1 groups
def test_head_gradients_with_bias_and_no_entropy(chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(13, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=generator)
    logp, entropy = token_logprobs(hidden, head, targets, temperature=2.0, chunk_tokens=chunk_tokens, with_entropy=False)
    assert torch.equal(entropy, torch.zeros(13))
    logp.sum().backward()
    got = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    want_logp = torch.log_softmax(head(hidden) / 2.0, -1).gather(-1, targets[:, None]).squeeze(-1)
    want_logp.sum().backward()
    assert torch.allclose(logp, want_logp, **TOL)
    for mine, reference in zip(got, [hidden.grad, head.weight.grad, head.bias.grad]):
        assert torch.allclose(mine, reference, **TOL)


def test_frozen_head_gives_the_hidden_gradient_chunk_by_chunk():
    """A frozen head (LoRA) takes the one-chunk-at-a-time path of the backward; the hidden gradient is the same."""
    generator = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(11, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=generator)
    logp, entropy = token_logprobs(hidden, head, targets, temperature=1.0, chunk_tokens=3, with_entropy=True)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    got, hidden.grad = hidden.grad.clone(), None
    log_probs = torch.log_softmax(head(hidden), -1)
    want_logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    (want_logp.sum() - 0.5 * (log_probs.exp() * log_probs).sum()).backward()
    assert head.weight.grad is None and torch.allclose(got, hidden.grad, **TOL)


def test_greedy_temperature_zero_uses_unscaled_logits():
    model, _ = tiny_actor()
    ids, mask, positions, response = padded_batch(seed=3)
    with torch.no_grad():
        logp, _ = response_logprobs(model, ids, mask, positions, response, temperature=0.0)
        want, _ = plain(model, ids, mask, positions, response, 1.0)
    assert torch.allclose(logp, want, **TOL)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on CPU needs a C++ compiler")
def test_compiled_layers_give_the_eager_values_and_gradients_under_checkpointing():
    """`model.compile`: each decoder layer torch.compiled, with gradient checkpointing on (float32)."""
    eager, _ = tiny_actor()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        enable_activation_checkpointing(model)
        model.train()
    assert compile_layers(compiled) == 2
    ids, mask, positions, response = padded_batch(seed=5)
    results = []
    for model in (eager, compiled):
        logp, entropy = response_logprobs(model, ids, mask, positions, response, with_entropy=True, pack=True)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        results.append((logp.detach(), [p.grad for p in model.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], **TOL)
    for mine, reference in zip(results[1][1], results[0][1]):
        assert torch.allclose(mine, reference, atol=1e-5, rtol=1e-4)


def test_compile_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="model.compile=false"):
        compile_layers(torch.nn.Linear(3, 3))


def test_compile_without_a_cpu_compiler_says_so(monkeypatch):
    from hybridrl.models import loading as models

    monkeypatch.setattr(models.shutil, "which", lambda name: None)
    model, _ = tiny_actor()
    with pytest.raises(ValueError, match=r"model.compile needs a C\+\+ compiler on CPU .*model.compile=false"):
        compile_layers(model)


@pytest.mark.parametrize("padded", [False, True])
def test_host_token_count_gives_the_same_values(padded):
    """`real_tokens` (the mask's sum known on the host) only spares a sync: unpadded rows then run with no
    mask at all, padded ones as before; values and entropies are those of the plain computation."""
    model, _ = tiny_actor()
    ids, mask, positions, response = padded_batch(seed=7)
    if not padded:
        mask, positions = torch.ones_like(mask), torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        got = response_logprobs(model, ids, mask, positions, response, with_entropy=True,
                                real_tokens=int(mask.sum()))
        want = plain(model, ids, mask, positions, response, 1.0)
    assert torch.allclose(got[0], want[0], **TOL) and torch.allclose(got[1], want[1], **TOL)


def test_host_offloaded_weights_visit_the_device_only_inside_the_block():
    from hybridrl.models.loading import HostOffloadedWeights

    model, _ = tiny_actor()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    offloaded = HostOffloadedWeights(model, torch.device("cpu"))
    host_storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    with offloaded.on_device():  # fresh device copies (on this CPU-only machine: copies in CPU memory)
        assert all(p.data_ptr() != host_storage[name] for name, p in model.named_parameters())
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(p.data_ptr() == host_storage[name] for name, p in model.named_parameters())
