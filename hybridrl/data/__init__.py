"""Data and tasks: prompt and SFT data sets with their checks (`datasets.py`), and the synthetic verifiable
tasks the demo and tests train on (`tasks.py`)."""

from hybridrl.data.datasets import DataError, PromptDataset, SFTDataset

__all__ = ["DataError", "PromptDataset", "SFTDataset"]
