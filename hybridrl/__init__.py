"""hybridrl: reinforcement-learning post-training for language models, fast and lean on small GPU budgets."""

__version__ = "0.1.0"
