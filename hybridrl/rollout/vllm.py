"""`VLLMBackend`: vLLM behind the `RolloutBackend` interface, for users who have vLLM installed.

UNTESTED: vLLM is not installed on the project's machines, so this adapter has never run here. It
follows vLLM's documented offline API (`LLM.generate` with token-id prompts, `SamplingParams` with
`logprobs=0` for the sampled token's log-prob). Unlike the built-in engine, vLLM keeps its own copy
of the weights: call `load_weights(model)` after each optimizer step (a copy, and it costs memory).

vLLM is imported only inside this module, so `import hybridrl` never needs it.
"""

from __future__ import annotations

from hybridrl.config.schema import MissingExtra
from hybridrl.rollout.base import Generation, SamplingParams

INSTALL_HINT = "the vllm rollout backend needs vLLM: pip install 'hybridrl[vllm]'"


def _import_vllm():
    try:
        import vllm
    except ImportError as error:
        raise MissingExtra(INSTALL_HINT) from error
    return vllm


class VLLMBackend:
    """Generate with a vLLM engine built from `model_path` (a local directory or hub name vLLM can load).

    gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache).
    llm_kwargs: passed to `vllm.LLM` unchanged (e.g. dtype, enable_sleep_mode, tensor_parallel_size).
    """

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.3, **llm_kwargs) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sampling = self._vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, min_p=params.min_p,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None, include_stop_str_in_output=True,
            seed=params.seed, ignore_eos=params.ignore_eos, logprobs=0,
        )
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        generations = []
        for prompt_index, request in enumerate(outputs):
            for completion in request.outputs:
                token_ids = list(completion.token_ids)
                # logprobs=0 returns, per position, a dict that holds at least the sampled token.
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], token_ids)]
                reason = "stop" if completion.finish_reason == "stop" else "length"
                generations.append(Generation(prompt_index, token_ids, logprobs, reason))
        return generations

    def load_weights(self, model) -> None:
        """Copy the trainer's current weights into vLLM's model (vLLM owns a separate copy)."""
        # The path to the executor's model has moved between vLLM releases; this is the documented
        # collective_rpc route of recent versions.
        state = [(name, tensor) for name, tensor in model.state_dict().items()]
        self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(state))

    def release_memory(self) -> None:
        """Free vLLM's KV cache where the installed vLLM supports sleep mode (LLM(enable_sleep_mode=True))."""
        sleep = getattr(self.llm, "sleep", None)
        if sleep is not None:
            try:
                sleep(level=1)
            except (RuntimeError, ValueError, AssertionError):
                pass  # sleep mode not enabled for this engine: nothing to release

    def wake_up(self) -> None:
        wake = getattr(self.llm, "wake_up", None)
        if wake is not None:
            wake()
