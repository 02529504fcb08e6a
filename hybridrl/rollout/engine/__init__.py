"""The built-in rollout engine for the Llama family: `backend.py` (the `generate` loop), `multiturn.py` (the loop of
`generate_episodes`: sequences pause while their environments step and resume on their own KV), `scheduler.py` (pure-Python
sequences <-> slots bookkeeping), `runner.py` (the tensors: KV cache, per-slot state, compiled pieces) with
`graphs.py` (CUDA graphs and their warm-ups), `weights.py` (references to the model's tensors), `llama_forward.py`
(the forward), `kv_cache.py`, `decode_state.py`, `sampling.py`, and `kernel_choices.py` (which kernels run)."""
