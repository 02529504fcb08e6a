"""Write a tiny random Qwen2 reward model (sequence classification, one label) with the tiny actor's
tokenizer to DIR: the stand-in reward model of the placement runs (`two_gpu_runs.sh`, `node_runs.sh`).

    python -m benchmarks.tiny_reward_model DIR
"""

import sys

from transformers import AutoModelForSequenceClassification, Qwen2Config

from hybridrl.models.loading import build_tiny_model

if len(sys.argv) != 2:
    sys.exit("usage: python -m benchmarks.tiny_reward_model DIR")
tiny = build_tiny_model("qwen2", seed=0)
config = Qwen2Config(vocab_size=tiny.model.config.vocab_size, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                     pad_token_id=tiny.tokenizer.pad_token_id)
AutoModelForSequenceClassification.from_config(config).save_pretrained(sys.argv[1])
tiny.tokenizer.save_pretrained(sys.argv[1])
print(f"tiny reward model written to {sys.argv[1]}")
