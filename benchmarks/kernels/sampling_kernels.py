"""The decode step's sampler on the grpo-0.5b shape (512 rows x 151936 vocabulary, bf16 logits, temperature 1): the
compiled PyTorch `sample_and_record` against the two Triton kernels (`hybridrl/rollout/kernels/sampling_kernels.py`)
with several launch configurations of the stats kernel (its module constants `BLOCK_ELEMENTS` and `NUM_WARPS`, set
in turn), each in a CUDA graph over 8 distinct logits tensors (so the logits come from HBM, as after the LM head's
155 MB write). Checks that the kernels draw the same tokens first.

    python -m benchmarks.kernels.sampling_kernels

Prints µs per step and the bandwidth of one read of the logits; the floor is that read at --bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks.kernels.cuda_timing import graph_time_us
from hybridrl.rollout.engine.decode_state import DecodeState, compiled_sample_and_record
from hybridrl.rollout.engine.sampling import SamplerSettings
from hybridrl.rollout.kernels import sampling_kernels
from hybridrl.rollout.kernels.sampling_kernels import triton_sample_and_record

ROWS, VOCAB, RESPONSE, COPIES = 512, 151936, 256, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s of HBM (DESIGN.md's H200 figure)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/sampling_kernels.py needs a CUDA GPU.")
    torch.manual_seed(0)
    logits = [(torch.randn(ROWS, VOCAB, device="cuda") * 3).to(torch.bfloat16) for _ in range(COPIES)]
    settings, compiled = SamplerSettings(temperature=1.0), compiled_sample_and_record()
    state = DecodeState(ROWS, RESPONSE, [], "cuda")
    state.uniform_table.uniform_()

    def step(sampler):
        state.gen_len.fill_(3)  # each call below draws the next position of every row
        state.done.zero_()
        for scores in logits:
            sampler(scores, settings, state.uniform_table, state.done, state.gen_len, state.last_token,
                    state.out_tokens, state.out_logprobs, state.stop_ids, state.max_new_tokens)

    step(compiled)
    reference = state.out_tokens[:, 3 : 3 + COPIES].clone()
    step(triton_sample_and_record)
    agree = (state.out_tokens[:, 3 : 3 + COPIES] == reference).float().mean().item()
    print(f"kernels draw the PyTorch sampler's token in {100 * agree:.2f}% of {ROWS * COPIES} draws", flush=True)
    floor_us = ROWS * VOCAB * 2 / args.bandwidth * 1e6
    rows = [("compiled PyTorch", graph_time_us(lambda: step(compiled), calls=4, per_call=COPIES))]
    default = sampling_kernels.BLOCK_ELEMENTS, sampling_kernels.NUM_WARPS
    for elements, warps in itertools.product((4096, 8192, 16384), (4, 8)):
        # The stats kernel's launch is read from these module constants at each call.
        sampling_kernels.BLOCK_ELEMENTS, sampling_kernels.NUM_WARPS = elements, warps
        seconds = graph_time_us(lambda: step(triton_sample_and_record), calls=4, per_call=COPIES)
        mark = " (default)" if (elements, warps) == default else ""
        rows.append((f"triton, {elements} logits x {warps} warps{mark}", seconds))
    sampling_kernels.BLOCK_ELEMENTS, sampling_kernels.NUM_WARPS = default
    print(f"\n{'sampler':<34} {'us/step':>8} {'TB/s':>6}   (floor: one read of the logits, {floor_us:.1f} us)")
    for name, us in rows:
        print(f"{name:<34} {us:8.1f} {ROWS * VOCAB * 2 / us / 1e6:6.2f}")


if __name__ == "__main__":
    main()
