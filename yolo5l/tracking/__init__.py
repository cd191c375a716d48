"""Watching runs: the per-epoch CSV logger, MLflow / W&B set-up and artifacts, and the hyperparameter search's
Hydra callback."""
