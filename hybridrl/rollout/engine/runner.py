"""The engine's runner: everything that owns tensors. The scheduler (`scheduler.py`) decides which sequence sits
in which slot; the runner turns those decisions into device work and never decides them itself.

Per `generate` call (`begin` ... `end`) it holds a `RunState`: references to the model's weights (no copy, except
the fused and dequantized copies that `resolve_weights` makes from the weights as they are now), the KV cache in
the layout of the chosen `AttentionPath`, the per-slot `DecodeState`, the RoPE table, the seeded generator and the
decode functions. Across calls it keeps what is costly to make and does not depend on the call's tensors: the
compiled pieces (compiled once per engine: the trainer calls `generate` every step with the same shapes, so later
calls reuse the compiled code) and the set of warmed step signatures (`graphs.py`). The CUDA graphs point at one
call's KV cache and state: a small call keeps them, with the cache and state, for the next call of its shape
(`kept_runs.py`); other calls capture them again.

Nothing here synchronizes with the host except `read_progress` and `read_outputs`, which the engine calls at its
sync points; host lists go to the device in one pinned, non-blocking copy (`host_to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrl.devices import host_to_device, release_cached_memory
from hybridrl.rollout.base import SamplingParams
from hybridrl.rollout.engine.decode_state import DecodeState, compiled_sample_and_record, sample_and_record
from hybridrl.rollout.engine import prefill_graph
from hybridrl.rollout.engine.graphs import CaptureCounts, DecodeGraphs, step_signature
from hybridrl.rollout.engine.kept_runs import KeptRun, KeptRuns, run_key, weight_addresses
from hybridrl.rollout.engine.kernel_choices import (
    AttentionPath,
    attention_path,
    auto_dequantized_layers,
    auto_fuses_gate_up,
    dequantized_layer_bytes,
    sampler_name,
    sampling_kernels_on,
    small_batch_projections_on,
)
from hybridrl.rollout.engine.blocks import BlockAllocator
from hybridrl.rollout.engine.kv_cache import (
    CacheGeometry,
    PagedKVCache,
    PrefixSharedKVCache,
    SlotKVCache,
    _round_up,
    max_slots,
)
from hybridrl.rollout.engine.llama_forward import (
    EAGER_DECODE,
    DecodeFunctions,
    compiled_decode_functions,
    prefill,
    rope_table,
    rotates_projections,
)
from hybridrl.rollout.engine.preemption import KeptResponse, keep_sampled, refill
from hybridrl.rollout.engine.resume import Resume, extend_resumes
from hybridrl.rollout.engine.sampling import SamplerSettings, sample
from hybridrl.rollout.engine.scheduler import Scheduler, SequenceSlot, prefill_chunks
from hybridrl.rollout.engine.weights import ModelWeights, resolve_weights
from hybridrl.rollout.timeline import Timeline

_GIB = 1024**3
KV_LEN_BUCKET = 128
"""Per-slot decode attention reads keys up to the next multiple of this past the furthest live position."""
CPU_MEMORY_REFERENCE_GIB = 4.0
"""On CPU a fractional `kv_cache_memory` is a fraction of this fixed size (free RAM is not a safe guide)."""


@dataclass(frozen=True)
class EngineOptions:
    """The user's choices for the built-in engine (see `BuiltinBackend` for each)."""

    kv_cache_memory: float = 0.3
    max_num_seqs: int = 1024
    max_prefill_tokens: int = 16384
    use_cuda_graphs: bool = True
    compile: bool | None = None
    attention: str = "auto"
    fuse_qkv: bool = True
    fuse_gate_up: bool | str = "auto"
    sampler: str = "auto"
    dequantize_4bit: bool | str = "auto"
    kv_cache: str = "auto"
    kv_block_size: int = 64
    keep_runs: bool = True


