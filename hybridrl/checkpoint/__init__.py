"""Checkpoints: atomic, checksummed step checkpoints and exact resume (`store.py`), sharded optimizer
moments in them (`sharded_offload.py`), and export to a Hugging Face model directory (`export.py`)."""
