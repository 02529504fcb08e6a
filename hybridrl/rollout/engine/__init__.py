"""The built-in rollout engine for the Llama family: a pure-Python scheduler over sequences and slots, the
KV cache, the forward over the actor's own tensors, on-device sampling, and the backend that drives them."""