@dataclass
class GenerateStats:
    """What one `generate` call did; `BuiltinBackend.last_stats` is this as a dict."""

    num_slots: int = 0
    decode_steps: int = 0
    prefill_waves: int = 0
    graphs_captured: int = 0
    """Graphs recorded in this call; `graphs_kept` were recorded by an earlier call of this shape and replayed."""
    graphs_kept: int = 0
    captures_without_warmup: int = 0
    warmup_s: float = 0.0
    compiled: bool = False
    attention: str = ""
    rope_in_attention: bool = False
    """Whether the decode attention added the q/k/v bias and applied RoPE itself (prefix-shared, fused q/k/v)."""
    fuse_gate_up: bool = False
    dequantized_4bit_layers: int = 0
    sampler: str = "torch"
    prefill_tokens: int = 0
    """Tokens whose KV a prefill computed: each distinct prompt once, and in multi-turn episodes what each resume
    fed (the turn's last sampled token, whose KV no decode step wrote, and the observation)."""
    observation_prefills: int = 0
    idle_s: float = 0.0
    """Multi-turn: seconds the engine waited for environments with no sequence to decode."""
    timeline_ms: dict = field(default_factory=dict)
    kv_cache: str = "contiguous"
    kv_blocks: int = 0
    """Paged layout: blocks in the pool (the scratch block included) and the most in use at once."""
    kv_blocks_peak: int = 0
    preemptions: int = 0
    """Paged layout: sequences whose blocks were taken back when the pool ran dry, and the response tokens they had
    sampled (kept: their KV is prefilled again at re-admission, they are not sampled again)."""
    preempted_tokens: int = 0
    refilled_tokens: int = 0
    """Paged layout: kept response tokens whose KV a re-admission after preemption prefilled again: every kept token
    but the last of each (whose KV the next decode step writes), so preempted_tokens - preemptions in a single-turn
    call. A prompt whose blocks were given back too is prefilled again as well, counted in `prefill_tokens`."""
    decoded_tokens: int = 0
    """Response tokens the decode steps sampled (each sequence's first comes from its prefill), counted at the syncs:
    as many with preemption as without, since kept tokens are not sampled again."""


@dataclass
class RunState:
    """The tensors and choices of one `generate` call."""

    weights: ModelWeights
    cache: SlotKVCache | PrefixSharedKVCache | PagedKVCache
    state: DecodeState
    uniforms: torch.Tensor
    """(sequences, max_new_tokens): each sequence's uniforms, by its index, so its samples do not depend on when
    (or how often, after a preemption) it is admitted."""
    settings: SamplerSettings
    generator: torch.Generator
    cos: torch.Tensor
    sin: torch.Tensor
    functions: DecodeFunctions
    sampler: object
    use_graphs: bool
    timeline: Timeline
    stats: GenerateStats
    counts: CaptureCounts = field(default_factory=CaptureCounts)
    kept: dict[int, KeptResponse] = field(default_factory=dict)
    """Paged: what preempted sequences had sampled, by sequence index, until their re-admission (`preemption.py`)."""
    key: tuple | None = None
    """What the run's tensors were made for (`kept_runs.run_key`); None when the run will not be kept (not asked
    for; the paged layout, dequantized copies: remade every call; too large)."""
    addresses: tuple | None = None
    """`kept_runs.weight_addresses` of the run's weights (with a key)."""


POOL_SIGNIFICANT_BITS = 6
"""A budget-bound paged pool keeps this many significant bits of its block count (`steady_pool`)."""


def steady_pool(blocks: int) -> int:
    """`blocks` rounded down to `POOL_SIGNIFICANT_BITS` significant bits (at most 1/32 fewer). A budget given as a
    fraction of the free memory moves a little from call to call, and the pool's block count is a tensor shape:
    unrounded, each call's decode steps had a new signature, so each batch bucket's first step was warmed up (run for
    real, synchronizing) inside every call (`graphs.py`); rounded, nearby budgets give the same pool."""
    granule = 1 << max(0, blocks.bit_length() - POOL_SIGNIFICANT_BITS)
    return blocks // granule * granule


class SlotRows:
    """Rows read for some slots only (`ModelRunner.read_outputs`), indexed by slot as the full per-slot array is:
    `rows[slot, :length]`."""

    def __init__(self, rows, slots: list[int]) -> None:
        self.rows, self.position = rows, {slot: row for row, slot in enumerate(slots)}

    def __getitem__(self, key):
        slot, *rest = key if isinstance(key, tuple) else (key,)
        return self.rows[(self.position[slot], *rest)]


