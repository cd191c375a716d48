"""`SavePredictions`: `python -m yolo5l.val save_txt=true|save_json=true` through `trainer.validate`; `SavedOutputs`:
what val saves besides the metrics, and the score of its COCO results file.

Each rank writes the txt labels of its own images as their batches end; the COCO results entries of every rank are
gathered on global rank 0, which writes the JSON (`yolo5l.eval.save_preds.PredictionSaver` does the formats).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from yolo5l.base.errors import shown_path
from yolo5l.eval.save_preds import CocoIds, PredictionSaver, score_coco_json

__all__ = ["SavePredictions", "SavedOutputs"]


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


class SavedOutputs:
    """What `python -m yolo5l.val` saves besides the metrics, and the score of its COCO results file.

    Args:
        out_dir: The run folder.
        save_txt: Write YOLO txt labels (`labels/`).
        save_conf: Add the score to each txt row.
        save_json: Write `<weights stem>_predictions.json` in COCO's results format.
        anno_json: A COCO instances file for the JSON's ids and its score; None looks for v7.0's
            `<dataset root>/annotations/instances_val2017.json` when validating the val split.
        names: The dataset's class names.
        root: The dataset root.
        split: The split validated.
        weights: The weights file (its stem names the JSON).
        max_det: Detections per image that count in the score.
        image_files: The images validated (called once validation is done).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        save_txt: bool,
        save_conf: bool,
        save_json: bool,
        anno_json: str | os.PathLike[str] | None,
        names: Sequence[str],
        root: Path,
        split: str,
        weights: str,
        max_det: int,
        image_files: Callable[[], Sequence[str | os.PathLike[str]]],
    ) -> None:
        self.out_dir = Path(out_dir)
        self.max_det, self.image_files = max_det, image_files
        ids = None
        if save_json:
            default = Path(root) / "annotations" / "instances_val2017.json"
            if anno_json is not None:
                ids = CocoIds.from_annotations(anno_json, len(names))
            elif split == "val" and default.is_file():
                ids = CocoIds.from_annotations(default, len(names))
            else:
                ids = CocoIds.for_names(names)
        self.ids = ids
        self.saver = PredictionSaver(self.out_dir, save_txt, save_conf, ids) if save_txt or save_json else None
        self.json_name = f"{Path(weights).stem}_predictions.json" if save_json else None
        self.json_path: Path | None = None
        self.score: dict[str, float] = {}
        self._callback: Any = None

    def callbacks(self) -> list[Any]:
        """The Lightning callback that saves during `trainer.validate` (none when nothing is saved)."""
        if self.saver is None:
            return []
        self._callback = SavePredictions(self.saver, self.json_name)
        return [self._callback]

    def finish(self) -> dict[str, float]:
        """Write the JSON (unless the callback did) and score it against the annotations file when there is one.

        Returns:
            {"coco/map", "coco/map_50"} from the annotations file, or {}.
        """
        if self.saver is None or self.json_name is None:
            return {}
        self.json_path = self._callback.json_path if self._callback is not None else None
        if self.json_path is None:
            self.json_path = self.saver.write_json(self.json_name)
        if self.ids is None or self.ids.annotations is None or self.ids.image_ids is None:
            return {}
        known = set(self.ids.image_ids.values())
        validated = [i for i in (self.ids.image_id(p) for p in self.image_files()) if i in known]
        self.score = score_coco_json(self.ids.annotations, self.json_path, validated, self.max_det)
        print(
            f"COCO results scored against {self.ids.annotations.name} (faster-coco-eval, pycocotools' algorithm): "
            f"mAP@0.5:0.95 {self.score['coco/map']:.4f}, mAP@0.5 {self.score['coco/map_50']:.4f}"
        )
        return dict(self.score)

    def outputs(self) -> dict[str, str | None]:
        """Entries for the run's output listing."""
        if self.saver is None:
            return {}
        labels = self.out_dir / "labels"
        return {
            "YOLO txt": f"{self.saver.txt_files} files in {shown_path(labels)}" if self.saver.save_txt else None,
            "COCO json": shown_path(self.json_path) if self.json_path is not None else None,
        }
