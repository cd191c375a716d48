"""Watching runs: the per-epoch CSV logger, TensorBoard's extras, MLflow / W&B / Comet / ClearML set-up and
artifacts, and evolve's files (evolve.csv, evolve.png)."""
