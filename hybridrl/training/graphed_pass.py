"""CUDA graphs of the actor's training pass: forward, loss and backward of one micro-batch, replayed as one graph.

Why: at short sequences (the time-to-accuracy run: 256 rows of ~12 tokens on a 0.5B model) the update is bound by
the host. The eager Hugging Face forward and backward launch ~2,400 kernels per micro-batch for a few ms of GPU
work; a graph launches them in one call. Whole-network capture, as in PyTorch's notes on CUDA graphs:

- Fixed shapes. `pad_micro_batch` pads a micro-batch to a bucket (`bucket_shape`): its rows up to the micro-batch
  size, its response columns and its whole width up to the next bucket width (a power of two or 1.5 times one), so
  a run meets a handful of shapes. The loss sees none of it: padded columns have attention mask 0 and loss mask 0,
  padded rows repeat the first row's tokens with loss mask 0.
- Static inputs. The padded tensors are copied into buffers that the graph reads; the loss's normalisers are a
  tensor too (a Python number would be baked into the graph as the value of the update that captured it).
- Static gradients. Each trainable parameter's `.grad` is a view of one flat buffer kept between updates, zeroed
  when a mini-batch starts; the captured backward adds into it, as eager accumulation over micro-batches does.
- Warm-up. The first pass of a shape runs the same function eagerly on the capture stream (lazily made state, such
  as cuBLAS workspaces, then exists before capture); the second captures it and replays; later ones replay.
- The optimizer step stays outside: its learning rate and step count change every step, and it is already one
  launch per bucket of parameters.

Exactness: a replay computes what the eager run of the same padded pass computes. Against the unpadded eager pass
the padded one agrees within rounding: other matmul shapes, and the normalisers divide as tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.config.schema import Config
from hybridrl.devices import host_to_device
from hybridrl.rollout.engine.graph_rng import begin_capture
from hybridrl.training.batch import RolloutBatch

logger = logging.getLogger(__name__)

AUTO_MAX_PARAMETER_TOKENS = 4e12
"""`actor.cuda_graphs=auto` graphs a micro-batch when trainable parameters x its padded tokens is at most this (a
0.5B model at ~8k tokens): ~24 TFLOP of forward and backward, ~35 ms on an H200, below the ~100 ms the host takes to
launch the eager pass. Larger passes are bound by the GPU, where a graph saves nothing and its memory pool would keep
their activations allocated between updates."""

AUTO_MAX_GRADIENT_SHARE = 1 / 16
"""`auto` graphs only models whose gradients take at most this share of the device's memory: the graphs keep them
allocated through the rollout too, where a large model's KV cache needs the room (a 7B model's bf16 gradients are 15
GiB, a tenth of an H200)."""

MAX_GRAPHS = 8
"""Shapes captured per run at most; a shape beyond them runs eagerly (each graph keeps its activations' memory)."""

TOKEN_FIELDS = ("input_ids", "attention_mask", "position_ids")
"""(B, P + R) fields: left-padded prompt, right-padded response."""
RESPONSE_FIELDS = ("response_mask", "loss_mask", "advantages", "old_logp", "sampler_logp", "ref_logp",
                   "old_values", "returns")
"""(B, R) fields, right-padded and row-padded with zeros (masked out)."""

Pass = Callable[[RolloutBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]
"""(padded micro-batch, normalisers as 0-d tensors) -> (loss, its detached stats, detached log-probs (B, R))."""


def bucket_width(width: int, minimum: int = 4) -> int:
    """The least bucket width >= `width`: minimum, then powers of two and 1.5 times them (4, 6, 8, 12, 16, 24, ...),
    so padding adds at most half the width and a run meets few distinct shapes."""
    bucket = minimum
    while bucket < width:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return bucket


def bucket_shape(num_rows: int, prompt_width: int, response_width: int) -> tuple[int, int, int]:
    """(rows, whole width, response width) of the graph a micro-batch is padded to. A batch that fills a bucket is
    not padded at all (the time-to-accuracy run's 6 prompt + 6 response columns: 12 of 12), since at this size the
    graphed pass is bound by the GPU, whose work grows with every padded column."""
    response = bucket_width(response_width)
    return num_rows, bucket_width(prompt_width + response, minimum=8), response


def _pad_rows(tensor: torch.Tensor, extra: int, repeat_first: bool) -> torch.Tensor:
    if extra == 0:
        return tensor
    filler = tensor[:1].expand(extra, *tensor.shape[1:]) if repeat_first else tensor.new_zeros(extra, *tensor.shape[1:])
    return torch.cat([tensor, filler])


def pad_micro_batch(part: RolloutBatch, num_rows: int, width: int, response_width: int,
                    pad_token_id: int = 0) -> RolloutBatch:
    """`part` padded to (num_rows, width) with `response_width` response columns; its own values stay where the
    padded columns and rows leave them: the prompt right before the response, the response at its start.

    Added columns: token `pad_token_id`, attention mask 0, position 0 on the left (as `build_rollout_batch` pads
    prompts) and the last position repeated on the right; zeros in every (B, R) field. Added rows: the first row's
    tokens (a row that attends to something, so attention stays finite), zeros in every (B, R) field, so nothing
    of theirs enters the loss, its normalisers or its stats."""
    rows, old_width = part.input_ids.shape
    response = part.response_length
    left, right, extra = (width - response_width) - (old_width - response), response_width - response, num_rows - rows
    if min(left, right, extra) < 0:
        raise ValueError(f"cannot pad a micro-batch of {rows} rows, {old_width} columns ({response} response) to "
                         f"{num_rows} rows, {width} columns ({response_width} response)")
    values = {}
    for name in TOKEN_FIELDS:
        tensor = getattr(part, name)
        if name == "position_ids":
            padded = torch.cat([tensor.new_zeros(rows, left), tensor, tensor[:, -1:].expand(rows, right)], dim=1)
        else:
            padded = F.pad(tensor, (left, right), value=pad_token_id if name == "input_ids" else 0)
        values[name] = _pad_rows(padded, extra, repeat_first=True)
    for name in RESPONSE_FIELDS:
        tensor = getattr(part, name)
        values[name] = None if tensor is None else _pad_rows(F.pad(tensor, (0, right)), extra, repeat_first=False)
    for name in ("truncated", "prompt_index", "scores", "baseline_scores"):
        tensor = getattr(part, name)
        values[name] = None if tensor is None else _pad_rows(tensor, extra, repeat_first=True)
    return dataclasses.replace(part, **values, texts=[], columns=None)


def normalizer_tensor(norm: dict[str, float], device: torch.device) -> torch.Tensor:
    """`update.mini_batch_normalizers`' values as one float32 tensor (3,) on the device: data the graph reads."""
    return host_to_device(torch.tensor([norm["num_tokens"], norm["num_sequences"], norm["max_length"]],
                                       dtype=torch.float32), device)


def normalizers(values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"num_tokens": values[0], "num_sequences": values[1], "max_length": values[2]}


def capture_problem(config: Config, model: torch.nn.Module, device: torch.device, world_size: int) -> str | None:
    """Why the actor's training pass cannot be graphed in this run (a reason to log), or None."""
    attention = str(getattr(getattr(model, "config", None), "_attn_implementation", "sdpa"))
    problems = {  # reason -> whether it applies
        "the device is not CUDA": device.type != "cuda",
        "several training processes (FSDP gathers weights inside the pass)": world_size > 1,
        "LoRA (model.lora_rank > 0)": config.model.lora_rank > 0,
        "gradient checkpointing (its recomputation reads the RNG state)": config.model.gradient_checkpointing,
        "model.compile (compiled layers)": config.model.compile,
        "packing by tokens (actor.max_tokens_per_micro_batch > 0)": config.actor.max_tokens_per_micro_batch > 0,
        "shared prompts (actor.share_prompt_tokens)": config.actor.share_prompt_tokens,
        f"attention {attention!r} (only sdpa and eager take a padding mask without host syncs)":
            attention not in ("sdpa", "eager"),
    }
    return next((reason for reason, applies in problems.items() if applies), None)


def build_graphed_pass(config: Config, model: torch.nn.Module, device: torch.device,
                       world_size: int) -> "GraphedPass | None":
    """The actor's graph runner as `actor.cuda_graphs` asks, or None (eager), with the reason logged."""
    setting = config.actor.cuda_graphs
    if setting is False:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    problem = capture_problem(config, model, device, world_size)
    if problem is None and setting == "auto":
        problem = too_large_for_auto(params, torch.cuda.get_device_properties(device).total_memory)
    if problem is not None:
        log = logger.warning if setting is True else logger.info
        log("actor.cuda_graphs=%s: the update runs eagerly: %s", setting, problem)
        return None
    return GraphedPass(params, auto=setting == "auto")


def too_large_for_auto(params: list[torch.nn.Parameter], device_memory: int) -> str | None:
    """Why `auto` leaves these parameters' pass eager (`AUTO_MAX_GRADIENT_SHARE`), or None."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    if gradient_bytes <= AUTO_MAX_GRADIENT_SHARE * device_memory:
        return None
    return (f"its gradients ({gradient_bytes / 2**30:.1f} GiB) would stay allocated through the rollout, more than "
            f"{AUTO_MAX_GRADIENT_SHARE:.3g} of the device's memory (actor.cuda_graphs=true graphs it anyway)")


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static buffers the graph reads
    norm: torch.Tensor  # (3,) static normalisers
    outputs: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]  # static loss, stats, log-probs

    def load(self, inputs: dict[str, torch.Tensor], norm: torch.Tensor) -> None:
        for name, tensor in inputs.items():
            self.inputs[name].copy_(tensor)
        self.norm.copy_(norm)


class GraphedPass:
    """Runs the actor's micro-batch pass (`Pass`, then the loss's backward) at bucket shapes, captured as a CUDA
    graph from a shape's second use; gradients accumulate in static buffers (`attach_gradients`)."""

    def __init__(self, params: list[torch.nn.Parameter], auto: bool):
        self.params = params
        self.auto = auto
        self.capture = True
        """False runs every pass eagerly at its padded shape: the reference a replay must equal (tests)."""
        self.graphs: dict[tuple, _Captured] = {}
        self.uses: dict[tuple, int] = {}
        self.grads: list[torch.Tensor] | None = None
        self.stream: torch.cuda.Stream | None = None
        self.pool = None
        self.generator: torch.Generator | None = None
        self.logged: set[str] = set()

    def run(self, part: RolloutBatch, norm: dict[str, float], num_rows: int,
            compute: Pass) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor] | None:
        """The pass over `part` padded to its bucket (at least `num_rows` rows) and its backward into the
        parameters' gradients; the loss, stats and log-probs (B, R) of `part`'s own rows, or None when this pass
        should run eagerly (the reason logged once)."""
        rows, response = len(part), part.response_length
        shape = bucket_shape(max(num_rows, rows), part.input_ids.shape[1] - response, response)
        work = sum(p.numel() for p in self.params) * shape[0] * shape[1]
        if self.auto and work > AUTO_MAX_PARAMETER_TOKENS:
            return self._eager_because(f"a micro-batch of {shape[0]} x {shape[1]} tokens is large enough to keep "
                                       "the GPU busy (graphed_pass.AUTO_MAX_PARAMETER_TOKENS)")
        padded = pad_micro_batch(part, *shape)
        inputs = {name: getattr(padded, name) for name in TOKEN_FIELDS + RESPONSE_FIELDS
                  if getattr(padded, name) is not None}
        norm_values = normalizer_tensor(norm, part.input_ids.device)
        key = (shape, tuple((name, tensor.dtype) for name, tensor in inputs.items()))
        self.attach_gradients()
        captured = self.graphs.get(key) or self._captured_at_second_use(key, padded, inputs, norm_values, compute)
        if captured is None:
            loss, stats, logp = self._eager(padded, norm_values, compute)
            return loss, stats, logp[:rows, :response]
        captured.load(inputs, norm_values)
        captured.graph.replay()
        loss, stats, logp = captured.outputs  # overwritten by the next replay: copies
        return loss.clone(), {key: value.clone() for key, value in stats.items()}, logp[:rows, :response].clone()

    def _captured_at_second_use(self, key: tuple, padded: RolloutBatch, inputs: dict[str, torch.Tensor],
                                norm_values: torch.Tensor, compute: Pass) -> _Captured | None:
        """The graph of a shape met before (captured now), or None: its first use (the eager warm-up), capture off,
        `MAX_GRAPHS` reached, or a capture that failed (logged; capture is then off for the run)."""
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.uses[key] == 1 or not self.capture or len(self.graphs) >= MAX_GRAPHS:
            return None
        try:
            self.graphs[key] = self._capture(padded, inputs, norm_values, compute)
        except RuntimeError as error:  # e.g. a host sync inside the pass: nothing ran, the gradients are as they were
            self.capture = False
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("actor.cuda_graphs: capturing the update's pass failed (%s); it runs eagerly from now on",
                           message)
            return None
        return self.graphs[key]

    def _eager_because(self, reason: str) -> None:
        if reason not in self.logged:
            self.logged.add(reason)
            logger.info("actor.cuda_graphs: this micro-batch runs eagerly: %s", reason)
        return None

    def _side_stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
            self.pool = torch.cuda.graph_pool_handle()  # one pool for every shape: they never run at once
            self.generator = torch.Generator(device=torch.device("cuda", torch.cuda.current_device()))
        return self.stream

    def _eager(self, padded: RolloutBatch, norm_values: torch.Tensor, compute: Pass):
        if not padded.input_ids.is_cuda:  # CPU (tests of the padded pass): no streams
            loss, stats, logp = compute(padded, normalizers(norm_values))
            loss.backward()
            return loss.detach(), stats, logp
        stream, main = self._side_stream(), torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            loss, stats, logp = compute(padded, normalizers(norm_values))
            loss.backward()
        main.wait_stream(stream)
        return loss.detach(), stats, logp

    def _capture(self, padded: RolloutBatch, inputs: dict[str, torch.Tensor], norm_values: torch.Tensor,
                 compute: Pass) -> _Captured:
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        static_norm = norm_values.clone()
        graph, stream = torch.cuda.CUDAGraph(), self._side_stream()
        torch.cuda.synchronize()  # the warm-up's work done (recording launches nothing; replays follow in order)
        with torch.cuda.stream(stream):
            # As the engine captures (`graph_rng.begin_capture`): thread-local error mode, so an asynchronous rollout
            # worker's host sync in another thread does not break this capture, and a generator of its own in place
            # of the default one, which the pass never draws from and the worker's threads may
            begin_capture(graph, self.pool, self.generator)
            try:
                loss, stats, logp = compute(dataclasses.replace(padded, **static), normalizers(static_norm))
                loss.backward()
            finally:
                graph.capture_end()
        return _Captured(graph, static, static_norm, (loss.detach(), stats, logp))

    def attach_gradients(self) -> None:
        """Point every parameter's `.grad` at its static buffer: views of one flat buffer per dtype, in parameter
        order (so the optimizer reads consecutive gradients as one view). A parameter without a gradient (a new
        mini-batch: the optimizer step set them to None) starts from zero; one with a gradient of its own (an
        eager micro-batch ran first) has it copied in."""
        if self.grads is None:
            self.grads = [None] * len(self.params)
            for dtype in {p.dtype for p in self.params}:
                indices = [i for i, p in enumerate(self.params) if p.dtype == dtype]
                sizes = [self.params[i].numel() for i in indices]
                flat = torch.zeros(sum(sizes), dtype=dtype, device=self.params[0].device)
                for i, view in zip(indices, flat.split(sizes)):
                    self.grads[i] = view.view(self.params[i].shape)
        fresh = [grad for param, grad in zip(self.params, self.grads) if param.grad is None]
        own = [(grad, param.grad) for param, grad in zip(self.params, self.grads)
               if param.grad is not None and param.grad is not grad]
        if fresh:
            torch._foreach_zero_(fresh)
        if own:
            torch._foreach_copy_([grad for grad, _ in own], [value for _, value in own])
        for param, grad in zip(self.params, self.grads):
            param.grad = grad
