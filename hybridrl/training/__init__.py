"""Training: the RL trainer and its phases (rollout batch, log-probs, update), packing and shared prompts, the
optimizer, the train<->generate phase switch, component building, and SFT."""
