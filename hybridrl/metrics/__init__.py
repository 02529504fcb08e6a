"""Metrics: sinks for console, JSONL, TensorBoard and W&B (`sinks.py`) and training-curve plots (`plot.py`)."""
