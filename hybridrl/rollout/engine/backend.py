"""The built-in rollout engine: `BuiltinBackend`, generation from the actor's own parameter tensors.

One `generate` call runs these phases:
1. resolve references to the model's weights (no copy) and size the KV cache from the memory budget,
   in one of two layouts (`kv_cache.py`, chosen by `attention`): per-slot (SDPA) or prefix-shared
   (each prompt's KV once, read by the Triton decode kernel; on CPU by its PyTorch reference);
2. admit waiting sequences into free slots and prefill them: each distinct prompt runs once, its
   KV goes to the slots of all its samples (per-slot) or to one prompt entry that its samples share
   (prefix-shared), and the first token of each sample is drawn;
3. decode: a few steps of `_decode_step` (one CUDA graph per batch-size bucket on GPU, eager on
   CPU), with no host synchronisation inside; on GPU its per-layer pieces and the sampler are
   `torch.compile`d, as is the prefill's layer (once per backend object: the trainer calls `generate`
   every step with the same shapes, so later calls reuse the compiled code and only re-capture the
   graphs, which point at the freshly allocated KV cache);
4. sync: read which slots finished (stop token or length), check stop strings on the host, harvest
   finished sequences, free their slots; go back to 2 while anything waits or runs;
5. free the KV cache and graphs (unless `release_after_generate=False`).

Host syncs happen every `sync_every` steps, or earlier when the next length limit is due (the host
knows every sequence's length bound, so a sequence that reaches `max_new_tokens` is harvested at once).
A slot that finishes between syncs idles until the next one. Prompt-major output order, as in
`base.py`.
"""

from __future__ import annotations

import time

import torch

from hybridrl.devices import host_to_device
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.engine.decode_state import DecodeState, compiled_sample_and_record, sample_and_record
from hybridrl.rollout.engine.kernel_choices import (
    ATTENTION_OPTIONS,
    auto_dequantized_layers,
    auto_fuses_gate_up,
    dequantized_layer_bytes,
    resolve_attention,
    sampler_name,
    triton_available,
)
from hybridrl.rollout.engine.kernel_choices import decode_attention_function as _decode_attention_function
from hybridrl.rollout.engine.kv_cache import CacheGeometry, PrefixSharedKVCache, SlotKVCache, max_slots
from hybridrl.rollout.engine.llama_forward import (
    EAGER_DECODE,
    MATRICES,
    DecodeFunctions,
    compiled_decode_functions,
    is_packed_4bit,
    prefill,
    resolve_weights,
    rope_table,
    rotates_projections,
)
from hybridrl.rollout.engine.llama_forward import supports as _supports
from hybridrl.rollout.engine.sampling import SamplerSettings, sample
from hybridrl.rollout.engine.scheduler import Scheduler, SequenceSlot, find_stop_string
from hybridrl.rollout.timeline import Timeline

_GIB = 1024**3
KV_LEN_BUCKET = 128
"""Decode attention reads keys up to the next multiple of this past the furthest live position."""
CPU_MEMORY_REFERENCE_GIB = 4.0
"""On CPU a fractional `kv_cache_memory` is a fraction of this fixed size (free RAM is not a safe guide)."""
def _tensor_layouts(values) -> tuple:
    """(shape, stride, dtype) of every tensor in `values` and every number or string (a compiled function
    specialises on those too), looking into tuples, lists and objects' attributes."""
    if isinstance(values, (int, float, str)) or values is None:
        return (values,)
    if isinstance(values, torch.Tensor):
        return ((tuple(values.shape), values.stride(), values.dtype),)
    if isinstance(values, (tuple, list)):
        return tuple(layout for value in values for layout in _tensor_layouts(value))
    if hasattr(values, "__dict__") and not callable(values):
        return _tensor_layouts(list(vars(values).values()))
    return ()


