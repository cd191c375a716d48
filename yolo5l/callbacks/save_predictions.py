"""`SavePredictions`: `python -m yolo5l.val save_txt=true|save_json=true` through `trainer.validate`.

Each rank writes the txt labels of its own images as their batches end; the COCO results entries of every rank are
gathered on global rank 0, which writes the JSON (`yolo5l.save_preds.PredictionSaver` does the formats).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from yolo5l.save_preds import PredictionSaver

__all__ = ["SavePredictions"]


class SavePredictions(Callback):
    """Save what `validation_step` returns (per-image detections in original pixels) as txt labels and COCO JSON.

    Args:
        saver: Where and what to write.
        json_name: The JSON file's name in the run folder; None writes none.
    """

    def __init__(self, saver: PredictionSaver, json_name: str | None) -> None:
        self.saver = saver
        self.json_name = json_name
        #: The JSON written by the last validation (global rank 0), for the entry point's report.
        self.json_path: Path | None = None

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        _, _, paths, shapes = batch
        self.saver.add(outputs, paths, shapes)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.json_name is None:
            return
        entries = self.saver.entries
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, entries)  # a collective: every rank calls it
            entries = [e for part in gathered for e in part]
        if trainer.is_global_zero:
            self.saver.entries = entries
            self.json_path = self.saver.write_json(self.json_name)
