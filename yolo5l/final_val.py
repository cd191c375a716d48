"""The closing validation of a training run on `best.pt`'s weights.

YOLOv5's train.py ends by validating best.pt, with the per-class table and the plots; yolo5l's last validation runs
on the last EMA weights, so when the best validation was an earlier one, `validate_best` validates best.pt's weights
again and the closing table and plots (`ValidationPlots`) become the best weights'.

Reference: ultralytics/yolov5 v7.0 `train.py::train` (the end: `validate.run(model=attempt_load(best), verbose=True,
plots=plots, ...)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["validate_best"]


def validate_best(trainer: Any, module: Any, datamodule: Any) -> dict[str, float] | None:
    """Validate best.pt's weights after `trainer.fit` when the best validation was not the last one.

    Every rank calls it (the validation is a collective); global rank 0 reads best.pt and broadcasts its weights,
    which replace the module's (training is over; weights.pt was written before). The loggers are off for it: the
    per-epoch tables keep one row per epoch, and the table and plots go to files only (TensorBoard keeps the last
    validation's images; its writer is closed once fit ends). Nothing runs when the run had no best.pt (no
    `LastCheckpoint`, or no validation), when its last validation was the best one (its table and plots stand), or
    after an interrupted fit.

    Args:
        trainer: The trainer that ran the fit.
        module: Its `YOLOv5Module`.
        datamodule: Its datamodule.

    Returns:
        The `val/*` metrics of best.pt, or None when nothing ran.
    """
    import torch

    from yolo5l.callbacks.checkpoint import LastCheckpoint
    from yolo5l.callbacks.val_summary import ValidationSummary

    ckpt = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, LastCheckpoint)), None)
    summary = next((cb for cb in trainer.callbacks if isinstance(cb, ValidationSummary)), None)
    if ckpt is None or ckpt.best_epoch is None or summary is None or summary.last is None or trainer.interrupted:
        return None
    if ckpt.best_epoch == summary.last["epoch"]:
        return None
    path = Path(ckpt.dirpath) / "best.pt"
    state = None
    if trainer.is_global_zero:
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"validating {path} (epoch {ckpt.best_epoch}, the best fitness) for the closing table and plots")
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    state = trainer.strategy.broadcast(state, src=0)
    module.model.load_state_dict(state)  # half-precision tensors are copied into the model's float32 ones
    loggers = trainer.loggers
    trainer.loggers = []
    try:
        results = trainer.validate(module, datamodule=datamodule, verbose=False)
    finally:
        trainer.loggers = loggers
    return {k: float(v) for k, v in results[0].items()} if results else {}