def decode_step(run: RunState, batch: int, kv_len: int) -> None:
    """Forward + sample + bookkeeping for slots 0..batch-1 of `run`, entirely on device (graph-capturable). The run
    is bound when a step is captured, as a CUDA graph binds its tensors: a graph kept for a later call replays the
    tensors of the call that captured it (`kept_runs.py` says when those are the later call's too)."""
    state = run.state
    logits = run.cache.decode(run.weights, run.cos, run.sin, state.last_token[:batch], state.prompt_len[:batch],
                              state.gen_len[:batch], state.prompt_entry[:batch], kv_len, run.functions)
    run.sampler(logits, run.settings, state.uniform_table[:batch], state.done[:batch], state.gen_len[:batch],
                state.last_token[:batch], state.out_tokens[:batch], state.out_logprobs[:batch],
                state.stop_ids, state.max_new_tokens)


class ModelRunner:
    """Owns the model's tensors during generation: KV cache, per-slot state, compiled pieces and CUDA graphs."""

    def __init__(self, model, options: EngineOptions) -> None:
        self.model, self.options = model, options
        self.graphs = DecodeGraphs()
        self._compiled: tuple[DecodeFunctions, object] | None = None  # kept across generate calls
        self._packed_sizes: list[int] | None = None  # per layer, the bytes of its 4-bit weights at full precision
        self.cache: SlotKVCache | PrefixSharedKVCache | PagedKVCache | None = None
        self.run: RunState | None = None
        self.kept = KeptRuns()

    # ---- one call -----------------------------------------------------------------------------------
    def begin(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int],
              num_sequences: int | None = None, max_len: int | None = None, keep: bool = False) -> int:
        """Resolve the weights, allocate the KV cache and the per-slot state (or take a kept run's); returns the
        number of slots. Multi-turn: `num_sequences` episodes (default len(prompts) * n) whose slots hold `max_len`
        positions. `keep`: the call may be kept for the next of its shape, if small enough (`kept_runs.py`); then its
        small prefills run as CUDA graphs too (`_prefill_chunk`), which only a kept run replays often enough."""
        timeline = Timeline(next(self.model.parameters()).device)
        weights, dequantized, packed = self._weights()
        device, dtype = weights.lm_head.device, weights.lm_head.dtype
        path = attention_path(self.options.attention, device, self.options.kv_cache)
        longest, new_tokens = max(map(len, prompts)), params.max_new_tokens
        if max_len is not None and path.layout is PagedKVCache:
            # A paged episode keeps its prompt in the prompt columns and everything after it (turns, observations)
            # in the response columns, which must hold what the shortest prompt leaves of the episode.
            new_tokens = max(new_tokens, max_len - min(map(len, prompts)))
        elif max_len is not None:
            longest = max(longest, max_len - params.max_new_tokens)
        geometry = CacheGeometry(len(weights.layers), weights.num_kv_heads, weights.head_dim,
                                 torch.empty(0, dtype=dtype).element_size(), longest, new_tokens, len(prompts))
        # Both layouts rely on this: within the window no key is ever hidden, so neither applies one.
        if weights.sliding_window is not None and geometry.max_len > weights.sliding_window:
            raise ValueError(f"prompt + max_new_tokens ({geometry.max_len}) exceeds the model's sliding window "
                             f"({weights.sliding_window}); the built-in engine does not implement windowed caches.")
        num_sequences = num_sequences or len(prompts) * params.n
        settings = SamplerSettings(params.temperature, params.top_k, params.top_p, params.min_p)
        key = None if path.layout is PagedKVCache or dequantized else run_key(
            path.name, (_round_up(geometry.longest_prompt), _round_up(geometry.max_new_tokens), geometry.max_len),
            len(prompts), num_sequences, params.max_new_tokens, stop_ids, settings, dtype, device)
        kept = self.kept.take(key) if key is not None else None
        addresses = weight_addresses(weights) if key is not None else None
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        if kept is not None:  # the same shape as a kept call: its tensors, and its graphs if the weights stayed put
            num_slots, self.cache, state, cos, sin = kept.num_slots, kept.cache, kept.state, kept.cos, kept.sin
            uniforms = torch.rand(kept.uniforms.shape, generator=generator, device=device, out=kept.uniforms)
            state.reset()
            self.graphs.drop()
            if kept.addresses == addresses:
                self.graphs.restore(kept.graphs)
        else:
            num_slots = self._allocate(geometry, path, num_sequences, device, dtype)
            state = DecodeState(num_slots, params.max_new_tokens, stop_ids, device)
            cos, sin = rope_table(self.model, geometry.max_len, device, dtype)
            uniforms = torch.rand(num_sequences, params.max_new_tokens, generator=generator, device=device)
        functions, sampler = self._decode_functions(device)
        # A 4-bit base is dequantized by bitsandbytes inside each step; whether its kernels capture into a
        # CUDA graph is unverified, so such models run the step uncaptured (per-layer work is large anyway).
        stats = GenerateStats(
            num_slots=num_slots, graphs_kept=len(self.graphs.graphs), compiled=self._compiles(device),
            attention=path.name,
            rope_in_attention=path.layout is not SlotKVCache and rotates_projections(weights),
            kv_cache="paged" if path.layout is PagedKVCache else "contiguous",
            kv_blocks=getattr(self.cache, "num_blocks", 0),
            fuse_gate_up=any(layer.gate_up_weight is not None for layer in weights.layers),
            dequantized_4bit_layers=dequantized,
            sampler=sampler_name(self.options.sampler, settings, device, weights.lm_head.shape[0]))
        keepable = keep and self.options.keep_runs and key is not None and self.kept.fits(self.cache, state, weights,
                                                                                              device)
        self.run = RunState(weights, self.cache, state, uniforms, settings, generator, cos, sin, functions, sampler,
                            self.options.use_cuda_graphs and not packed and device.type == "cuda", timeline, stats,
                            key=key if keepable else None, addresses=addresses)
        return num_slots

    def block_allocator(self) -> BlockAllocator | None:
        """The block bookkeeping of this call's paged cache (None for the contiguous layouts)."""
        return self.run.cache.allocator()

    def record_scheduling(self, scheduler: Scheduler) -> None:
        """The scheduler's counts in this call's stats: decoded tokens; blocks and preemptions (paged layout)."""
        stats = self.run.stats
        stats.decoded_tokens = scheduler.decoded_tokens
        if scheduler.blocks is not None:
            stats.kv_blocks_peak, stats.preemptions, stats.preempted_tokens = \
                scheduler.blocks.peak_in_use + 1, scheduler.preemptions, scheduler.preempted_tokens

    def write_blocks(self, writes: list[tuple[int, int, int]], evicted: list[int] = ()) -> None:
        """Apply the scheduler's block-table writes before the next prefill or decode step reads the table, after
        resetting the rows of the paused slots whose blocks were taken (`evicted`, paged multi-turn)."""
        if evicted:
            self.run.cache.clear_rows(host_to_device(torch.tensor(evicted), self.run.state.done.device))
        self.run.cache.write_blocks(writes)

    def end(self, finished: bool, release: bool) -> dict:
        """Close the call: its stats as a dict, and the KV cache freed when `release`. A finished call begun with
        `keep` (and small enough) is kept for the next call of its shape (`kept_runs.py`), its graphs with it."""
        run, self.run = self.run, None
        stats = run.stats
        stats.graphs_captured = run.counts.captured
        stats.captures_without_warmup, stats.warmup_s = run.counts.captures_without_warmup, run.counts.warmup_s
        if finished:
            run.timeline.mark("harvested")
        if finished and run.key is not None:
            self.kept.put(KeptRun(run.key, run.state.done.shape[0], run.cache, run.state, run.uniforms, run.cos,
                                  run.sin, self.graphs.take(), run.addresses), run.weights)
        if release:
            self.release()
        if finished:  # not after an error: reading the events would wait on a GPU that may have failed
            run.timeline.mark("released")
            stats.timeline_ms = run.timeline.report()
        return vars(stats).copy()

    def release(self, empty_cache: bool = True, keep: bool = True) -> None:
        """Free the KV cache and the graphs that point at it; with `empty_cache`, the allocator's unused blocks go
        back to the driver when the device is short of memory (`devices.release_cached_memory`, as at the trainer's
        phase switch: handed back every rollout, the next phase took each segment again with a cudaMalloc), and
        then the kept runs go too, as they do without `keep`."""
        self.cache, self.run = None, None
        self.graphs.drop()
        if not keep:
            self.kept.clear()
        device = next(self.model.parameters()).device
        if empty_cache and release_cached_memory(device) and self.kept.runs:
            self.kept.clear()
            release_cached_memory(device)

    # ---- setup --------------------------------------------------------------------------------------
    def _weights(self) -> tuple[ModelWeights, int, bool]:
        """References to the weights as they are now (fused and dequantized copies remade every call), how many
        layers of a 4-bit base were copied at full precision, and whether any 4-bit layer is left packed."""
        options = self.options
        fuse_gate_up = auto_fuses_gate_up(self.model) if options.fuse_gate_up == "auto" else options.fuse_gate_up
        if self._packed_sizes is None:  # the walk over every projection is host time; a model's packing is fixed
            self._packed_sizes = dequantized_layer_bytes(self.model)
        packed_sizes = self._packed_sizes
        dequantize = (auto_dequantized_layers(self.model) if options.dequantize_4bit == "auto" and any(packed_sizes)
                      else len(packed_sizes) if options.dequantize_4bit is True else 0)
        weights = resolve_weights(self.model, options.fuse_qkv, fuse_gate_up, dequantize_layers=dequantize,
                                  into=self.kept.weights)
        return weights, sum(size > 0 for size in packed_sizes[:dequantize]), any(packed_sizes[dequantize:])

    def _allocate(self, geometry: CacheGeometry, path: AttentionPath, num_sequences: int, device, dtype) -> int:
        """Allocate the KV cache in the path's layout for as many slots as the budget allows; returns the slot count."""
        layout, memory = path.layout, self.options.kv_cache_memory
        # The allocator's cache is kept: this call's tensors reuse the blocks the phase before freed (the budget
        # below counts them as free), where emptying it cost a cudaFree per cached block, at every rollout.
        self.release(empty_cache=False)
        if device.type == "cuda":
            # Free to this process: the driver's free memory plus what the allocator holds cached, unused.
            free_bytes = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
                - torch.cuda.memory_allocated(device)
            budget = memory * _GIB if memory > 1 else memory * free_bytes
        else:
            budget = memory * _GIB * (1 if memory > 1 else CPU_MEMORY_REFERENCE_GIB)
        if layout is PagedKVCache:
            return self._allocate_paged(geometry, path, budget, num_sequences, device, dtype)
        num_slots = max_slots(lambda slots: layout.bytes_for(geometry, slots), budget,
                              min(num_sequences, self.options.max_num_seqs))
        if num_slots < 1:
            one = layout.bytes_for(geometry, 1)
            raise ValueError(f"rollout.kv_cache_memory={memory} leaves {budget / _GIB:.3f} GiB, less than "
                             f"one sequence of {geometry.max_len} tokens needs ({one / _GIB:.3f} GiB); raise it.")
        if layout is SlotKVCache:
            self.cache = SlotKVCache(geometry, num_slots, device, dtype)
        else:
            self.cache = PrefixSharedKVCache(geometry, num_slots, device, dtype, path.attention)
        return num_slots

    def _allocate_paged(self, geometry: CacheGeometry, path: AttentionPath, budget: float, num_sequences: int,
                        device, dtype) -> int:
        """A pool of as many blocks as the budget holds, and a slot for every sequence (up to `max_num_seqs`): the
        blocks, not the slots, bound how many run at once. Refuses a call whose longest sequence exceeds the pool."""
        block_size = self.options.kv_block_size
        needed = PagedKVCache.blocks_needed(geometry, block_size)
        # Never more than every sequence at full length could fill (each prompt's blocks once), as the contiguous
        # layouts are never given more slots than sequences.
        most = 1 + geometry.num_prompts * (needed - 1) + num_sequences * (needed - 1)
        num_blocks = min(most, steady_pool(PagedKVCache.blocks_within(geometry, block_size, budget)))
        if num_blocks < needed:
            raise ValueError(f"rollout.kv_cache_memory={self.options.kv_cache_memory} holds {num_blocks} KV blocks of "
                             f"{block_size} tokens ({budget / _GIB:.3f} GiB), fewer than the {needed} that one sequence "
                             f"of {geometry.longest_prompt} prompt + {geometry.max_new_tokens} new tokens needs "
                             f"(with the scratch block); raise kv_cache_memory or lower max_new_tokens.")
        num_slots = min(num_sequences, self.options.max_num_seqs)
        self.cache = PagedKVCache(geometry, num_slots, num_blocks, block_size, device, dtype, path.attention)
        return num_slots

    def _compiles(self, device) -> bool:
        return bool(self.options.compile) if self.options.compile is not None else device.type == "cuda"

    def _decode_functions(self, device) -> tuple[DecodeFunctions, object]:
        """The layer pieces and `sample_and_record`: eager or compiled, and with the sampling kernels on CUDA."""
        if not self._compiles(device):
            functions, sampler = EAGER_DECODE, sample_and_record
        else:
            if self._compiled is None:
                self._compiled = (compiled_decode_functions(), compiled_sample_and_record())
            functions, sampler = self._compiled
        if small_batch_projections_on(device, self._compiles(device)):
            from hybridrl.rollout.engine.small_batch import with_small_batch  # imports triton

            functions = with_small_batch(functions, compiled=True)
        if sampling_kernels_on(self.options.sampler, device):
            from hybridrl.rollout.kernels.sampling_kernels import with_sampling_kernel  # imports triton

            sampler = with_sampling_kernel(sampler)
        return functions, sampler

    # ---- phases -------------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], admitted: list[SequenceSlot]) -> None:
        """Prefill each distinct admitted prompt once (chunked by token budget), then draw first tokens. Sequences
        re-admitted after a preemption (`kept`) get their context prefilled again and their tokens back instead
        (`preemption.refill`), after the new ones, whose prefill may write prompt blocks they read."""
        self.run.timeline.mark("prefill")
        by_prompt: dict[int, list[SequenceSlot]] = {}
        for sequence in admitted:
            if not sequence.kept:
                by_prompt.setdefault(sequence.prompt_index, []).append(sequence)
        for chunk in prefill_chunks([len(p) for p in prompts], list(by_prompt), self.options.max_prefill_tokens):
            self._prefill_chunk(prompts, chunk, by_prompt)
            self.run.stats.prefill_tokens += sum(len(prompts[p]) for p in chunk)
        refills = [sequence for sequence in admitted if sequence.kept]
        if refills:
            refill(self.run, prompts, refills, self.options.max_prefill_tokens, self._key_bucket)
        self.run.timeline.mark("decode")
        self.run.stats.prefill_waves += 1

    def _prefill_chunk(self, prompts, chunk: list[int], by_prompt: dict[int, list[SequenceSlot]]) -> None:
        """Prefill the prompts of `chunk` (one padded forward), write their KV where the layout keeps it,
        and draw each admitted sequence's first token from its prompt's last-position logits."""
        run, state = self.run, self.run.state
        device = state.done.device
        length = max(len(prompts[p]) for p in chunk)
        input_ids = torch.zeros(len(chunk), length, dtype=torch.long)
        for row, prompt_index in enumerate(chunk):
            input_ids[row, : len(prompts[prompt_index])] = torch.tensor(prompts[prompt_index])
        rows = [row for row, p in enumerate(chunk) for _ in by_prompt[p]]
        sequences = [sequence for p in chunk for sequence in by_prompt[p]]
        write_rows, write_to = run.cache.prefill_writes(rows, sequences)
        # Every host list goes over in one pinned, non-blocking copy: a plain torch.tensor(..., device=cuda)
        # synchronizes the stream, so the host would wait for this prefill to finish before it could record
        # the decode graph, which it can do while the prefill runs.
        index_lists = [[len(prompts[p]) for p in chunk], rows, [sequence.slot for sequence in sequences],
                       [sequence.entry for sequence in sequences], list(write_rows), list(write_to),
                       [sequence.index for sequence in sequences]]
        sizes = [len(values) for values in index_lists]
        host = torch.cat((input_ids.flatten(), torch.tensor([v for values in index_lists for v in values],
                                                            dtype=torch.long)))
        graphed = prefill_graph.graphs_prefill(run.use_graphs, run.key is not None, len(chunk), length)
        key = ("prefill", len(chunk), length, tuple(sizes))
        # A kept run's small prefill: its inputs in the graph's static buffer (`prefill_graph.py`)
        on_device = (prefill_graph.static_inputs(self.graphs, key, host, device) if graphed
                     else host_to_device(host, device))
        ids = on_device[:input_ids.numel()].view(input_ids.shape)
        lengths, rows_t, slots_t, entries, write_rows_t, write_to_t, indices = on_device[input_ids.numel():].split(sizes)

        def prefill_and_first_tokens() -> None:
            store = run.cache.prompt_store(write_rows_t, write_to_t, lengths, length)
            logits = prefill(run.weights, None, run.cos, run.sin, ids, lengths, None, None,
                             run.functions.prefill_layer, store=store)
            uniforms = run.uniforms[indices]
            state.uniform_table[slots_t] = uniforms  # column 0 draws the first token, column i the (i+1)-th
            tokens, logprobs = sample(logits[rows_t], run.settings, uniforms[:, 0])
            state.last_token[slots_t] = tokens
            state.prompt_len[slots_t] = lengths[rows_t]
            run.cache.begin_sequences(slots_t, lengths[rows_t])
            state.prompt_entry[slots_t] = entries
            state.gen_len.index_fill_(0, slots_t, 1)  # not `[slots_t] = 1`: that synchronizes (see `free`)
            state.out_tokens[slots_t, 0] = tokens
            state.out_logprobs[slots_t, 0] = logprobs
            state.done[slots_t] = state.is_stop(tokens) | (state.max_new_tokens <= 1)

        if graphed:
            self.graphs.step(key, lambda: step_signature(len(chunk), length, ("prefill", tuple(sizes), run.settings),
                             (run.weights, run.cache, run.state, run.uniforms, on_device, run.cos, run.sin)),
                             prefill_and_first_tokens, run.counts)
        else:
            prefill_and_first_tokens()

    def extend(self, resumes: list[Resume]) -> None:
        """Multi-turn resumes, each (slot, ids, start, key): feed `ids` at positions start.. onto the slot's own KV,
        which holds every earlier position, and draw the first token of the slot's next turn, from uniforms hashed
        from `key` (`resume.py`: chunks, uniforms, CUDA graphs for small waves)."""
        extend_resumes(self.run, resumes, self.options.max_prefill_tokens, self.graphs, self._key_bucket)

    def pause(self, slots: list[int]) -> None:
        """Mark paused slots finished on the device, so decode steps leave their state (and KV) alone."""
        if slots:
            self.run.state.done.index_fill_(0, host_to_device(torch.tensor(slots), self.run.state.done.device), True)

    def kv_len(self, furthest: int) -> int:
        """Key-length bucket of decode steps that reach position `furthest` at most (per-slot layout; 0 for
        prefix-shared, which stops at each slot's own lengths): keys beyond it are never read, and bucketing keeps
        the number of CUDA graphs small."""
        return self._key_bucket(furthest) if self.run.cache.reads_kv_len else 0

    def _key_bucket(self, furthest: int) -> int:
        max_len = self.run.cos.shape[0]  # the RoPE table covers every position of the call
        return min(max_len, -(-furthest // KV_LEN_BUCKET) * KV_LEN_BUCKET)

    def decode(self, batch: int, kv_len: int, steps: int) -> None:
        """`steps` decode steps over slots 0..batch-1, with no host synchronisation between them."""
        run = self.run
        for _ in range(steps):
            if not run.use_graphs:
                decode_step(run, batch, kv_len)
                continue
            self.graphs.step((batch, kv_len), lambda: self.step_signature(batch, kv_len),
                             lambda: decode_step(run, batch, kv_len), run.counts,
                             before_replay=lambda: run.timeline.mark("replay"))
        run.stats.decode_steps += steps

    def capture_decode_ahead(self, batch: int, kv_len: int) -> None:
        """Record the decode step at (batch, kv_len) before it is due, if its signature was warmed in an earlier call
        (`DecodeGraphs.capture_ahead`): called just after a decode block is launched, the host records it while the
        GPU runs the block, not when the sequences reach that key bucket (or, as they finish, that batch bucket) with
        the GPU waiting."""
        run = self.run
        if run.use_graphs:
            self.graphs.capture_ahead((batch, kv_len), lambda: self.step_signature(batch, kv_len),
                                      lambda: decode_step(run, batch, kv_len), run.counts)

    def step_signature(self, batch: int, kv_len: int) -> tuple:
        """What the decode step of this call at (batch, kv_len) is specialised for (see `graphs.py`)."""
        run = self.run
        return step_signature(batch, kv_len, (run.settings, run.stats.sampler),
                              (run.weights, run.cache, run.state, run.cos, run.sin))

    # ---- sync points --------------------------------------------------------------------------------
    def read_progress(self, batch: int) -> tuple[list[int], list[int]]:
        """Finished flags and response lengths of slots 0..batch-1: the call's one blocking copy per sync point
        (one, not two: after each, the GPU idles until the host has woken up and launched more work)."""
        state = self.run.state
        done, gen_len = torch.stack((state.done[:batch].long(), state.gen_len[:batch])).tolist()
        self.run.timeline.mark("sync", last=True)
        return done, gen_len

    def read_outputs(self, batch: int, columns: int | None = None, slots: list[int] | None = None):
        """Tokens and log-probs of slots 0..batch-1 (their first `columns` positions: long responses make the full
        rows large) as numpy rows (Python lists of a large batch cost host time with the GPU idle; `Generation` makes
        them if asked). copy=True: on CPU `.cpu()` would return the state itself, which later waves overwrite under
        the rows. `slots`: only those rows, gathered on the device (`SlotRows`, indexed by slot all the same): at a
        sync a few of hundreds of slots finish, and copying every row cost the idle GPU most of a millisecond."""
        state = self.run.state
        if slots is not None:
            index = host_to_device(torch.tensor(slots), state.done.device)
            return (SlotRows(state.out_tokens[:, :columns].index_select(0, index).cpu().numpy(), slots),
                    SlotRows(state.out_logprobs[:, :columns].index_select(0, index).cpu().numpy(), slots))
        return (state.out_tokens[:batch, :columns].to("cpu", copy=True).numpy(),
                state.out_logprobs[:batch, :columns].to("cpu", copy=True).numpy())

    def free(self, slots: list[int]) -> None:
        """Park freed slots (`DecodeState.free`) and point their block-table rows at scratch (paged layout)."""
        if slots:
            index = host_to_device(torch.tensor(slots), self.run.state.done.device)  # one copy for both
            self.run.state.free(index)
            self.run.cache.free(index)

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Copy the KV and per-slot state of each (source, destination) slot pair, then free the sources."""
        if not moves:
            return
        state = self.run.state
        source, destination = host_to_device(torch.tensor(moves, dtype=torch.long).T.contiguous(), state.done.device)
        self.run.cache.move(source, destination)
        for tensor in state.per_slot():
            tensor[destination] = tensor[source]
        self.free([s for s, _ in moves])

    # ---- preemption (paged layout) ------------------------------------------------------------------
    def preempt(self, sequences: list[SequenceSlot]) -> None:
        """Keep what the preempted `sequences` sampled (read from their slots now, before others take them; see
        `preemption.py`) and park their slots."""
        if sequences:
            self.run.kept.update(keep_sampled(self.run.state, sequences))
            self.free([sequence.slot for sequence in sequences])