def _weights_key(weights) -> tuple:
    """Addresses of every referenced tensor and the LoRA scalings: equal keys mean a captured graph still applies."""
    key = []
    for layer in weights.layers:
        for value in vars(layer).values():
            for item in value if isinstance(value, tuple) else (value,):
                key.append(item.data_ptr() if isinstance(item, torch.Tensor) else item)
    return tuple(key) + (weights.embed.data_ptr(), weights.final_norm.data_ptr(), weights.lm_head.data_ptr())


class BuiltinBackend:
    """Rollout backend for Llama-family models that generates from the model's parameters in place.

    kv_cache_memory: KV cache budget, a fraction of free device memory (GiB if > 1; on CPU a
        fraction of 4 GiB). max_num_seqs: cap on concurrent sequences (KV slots). max_prefill_tokens:
        padded prompt tokens per prefill forward. use_cuda_graphs: capture decode steps on CUDA.
        sync_every: decode steps between host checks for finished sequences. tokenizer: needed only
        for stop strings. release_after_generate: free the KV cache at the end of each `generate`.
        compile: `torch.compile` the decode step's per-layer pieces and the sampler (None: on CUDA
        only; a string: that compile mode for the per-layer pieces, e.g. "max-autotune-no-cudagraphs").
        The first step of each new shape compiles (seconds); `last_stats["warmup_s"]` reports
        the time of such first steps (compilation and CUDA-graph capture) apart from the rest.
        attention: "sdpa" (per-slot KV, SDPA decode attention), "triton" (prefix-shared KV: each prompt's
        KV stored once; the Triton decode kernel on CUDA, its PyTorch reference on CPU) or "auto"
        (triton on CUDA when triton imports, else sdpa); opt-in "triton-stacked": the same layout, attention
        split into a prompt kernel per (entry, KV head) that stacks the samples' queries and a response
        kernel per slot (`stacked_attention.py`; on CPU its PyTorch reference). `last_stats["attention"]`
        says which ran. fuse_qkv (default on): copy each layer's q/k/v weights into one matrix for the duration of a
        `generate` (one matmul instead of three; extra memory of the q/k/v weights, e.g. 50 MB for
        Qwen2-0.5B, 0.9 GB for Qwen2.5-7B); projections with a LoRA adapter stay separate. fuse_gate_up:
        the same for the MLP's gate and up projections (extra memory of those weights: 0.4 GB for
        Qwen2-0.5B, 7.6 GB for Qwen2.5-7B); "auto" (default) fuses where that copy is small
        (`auto_fuses_gate_up`), `last_stats["fuse_gate_up"]` says whether it did. rope_in_attention: with
        fuse_qkv, attention "triton" and no q/k
        norm, the decode kernel adds the q/k/v bias and applies RoPE itself (one kernel fewer per layer);
        False keeps a RoPE kernel (for comparisons). `last_stats["rope_in_attention"]` says which ran.
        empty_cache (default on): when the KV cache is released, and before it is sized, hand the CUDA
        allocator's cached memory back to the driver; False leaves it cached for the next phase to reuse
        (no cudaFree / cudaMalloc of the KV cache every rollout; nvidia-smi then shows the high-water mark).
        sampling_kernel (default on): on CUDA with triton, plain temperature sampling in the decode step runs as two
        Triton kernels (`sampling_kernels.py`) instead of the compiled PyTorch sampler; `last_stats["sampler"]`
        says which the decode steps used ("triton" or "torch").
        dequantize_4bit: for a bitsandbytes 4-bit base (QLoRA), True makes a full-precision copy of its projection
        weights for the duration of a `generate`, so decode steps run as for a bf16 base (CUDA graphs included)
        instead of dequantizing every layer at every step; "auto" (default) copies as many layers as fit in half of
        the free memory on CUDA (`auto_dequantized_layers`; all 13 GB of a 7B model on an H200), the rest are
        dequantized as they run. `last_stats["dequantized_4bit_layers"]` counts the copied layers.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        kv_cache_memory: float = 0.3,
        max_num_seqs: int = 1024,
        max_prefill_tokens: int = 16384,
        use_cuda_graphs: bool = True,
        sync_every: int = 16,
        release_after_generate: bool = True,
        compile: bool | str | None = None,
        attention: str = "auto",
        fuse_qkv: bool = True,
        fuse_gate_up: bool | str = "auto",
        rope_in_attention: bool = True,
        empty_cache: bool = True,
        sampling_kernel: bool = True,
        dequantize_4bit: bool | str = "auto",
    ) -> None:
        ok, reason = _supports(model)
        if not ok:
            raise ValueError(f"the built-in rollout engine cannot run this model: {reason}; use rollout.backend=hf.")
        if kv_cache_memory <= 0 or max_num_seqs < 1 or max_prefill_tokens < 1 or sync_every < 1:
            raise ValueError("kv_cache_memory must be > 0 and max_num_seqs, max_prefill_tokens, sync_every >= 1.")
        if attention not in ATTENTION_OPTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_OPTIONS}; got {attention!r}.")
        for name, value in (("fuse_gate_up", fuse_gate_up), ("dequantize_4bit", dequantize_4bit)):
            if value not in (True, False, "auto"):
                raise ValueError(f"{name} must be true, false or 'auto'; got {value!r}.")
        self.model, self.tokenizer = model, tokenizer
        self.kv_cache_memory, self.max_num_seqs = kv_cache_memory, max_num_seqs
        self.max_prefill_tokens, self.sync_every = max_prefill_tokens, sync_every
        self.use_cuda_graphs, self.release_after_generate = use_cuda_graphs, release_after_generate
        self.compile, self.attention, self.fuse_qkv, self.fuse_gate_up = compile, attention, fuse_qkv, fuse_gate_up
        self.rope_in_attention, self.empty_cache, self.sampling_kernel = rope_in_attention, empty_cache, sampling_kernel
        self.dequantize_4bit = dequantize_4bit
        self._compiled: tuple[DecodeFunctions, object] | None = None  # kept across generate calls
        self.cache: SlotKVCache | PrefixSharedKVCache | None = None
        self._attention_name = ""  # which decode attention the current cache uses, for last_stats
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        # One warm-up stream for the engine's life: cuBLAS keeps a workspace (32 MiB on Hopper) per stream
        # it has run on, so a new stream per rollout would hold 33 MiB more after every step.
        self._warmup_stream = self._capture_stream = None
        self._weights_key: tuple = ()
        self._warmed: set[tuple] = set()  # shape signatures whose decode step has run once (compiled, loaded)
        self.last_stats: dict[str, float] = {}

    supports = staticmethod(_supports)

    # ---- public interface -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self._validate(prompts, params)
        timeline = Timeline(next(self.model.parameters()).device)
        fuse_gate_up = auto_fuses_gate_up(self.model) if self.fuse_gate_up == "auto" else self.fuse_gate_up
        packed_sizes = dequantized_layer_bytes(self.model)
        dequantize = (auto_dequantized_layers(self.model) if self.dequantize_4bit == "auto"
                      else len(packed_sizes) if self.dequantize_4bit else 0)
        # fused and dequantized copies are remade every call, from the weights as they are now
        weights = resolve_weights(self.model, self.fuse_qkv, fuse_gate_up, dequantize_layers=dequantize)
        key = _weights_key(weights)
        if key != self._weights_key:  # modules replaced or LoRA switched on/off: kept graphs point at old tensors
            self._graphs, self._graph_pool, self._weights_key = {}, None, key
        device, dtype = weights.lm_head.device, weights.lm_head.dtype
        geometry = CacheGeometry(len(weights.layers), weights.num_kv_heads, weights.head_dim,
                                 torch.empty(0, dtype=dtype).element_size(), max(map(len, prompts)),
                                 params.max_new_tokens, len(prompts), params.n)
        max_len = geometry.max_len
        # Both layouts rely on this: within the window no key is ever hidden, so neither applies one.
        if weights.sliding_window is not None and max_len > weights.sliding_window:
            raise ValueError(f"prompt + max_new_tokens ({max_len}) exceeds the model's sliding window "
                             f"({weights.sliding_window}); the built-in engine does not implement windowed caches.")
        num_sequences = len(prompts) * params.n
        attention = resolve_attention(self.attention, device)
        num_slots = self._allocate(geometry, attention, num_sequences, device, dtype)
        stop_ids = sorted(set(params.stop_token_ids) | set(self._eos_ids(params)))
        state = DecodeState(num_slots, params.max_new_tokens, stop_ids, device)
        settings = SamplerSettings(params.temperature, params.top_k, params.top_p, params.min_p)
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        cos, sin = rope_table(self.model, max_len, device, dtype)
        functions, sampler = self._decode_functions(device)
        # A 4-bit base is dequantized by bitsandbytes inside each step; whether its kernels capture into a
        # CUDA graph is unverified, so such models run the step uncaptured (per-layer work is large anyway).
        packed = any(is_packed_4bit(getattr(layer, name)) for layer in weights.layers for name in MATRICES)
        self._run = dict(weights=weights, state=state, settings=settings, generator=generator, cos=cos, sin=sin,
                         functions=functions, sampler=sampler, graphs=self.use_cuda_graphs and not packed,
                         timeline=timeline)
        scheduler = Scheduler([i // params.n for i in range(num_sequences)], [len(p) for p in prompts], num_slots)
        results: list[Generation | None] = [None] * num_sequences
        stats = dict(num_slots=num_slots, decode_steps=0, prefill_waves=0, graphs_captured=0,
                     captures_without_warmup=0, warmup_s=0.0, compiled=self._compiles(device),
                     attention=self._attention_name,
                     rope_in_attention=isinstance(self.cache, PrefixSharedKVCache) and self.rope_in_attention
                     and rotates_projections(self.cache.attention, weights),
                     fuse_gate_up=any(layer.gate_up_weight is not None for layer in weights.layers),
                     dequantized_4bit_layers=sum(size > 0 for size in packed_sizes[:dequantize]),
                     sampler=sampler_name(self.sampling_kernel, settings, device, weights.lm_head.shape[0]))
        self._stats = stats
        finished = False
        try:
            while scheduler.has_work:
                admitted = scheduler.admit()
                if admitted:
                    timeline.mark("prefill")
                    self._prefill(prompts, admitted)
                    timeline.mark("decode")
                    for sequence in admitted:
                        sequence.generated = 1
                    stats["prefill_waves"] += 1
                batch = scheduler.batch_size()
                steps = min([self.sync_every] + [params.max_new_tokens - s.generated for s in scheduler.live.values()])
                kv_len = self._kv_len(scheduler, steps, max_len)
                self.cache.track_slots(scheduler.live)  # after admission, harvest and compaction
                for _ in range(steps):
                    self._step(batch, kv_len)
                stats["decode_steps"] += steps
                self._sync(scheduler, params, results)
                self._compact(scheduler)
            timeline.mark("harvested")
            finished = True
        finally:
            stats["graphs_captured"] = len(self._graphs)
            self._run = None
            self.last_stats = stats
            if self.release_after_generate:
                self.release_memory()
        if finished:  # not after an error: reading the events would wait on a GPU that may have failed
            timeline.mark("released")
            stats["timeline_ms"] = timeline.report()
        return results

    def release_memory(self) -> None:
        self.cache, self._run = None, None
        self._graphs, self._graph_pool = {}, None
        if self.empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- phases -----------------------------------------------------------------------------------
    def _decode_functions(self, device) -> tuple[DecodeFunctions, object]:
        """The layer pieces and `sample_and_record`: eager or compiled, and with the sampling kernels on CUDA."""
        if not self._compiles(device):
            functions, sampler = EAGER_DECODE, sample_and_record
        else:
            if self._compiled is None:
                mode = self.compile if isinstance(self.compile, str) else None
                self._compiled = (compiled_decode_functions(mode), compiled_sample_and_record())
            functions, sampler = self._compiled
        if self._sampling_kernel_on(device):
            from hybridrl.rollout.kernels.sampling_kernels import with_sampling_kernel  # imports triton

            sampler = with_sampling_kernel(sampler)
        return functions, sampler

    def _compiles(self, device) -> bool:
        return bool(self.compile) if self.compile is not None else device.type == "cuda"

    def _sampling_kernel_on(self, device) -> bool:
        return self.sampling_kernel and device.type == "cuda" and triton_available()

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and every prompt needs at least one token.")
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab}) (the model's vocab_size).")
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError("SamplingParams.n and max_new_tokens must be at least 1.")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or not 0 <= params.min_p < 1:
            raise ValueError("SamplingParams: temperature >= 0, top_p in (0, 1], top_k >= 0, min_p in [0, 1).")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: BuiltinBackend(model, tokenizer=...).")

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        if params.ignore_eos:
            return []
        generation_config = getattr(self.model, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    def _allocate(self, geometry: CacheGeometry, attention: str, num_sequences: int, device, dtype) -> int:
        """Allocate the KV cache in the chosen layout for as many slots as the budget allows; returns the slot count."""
        layout = SlotKVCache if attention == "sdpa" else PrefixSharedKVCache
        self.release_memory()
        if device.type == "cuda":
            # Free to this process: the driver's free memory plus what the allocator holds cached, unused.
            free_bytes = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
                - torch.cuda.memory_allocated(device)
            budget = self.kv_cache_memory * _GIB if self.kv_cache_memory > 1 else self.kv_cache_memory * free_bytes
        else:
            budget = self.kv_cache_memory * _GIB * (1 if self.kv_cache_memory > 1 else CPU_MEMORY_REFERENCE_GIB)
        num_slots = max_slots(lambda slots: layout.bytes_for(geometry, slots), budget,
                              min(num_sequences, self.max_num_seqs))
        if num_slots < 1:
            one = layout.bytes_for(geometry, 1)
            raise ValueError(f"rollout.kv_cache_memory={self.kv_cache_memory} leaves {budget / _GIB:.3f} GiB, less than "
                             f"one sequence of {geometry.max_len} tokens needs ({one / _GIB:.3f} GiB); raise it.")
        if layout is SlotKVCache:
            self.cache, self._attention_name = SlotKVCache(geometry, num_slots, device, dtype), "sdpa"
        else:
            self._attention_name, function = _decode_attention_function(attention, device)
            self.cache = PrefixSharedKVCache(geometry, num_slots, device, dtype, function,
                                             stacked=attention == "triton-stacked",
                                             rope_in_attention=self.rope_in_attention)
        return num_slots

    def _kv_len(self, scheduler: Scheduler, steps: int, max_len: int) -> int:
        """Key-length bucket of the next `steps` decode steps (per-slot layout; 0 for prefix-shared, which
        stops at each slot's own lengths): keys beyond the furthest position these steps reach are never
        read, and bucketing keeps the number of CUDA graphs small."""
        if not self.cache.reads_kv_len:
            return 0
        furthest = max(s.prompt_len + s.generated for s in scheduler.live.values()) + steps
        return min(max_len, -(-furthest // KV_LEN_BUCKET) * KV_LEN_BUCKET)

    def _prefill(self, prompts: list[list[int]], admitted: list[SequenceSlot]) -> None:
        """Prefill each distinct admitted prompt once (chunked by token budget), then draw first tokens."""
        state = self._run["state"]
        device = state.done.device
        by_prompt: dict[int, list[SequenceSlot]] = {}
        for sequence in admitted:
            by_prompt.setdefault(sequence.prompt_index, []).append(sequence)
        order = sorted(by_prompt, key=lambda p: len(prompts[p]))  # similar lengths share a chunk: less padding
        chunk: list[int] = []
        for prompt_index in order + [None]:
            longest = max((len(prompts[p]) for p in chunk), default=0)
            if prompt_index is not None:
                grown = max(longest, len(prompts[prompt_index])) * (len(chunk) + 1)
                if not chunk or grown <= self.max_prefill_tokens:
                    chunk.append(prompt_index)
                    continue
            self._prefill_chunk(prompts, chunk, by_prompt, device)
            chunk = [prompt_index]

    def _prefill_chunk(self, prompts, chunk: list[int], by_prompt: dict[int, list[SequenceSlot]], device) -> None:
        """Prefill the prompts of `chunk` (one padded forward), write their KV where the layout keeps it,
        and draw each admitted sequence's first token from its prompt's last-position logits."""
        run, state = self._run, self._run["state"]
        length = max(len(prompts[p]) for p in chunk)
        input_ids = torch.zeros(len(chunk), length, dtype=torch.long)
        for row, prompt_index in enumerate(chunk):
            input_ids[row, : len(prompts[prompt_index])] = torch.tensor(prompts[prompt_index])
        rows = [row for row, p in enumerate(chunk) for _ in by_prompt[p]]
        sequences = [sequence for p in chunk for sequence in by_prompt[p]]
        write_rows, write_to = self.cache.prefill_writes(rows, sequences)
        # Every host list goes over in one pinned, non-blocking copy: a plain torch.tensor(..., device=cuda)
        # synchronizes the stream, so the host used to wait for this prefill to finish before it could record
        # the decode graph, which it can now do while the prefill runs.
        index_lists = [[len(prompts[p]) for p in chunk], rows, [sequence.slot for sequence in sequences],
                       [sequence.entry for sequence in sequences], list(write_rows), list(write_to)]
        sizes = [len(values) for values in index_lists]
        on_device = host_to_device(torch.tensor([v for values in index_lists for v in values], dtype=torch.long), device)
        lengths, rows_t, slots_t, entries, write_rows_t, write_to_t = on_device.split(sizes)
        logits = prefill(run["weights"], self.cache.prefill_cache, run["cos"], run["sin"],
                         host_to_device(input_ids, device), lengths, write_rows_t, write_to_t,
                         run["functions"].prefill_layer)
        uniforms = torch.rand(len(sequences), state.max_new_tokens, generator=run["generator"], device=device)
        state.uniform_table[slots_t] = uniforms  # column 0 draws the first token, column i the (i+1)-th
        tokens, logprobs = sample(logits[rows_t], run["settings"], uniforms[:, 0])
        state.last_token[slots_t] = tokens
        state.prompt_len[slots_t] = lengths[rows_t]
        state.prompt_entry[slots_t] = entries
        state.gen_len.index_fill_(0, slots_t, 1)  # not `[slots_t] = 1`: that synchronizes (see `free`)
        state.out_tokens[slots_t, 0] = tokens
        state.out_logprobs[slots_t, 0] = logprobs
        state.done[slots_t] = state.is_stop(tokens) | (state.max_new_tokens <= 1)

    def _decode_step(self, batch: int, kv_len: int) -> None:
        """Forward + sample + bookkeeping for slots 0..batch-1, entirely on device (graph-capturable)."""
        run, state = self._run, self._run["state"]
        logits = self.cache.decode(run["weights"], run["cos"], run["sin"], state.last_token[:batch],
                                   state.prompt_len[:batch], state.gen_len[:batch], state.prompt_entry[:batch],
                                   kv_len, run["functions"])
        run["sampler"](logits, run["settings"], state.uniform_table[:batch], state.done[:batch], state.gen_len[:batch],
                       state.last_token[:batch], state.out_tokens[:batch], state.out_logprobs[:batch],
                       state.stop_ids, state.max_new_tokens)

    def _step(self, batch: int, kv_len: int) -> None:
        run = self._run
        if not (run["graphs"] and self.cache.is_cuda):
            self._decode_step(batch, kv_len)
            return
        graph = self._graphs.get((batch, kv_len))
        if graph is None:
            start = time.perf_counter()
            signature = self._shape_signature(batch, kv_len)
            warmed = signature in self._warmed
            if not warmed:  # runs this step for real
                self._warm_up(batch, kv_len)
                self._warmed.add(signature)
            self._stats["captures_without_warmup"] += warmed
            graph = self._capture(batch, kv_len, synchronize=not warmed)
            self._stats["warmup_s"] += time.perf_counter() - start
            if not warmed:
                return
        run["timeline"].mark("replay")
        graph.replay()

    def _shape_signature(self, batch: int, kv_len: int) -> tuple:
        """What the compiled decode step and its Triton kernels were specialised for: the step's sizes and the
        shapes, strides and dtypes of every tensor it reads (weights, cache, state, RoPE table)."""
        run = self._run
        return (batch, kv_len) + _tensor_layouts((run["weights"], self.cache, run["state"], run["cos"], run["sin"]))

    def _warm_up(self, batch: int, kv_len: int) -> None:
        """The first step of a shape runs for real on a side stream (the warm-up the CUDA graph docs ask for;
        it also compiles) before it is captured."""
        torch.cuda.synchronize()
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream()
        side = self._warmup_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode_step(batch, kv_len)
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, batch: int, kv_len: int, synchronize: bool) -> torch.cuda.CUDAGraph:
        """Record one decode step into a new graph on the engine's own side stream (a new stream per capture
        would cost a cuBLAS workspace each). Not `torch.cuda.graph`: it synchronizes, runs gc.collect and
        empties the allocator's cache on entry (~15 ms of an idle GPU per rollout, `decode_gaps.py`). A shape
        warmed up before (an earlier rollout) is captured without synchronizing: recording launches nothing,
        so the host records while the GPU still runs the prefill, and the replay follows it in stream order."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        if synchronize:
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=self._graph_pool)
            try:
                self._decode_step(batch, kv_len)
            finally:
                graph.capture_end()
        self._graph_pool = graph.pool()
        self._graphs[(batch, kv_len)] = graph
        return graph

    def _sync(self, scheduler: Scheduler, params: SamplingParams, results: list) -> None:
        """Harvest finished sequences (and those cut by a stop string) and free their slots."""
        state = self._run["state"]
        batch = max(scheduler.live) + 1 if scheduler.live else 0
        if batch == 0:
            return
        # One blocking copy, not two: after each one the GPU idles until the host has woken up and launched
        # more work (~0.8 ms per copy on an H200, `benchmarks/decode_gaps.py`).
        done, gen_len = torch.stack((state.done[:batch].long(), state.gen_len[:batch])).tolist()
        self._run["timeline"].mark("sync", last=True)
        for slot, sequence in scheduler.live.items():
            sequence.generated = gen_len[slot]
        check_strings = bool(params.stop_strings)
        if not (any(done[s] for s in scheduler.live) or check_strings):
            return
        # Only the rows used, as numpy rows handed over as they are: making Python lists of a 512 x 256 batch
        # here took ~9 ms of host time with the GPU idle (`Generation` makes them if someone asks).
        # copy=True: on CPU `.cpu()` would return the state itself, which later waves overwrite under the rows.
        tokens = state.out_tokens[:batch].to("cpu", copy=True).numpy()
        logprobs = state.out_logprobs[:batch].to("cpu", copy=True).numpy()
        stop_set = set(state.stop_ids.tolist())
        freed = []
        for slot in list(scheduler.live):
            if not (done[slot] or check_strings):
                continue
            length = gen_len[slot]
            reason = None
            if check_strings:
                cut = find_stop_string(self.tokenizer, tokens[slot, :length].tolist(), params.stop_strings)
                if cut is not None:
                    length, reason = cut, "stop"
            if reason is None and done[slot]:
                reason = "stop" if int(tokens[slot, length - 1]) in stop_set else "length"
            if reason is None:
                continue
            sequence = scheduler.finish(slot)
            freed.append(slot)
            results[sequence.index] = Generation(sequence.prompt_index, tokens[slot, :length], logprobs[slot, :length],
                                                 reason)
        if freed:
            state.free(freed)

    def _compact(self, scheduler: Scheduler) -> None:
        moves = scheduler.compaction_moves()
        if not moves:
            return
        state = self._run["state"]
        device = state.done.device
        source, destination = host_to_device(torch.tensor(moves, dtype=torch.long).T.contiguous(), device)
        self.cache.move(source, destination)
        for tensor in state.per_slot():
            tensor[destination] = tensor[source]
        state.free([s for s, _ in moves])
