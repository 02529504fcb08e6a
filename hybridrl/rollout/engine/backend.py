"""The built-in rollout engine: `BuiltinBackend`, generation from the actor's own parameter tensors.

Split as nano-vllm splits it: `scheduler.py` is pure-Python bookkeeping over sequences and KV slots, `runner.py`
owns the tensors (weights, KV cache, per-slot state, compiled pieces, CUDA graphs), and `generate` below is the
loop over the two:
1. begin: the runner resolves references to the model's weights (no copy) and sizes the KV cache from the memory
   budget, in the layout of the chosen attention path (`kernel_choices.attention_path`);
2. admit waiting sequences into free slots and prefill them: each distinct prompt runs once and the first token
   of each sample is drawn;
3. decode: a few steps with no host synchronisation inside (one CUDA graph per batch-size bucket on GPU);
4. sync: read which slots finished (stop token or length), check stop strings on the host, harvest finished
   sequences and free their slots, compact the live ones into a smaller bucket; back to 2 while anything waits
   or runs;
5. end: free the KV cache and graphs (unless `release_after_generate=False`) and report `last_stats`; a small call
   keeps them for the next call of its shape instead (`kept_runs.py`: a trainer's short rollouts are mostly this
   fixed cost otherwise).

Host syncs happen every `sync_every` steps, or earlier when the next length limit is due. A slot that finishes
between syncs idles until the next one. Prompt-major output order, as in `base.py`.

`generate_episodes` runs multi-turn episodes through the same scheduler and runner (`multiturn.py`).
"""

from __future__ import annotations

import torch

from hybridrl.envs.base import EnvironmentSession, run_sync
from hybridrl.envs.episode import Episode
from hybridrl.envs.rendering import ObservationRenderer
from hybridrl.rollout.base import Generation, SamplingParams
from hybridrl.rollout.engine.kernel_choices import ATTENTION_OPTIONS, KV_CACHE_OPTIONS, SAMPLER_OPTIONS
from hybridrl.rollout.engine.multiturn import EpisodeLoop
from hybridrl.rollout.engine.runner import EngineOptions, ModelRunner
from hybridrl.rollout.engine.scheduler import Scheduler, find_stop_string
from hybridrl.rollout.engine.weights import supports as _supports
from hybridrl.rollout.multiturn import EpisodeBudget, check_episode_request, close_runs, start_runs

STEPS_AHEAD_ROWS = 2
"""Response rows a `generate` window's blocks and key length cover past its own steps: the step launched at the sync
before it, which the scheduler's lengths do not count yet, and the one launched at the sync after it (`_harvest`)."""


