"""Decode pieces for narrow batches: the same per-layer functions (`llama_forward.attention_inputs`,
`attention_output_and_mlp`) with their plain projections run by the skinny-batch kernel
(`kernels/decode_linear.py`) instead of cuBLAS, and SiLU-mul done inside the gate/up one.

Why: at the tail of a long-tail rollout a decode step runs a few sequences, and then each projection reads its weights
for almost no arithmetic; a step costs about the same at 1 sequence as at 32, well above its floor (docs/benchmarks.md,
"Where a decode step's time goes"). `with_small_batch` hangs these pieces on a `DecodeFunctions` as its `small_batch`
member; `llama_forward._decode_layers` takes them for CUDA batches of at most `decode_linear.MAX_ROWS` rows. The batch
is fixed inside a CUDA graph, so the choice is made once per captured step. Compiled like the pieces they stand for
(one compilation for every narrow batch), the kernel called as one operator (`hybridrl::decode_linear`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from hybridrl.rollout.engine.llama_forward import (DecodeFunctions, attention_inputs, attention_output_and_mlp,
                                                   dynamic_batch, final_logits)
from hybridrl.rollout.kernels.decode_linear import MAX_ROWS, small_batch_linear

ENABLED = True
"""On: at the 1.5B shape they shorten a decode step of 1-16 sequences (figures in docs/benchmarks.md, "Where a
decode step's time goes"). A module setting so that one benchmark process can time the decode step with and
without them (`benchmarks/profiling/decode_step.py --compare`)."""


def project(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False, partial: bool = False) -> torch.Tensor:
    """`llama_forward`'s projection contract: (M, N), or with `partial` possibly split-K partial sums (S, M, N)."""
    return small_batch_linear(x, weight, silu_mul, partial)


def small_attention_inputs(w, lw, h, pending, cos, sin):
    return attention_inputs(w, lw, h, pending, cos, sin, project)


def small_attention_output_and_mlp(w, lw, h, attn):
    return attention_output_and_mlp(w, lw, h, attn, project)


def small_final_logits(w, h, pending):
    return final_logits(w, h, pending, project)


def _batch_dim(tensor: torch.Tensor) -> int:
    """A residual of three dims is split-K partial sums (splits, B, N), whose batch is dimension 1 (the split count is
    fixed by the weight's shape); every other activation has the batch first."""
    return 1 if tensor.dim() == 3 else 0


@functools.cache
def _pieces(compiled: bool) -> tuple:
    if not compiled:
        return small_attention_inputs, small_attention_output_and_mlp, small_final_logits
    return tuple(dynamic_batch(torch.compile(fn, fullgraph=True), first_activation, _batch_dim)
                 for fn, first_activation in ((small_attention_inputs, 2), (small_attention_output_and_mlp, 2),
                                              (small_final_logits, 1)))


def with_small_batch(functions: DecodeFunctions, compiled: bool) -> DecodeFunctions:
    """`functions` with the narrow-batch pieces (compiled or eager, as `functions` are) as its `small_batch`; the
    same `functions` while `ENABLED` is off."""
    if not ENABLED:
        return functions
    inputs, output_and_mlp, logits = _pieces(compiled)
    small = replace(functions, attention_inputs=inputs, attention_output_and_mlp=output_and_mlp, final_logits=logits,
                    small_batch=None)
    return replace(functions, small_batch=small, small_batch_rows=MAX_ROWS)
