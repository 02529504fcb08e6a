"""Cases for the sampling kernels (`hybridrl/rollout/kernels/sampling_kernels.py`), run by test_sampling_kernels.py inside
Triton's interpreter (a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from hybridrl.rollout.engine.decode_state import sample_and_record
from hybridrl.rollout.engine.sampling import SamplerSettings
from hybridrl.rollout.kernels.sampling_kernels import sampling_kernel_applies, triton_sample_and_record

# (rows, vocab, dtype, temperature): blocks of 8 (vocab 128), of 25 padded to 32 (vocab 1000), and the grpo-0.5b
# vocabulary (blocks of 128, 1187 of them) in bf16.
CASES = [(64, 128, torch.float32, 0.7), (48, 1000, torch.float32, 1.0), (6, 151936, torch.bfloat16, 1.0)]
MAX_NEW_TOKENS = 6


def make_state(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> dict:
    """Logits and a per-slot state with every kind of row: fresh, mid-response, at its last position, finished."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    logits[0, vocab // 3] = 30.0  # one peaked row
    gen_len = torch.randint(1, MAX_NEW_TOKENS, (rows,), generator=generator)
    gen_len[1] = MAX_NEW_TOKENS - 1  # its draw is the last one: done afterwards
    done = torch.zeros(rows, dtype=torch.bool)
    done[2] = True  # finished: nothing of its state may change
    return dict(logits=logits, uniform_table=torch.rand(rows, MAX_NEW_TOKENS, generator=generator), done=done,
                gen_len=gen_len, last_token=torch.randint(0, vocab, (rows,), generator=generator),
                out_tokens=torch.randint(0, vocab, (rows, MAX_NEW_TOKENS), generator=generator),
                out_logprobs=torch.randn(rows, MAX_NEW_TOKENS, generator=generator))


def run(function, state: dict, settings: SamplerSettings, stop_ids: torch.Tensor) -> dict:
    state = {name: tensor.clone() for name, tensor in state.items()}
    function(state["logits"], settings, state["uniform_table"], state["done"], state["gen_len"], state["last_token"],
             state["out_tokens"], state["out_logprobs"], stop_ids, MAX_NEW_TOKENS)
    return state


def check_kernels_match_the_reference() -> None:
    for rows, vocab, dtype, temperature in CASES:
        settings = SamplerSettings(temperature=temperature)
        state = make_state(rows, vocab, dtype, seed=vocab)
        assert sampling_kernel_applies(settings, vocab)
        expected = run(sample_and_record, state, settings, torch.tensor([-1]))
        # A stop id that some live row draws (and one nobody does): that row must end as "done".
        stop_ids = torch.tensor([int(expected["last_token"][3]), vocab + 5])
        expected = run(sample_and_record, state, settings, stop_ids)
        got = run(triton_sample_and_record, state, settings, stop_ids)
        for name in ("done", "gen_len", "last_token", "out_tokens"):
            assert torch.equal(got[name], expected[name]), (vocab, name, got[name], expected[name])
        torch.testing.assert_close(got["out_logprobs"], expected["out_logprobs"], atol=1e-5, rtol=0)
        assert bool(got["done"][3]) and bool(got["done"][1]) and bool(got["done"][2])
        assert torch.equal(got["out_tokens"][2], state["out_tokens"][2])  # the finished row kept its state
        changed = (got["out_tokens"] != state["out_tokens"]).any(-1)
        assert int(changed.sum()) >= rows // 2, "most live rows must have drawn a new token"
        print(f"vocab {vocab}: {rows} rows match")
    print("sampling kernels passed")