class BuiltinBackend:
    """Rollout backend for Llama-family models that generates from the model's parameters in place.

    kv_cache_memory: KV cache budget, a fraction of free device memory (GiB if > 1; on CPU a fraction of 4 GiB).
    max_num_seqs: cap on concurrent sequences (KV slots). max_prefill_tokens: padded prompt tokens per prefill
    forward. use_cuda_graphs: capture decode steps on CUDA. sync_every: decode steps between host checks for
    finished sequences. tokenizer: needed only for stop strings. release_after_generate: free the KV cache at
    the end of each `generate`. compile: `torch.compile` the decode step's per-layer pieces, the prefill's layer
    and the sampler (None: on CUDA only); the first step of each new shape compiles, and
    `last_stats["warmup_s"]` reports those first steps (compilation and CUDA-graph capture) apart from the rest.

    The kernel choices (`rollout.engine` in the config; each reported in `last_stats`):
    attention: "triton" (each prompt's KV stored once and read by all its samples; the Triton decode kernel on
    CUDA, its PyTorch reference on CPU), "sdpa" (a KV copy per sequence, PyTorch SDPA) or "auto" (triton on CUDA
    when triton imports, else sdpa). fuse_qkv: copy each layer's q/k/v weights into one matrix for the duration
    of a `generate` (one matmul instead of three; with attention "triton" and no q/k norm the kernel then adds the
    bias and RoPE itself); projections with a LoRA adapter stay separate. fuse_gate_up: the same for the MLP's
    gate and up projections; "auto" fuses where that copy is small (`auto_fuses_gate_up`). sampler: "auto" runs
    plain temperature sampling as two Triton kernels on CUDA with triton (`sampling_kernels.py`), "torch" always
    the (compiled) PyTorch sampler. dequantize_4bit: for a bitsandbytes 4-bit base (QLoRA), a full-precision copy
    of its projection weights for the duration of a `generate`, so decode steps run as for a bf16 base (CUDA
    graphs included); "auto" copies as many layers as fit in half of the free GPU memory
    (`auto_dequantized_layers`), the rest are dequantized as they run. kv_cache: "paged" keeps KV in blocks of
    `kv_block_size` tokens that sequences take as they grow and give back as they finish (prompt blocks shared by
    the n samples; admission by free blocks; when blocks run out the youngest sequences are preempted: they keep
    the tokens they sampled, and re-admitted, their context is prefilled again and decoding continues after them;
    `last_stats` counts `preemptions` and `refilled_tokens`), read by its own attention (`kernels/paged_attention.py`);
    "contiguous" the layouts above (room for the longest response in every slot); "auto" is contiguous.
    keep_runs: keep a small call's KV cache, state and CUDA graphs for the next call of the same shape and sampler
    (`kept_runs.py`; `last_stats["graphs_kept"]` counts the graphs replayed from an earlier call).
    """

    supports = staticmethod(_supports)

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
        compile: bool | None = None,
        attention: str = "auto",
        fuse_qkv: bool = True,
        fuse_gate_up: bool | str = "auto",
        sampler: str = "auto",
        dequantize_4bit: bool | str = "auto",
        kv_cache: str = "auto",
        kv_block_size: int = 64,
        keep_runs: bool = True,
    ) -> None:
        ok, reason = _supports(model)
        if not ok:
            raise ValueError(f"the built-in rollout engine cannot run this model: {reason}; use rollout.backend=hf.")
        if kv_cache_memory <= 0 or max_num_seqs < 1 or max_prefill_tokens < 1 or sync_every < 1:
            raise ValueError("kv_cache_memory must be > 0 and max_num_seqs, max_prefill_tokens, sync_every >= 1.")
        if attention not in ATTENTION_OPTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_OPTIONS}; got {attention!r}.")
        if kv_cache not in KV_CACHE_OPTIONS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_OPTIONS}; got {kv_cache!r}.")
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be at least 1; got {kv_block_size}.")
        if sampler not in SAMPLER_OPTIONS:
            raise ValueError(f"sampler must be one of {SAMPLER_OPTIONS}; got {sampler!r}.")
        for name, value in (("fuse_gate_up", fuse_gate_up), ("dequantize_4bit", dequantize_4bit)):
            if value not in (True, False, "auto"):
                raise ValueError(f"{name} must be true, false or 'auto'; got {value!r}.")
        self.model, self.tokenizer = model, tokenizer
        self.sync_every, self.release_after_generate = sync_every, release_after_generate
        self.options = EngineOptions(kv_cache_memory, max_num_seqs, max_prefill_tokens, use_cuda_graphs, compile,
                                     attention, fuse_qkv, fuse_gate_up, sampler, dequantize_4bit, kv_cache,
                                     kv_block_size, keep_runs)
        self.runner = ModelRunner(model, self.options)
        self.last_stats: dict = {}

    @property
    def attention(self) -> str:
        """The attention option as given ("auto", "triton" or "sdpa"); `last_stats["attention"]` says which ran."""
        return self.options.attention

    @property
    def cache(self):
        """The current KV cache (None once released)."""
        return self.runner.cache

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 response_lengths: list[int] | None = None) -> list[Generation]:
        """`response_lengths` (one per sequence, prompt-major, each <= max_new_tokens): cap each response at its own
        length (with `ignore_eos`, force it), as benchmarks of uneven lengths do; like a stop token, a length is
        noticed at the next sync (no sync of its own), and the tokens sampled past it are dropped."""
        self._validate(prompts, params)
        num_sequences = len(prompts) * params.n
        if response_lengths is not None and (len(response_lengths) != num_sequences or not all(
                1 <= length <= params.max_new_tokens for length in response_lengths)):
            raise ValueError(f"response_lengths needs one length in [1, max_new_tokens] per sequence "
                             f"({num_sequences}); got {len(response_lengths)} values.")
        stop_ids = sorted(set(params.stop_token_ids) | set(self._eos_ids(params)))
        num_slots = self.runner.begin(prompts, params, stop_ids, keep=True)  # 1. weights, KV cache, per-slot state
        # Paged: each window's blocks also cover the step launched at the sync after it and the one at the sync
        # before, which ran ahead of the host's plan (`_harvest`).
        scheduler = Scheduler([i // params.n for i in range(num_sequences)], [len(p) for p in prompts], num_slots,
                              self.runner.block_allocator(), self.sync_every + STEPS_AHEAD_ROWS,
                              params.max_new_tokens, response_lengths, limits_at_sync=True)
        results: list[Generation | None] = [None] * num_sequences
        finished = False
        try:
            while scheduler.has_work:
                self.runner.preempt(scheduler.reserve())  # paged: blocks for the next window
                admitted = scheduler.admit()  # 2. admit and prefill
                self.runner.write_blocks(scheduler.blocks.take_writes() if scheduler.blocks else [])
                if admitted:
                    self.runner.prefill(prompts, admitted)
                steps = scheduler.steps_until_sync(self.sync_every, params.max_new_tokens)  # 3. decode
                kv_len = self.runner.kv_len(scheduler.furthest_position() + steps + STEPS_AHEAD_ROWS)
                window = scheduler.batch_size(), kv_len
                self.runner.decode(*window, steps)
                # The smaller batch's step recorded while the GPU runs this window, not when it is due with the GPU
                # idle (layouts without key buckets: with them, the next window's bucket is not known yet).
                if kv_len == 0 and (smaller := scheduler.next_batch_size()):
                    self.runner.capture_decode_ahead(smaller, kv_len)
                self._harvest(scheduler, params, set(stop_ids), results, window)  # 4. sync, harvest, compact
                self.runner.move(scheduler.compaction_moves())
            finished = True
        finally:
            self.runner.record_scheduling(scheduler)
            self.last_stats = self.runner.end(finished, release=self.release_after_generate)  # 5.
        return results

    @torch.no_grad()
    def generate_episodes(self, sessions: list[EnvironmentSession], renderer: ObservationRenderer,
                          params: SamplingParams, budget: EpisodeBudget) -> list[Episode]:
        """One multi-turn `Episode` per session (`rollout/multiturn.py`); `params.max_new_tokens` caps each turn.
        A sequence pauses while its environment steps and resumes on its own KV (`engine/multiturn.py`)."""
        check_episode_request(sessions, params)
        self._validate([[0]], params)
        stop_ids = sorted(set(params.stop_token_ids) | set(self._eos_ids(params)))
        return run_sync(self._episodes(sessions, renderer, params, budget, stop_ids))  # also inside a running loop

    async def _episodes(self, sessions, renderer, params, budget, stop_ids) -> list[Episode]:
        runs = await start_runs(sessions, renderer, budget, set(stop_ids))
        try:
            loop = EpisodeLoop(self, runs, params, stop_ids, budget)
        except BaseException:  # a refused layout: the environments already made are closed all the same
            await close_runs(runs)
            raise
        with torch.no_grad():  # grad mode is per thread, and run_sync may run this on a thread of its own
            return await loop.run()

    def release_memory(self, keep_small: bool = True) -> None:
        """Free the KV cache and CUDA graphs now (a `generate` with `release_after_generate=False` keeps them), except
        a small call's, kept for the next call of its shape (`kept_runs.py`) unless `keep_small=False` or the device
        is short of memory."""
        self.runner.release(keep=keep_small)

    def _harvest(self, scheduler: Scheduler, params: SamplingParams, stop_ids: set[int], results: list,
                 window: tuple[int, int]) -> None:
        """At a sync point: read the slots' progress, turn finished sequences (and those cut by a stop string)
        into `Generation`s and free their slots.

        Once the finished rows are read, one more decode step of the last `window` (batch, kv_len) is launched
        before the host's work here and at the loop's top (harvest, frees, compaction, blocks, admission: about
        2 ms at 512 live sequences), which would otherwise leave the GPU idle at every sync. It is the first step of
        the next window, run with the last window's batch: finished rows in it change nothing (a done slot keeps its
        state; a sequence past its forced length samples a token that is dropped, as within a window), and every
        device operation the host plans next follows it in stream order. The scheduler's lengths stay the
        snapshot's, one behind the device for the rows that ran it; the paged blocks and key lengths cover it
        (`STEPS_AHEAD_ROWS`), and a sequence preempted now keeps the snapshot's tokens (the step's is drawn again
        after its re-admission, from the same uniform)."""
        rows = scheduler.rows_in_use()
        if rows == 0:
            return
        done, gen_len = self.runner.read_progress(rows)
        scheduler.record_progress(gen_len)
        cut = self._stop_string_cut(params)
        running = [slot for slot, s in scheduler.live.items()
                   if not (done[slot] or (s.limit is not None and s.generated >= s.limit))]
        # Without stop strings only the finished rows are read (`harvest` looks at no other).
        ended = list(scheduler.live) if cut else sorted(set(scheduler.live) - set(running))
        tokens = logprobs = None
        if ended:
            tokens, logprobs = self.runner.read_outputs(rows, max(gen_len[slot] for slot in ended),
                                                        None if cut else ended)
        if running:
            self.runner.decode(*window, 1)
        if not ended:
            return
        finished = scheduler.harvest(done, tokens, stop_ids, cut)
        for item in finished:
            results[item.sequence.index] = Generation(item.sequence.prompt_index, tokens[item.slot, :item.length],
                                                      logprobs[item.slot, :item.length], item.reason)
        if finished:
            self.runner.free([item.slot for item in finished])

    def _stop_string_cut(self, params: SamplingParams):
        """How many tokens of a response to keep at its first stop string (None: no stop strings to check)."""
        if not params.stop_strings:
            return None
        return lambda response: find_stop_string(self.tokenizer, response, params.stop_strings)

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
