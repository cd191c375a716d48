"""Saved predictions of `python -m yolo5l.val`: YOLO txt labels, hybrid labels and a COCO results JSON.

- `save_txt=true`: `labels/<image stem>.txt` with one `class cx cy w h` row per detection (normalised to the original
  image, `%g` format), `save_conf=true` adds the score; an image without detections gets no file.
- `save_hybrid=true`: the image's labels join the NMS candidates at score 1 (`with_label_candidates`), so the txt
  files hold the labels plus the predictions that do not overlap them: labels for a dataset, made from a model.
- `save_json=true`: `<weights stem>_predictions.json` in COCO's results format (`image_id`, `category_id`, `bbox`
  as top-left x, y, width, height in original pixels, `score`). Image ids and category ids come from the COCO
  annotations file when there is one (`CocoIds.from_annotations`), else as v7.0 makes them: a numeric file stem is
  the id (`000000000139.jpg` -> 139), another stem is itself, and COCO's 80 classes map to its 91 category ids.

Reference: ultralytics/yolov5 v7.0 `val.py::save_one_txt`, `save_one_json`, `run` (the `--save-hybrid` labels in
`utils/general.py::non_max_suppression`, the pycocotools evaluation), `utils/general.py::coco80_to_coco91_class`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from yolo5l.base.errors import UserError
from yolo5l.base.files import atomic_write

__all__ = [
    "CocoIds",
    "PredictionSaver",
    "coco_entries",
    "score_coco_json",
    "txt_lines",
    "with_label_candidates",
]


def with_label_candidates(decoded: Tensor, targets: Tensor, img_hw: Sequence[int]) -> Tensor:
    """Append each image's labels to its decoded boxes as candidates of objectness 1 and class score 1.

    NMS then keeps every label (score 1 beats every prediction) and drops the predictions that overlap one of the
    same class. Images with fewer labels than the most-labelled one get all-zero rows, which no threshold passes.

    Args:
        decoded: (B, N, 5 + C) decoded boxes in the batch's pixels.
        targets: (M, 6) labels [image index, class, cx, cy, w, h], normalised to the batch's (letterboxed) size.
        img_hw: The batch's (height, width).

    Returns:
        (B, N + L, 5 + C), L the most labels of an image in the batch.
    """
    bsz, _, no = decoded.shape
    if targets.shape[0] == 0:
        return decoded
    t = targets[torch.argsort(targets[:, 0], stable=True)]
    img = t[:, 0].long()
    counts = torch.bincount(img, minlength=bsz)
    rank = torch.arange(t.shape[0], device=t.device) - (torch.cumsum(counts, 0) - counts)[img]
    extra = decoded.new_zeros(bsz, int(counts.max()), no)  # host sync: the most labels of an image (validation only)
    h, w = img_hw[0], img_hw[1]
    rows = decoded.new_zeros(t.shape[0], no)
    rows[:, :4] = t[:, 2:6].to(decoded.dtype) * torch.tensor([w, h, w, h], device=t.device, dtype=decoded.dtype)
    rows[:, 4] = 1.0
    rows[torch.arange(t.shape[0], device=t.device), 5 + t[:, 1].long()] = 1.0
    extra[img, rank] = rows
    return torch.cat((decoded, extra), 1)


def _fmt(values: Sequence[float]) -> str:
    return " ".join(f"{v:g}" for v in values)


def txt_lines(dets: Tensor, img_hw: Sequence[int], save_conf: bool) -> list[str]:
    """YOLO label rows `class cx cy w h [score]` (normalised to `img_hw`) of (n, 6) [x1, y1, x2, y2, score, class]
    detections in that image's pixels."""
    h, w = float(img_hw[0]), float(img_hw[1])
    out = []
    for x1, y1, x2, y2, score, cls in dets.tolist():
        row = [cls, (x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h]
        out.append(_fmt([*row, score] if save_conf else row))
    return out


def coco_entries(dets: Tensor, image_id: int | str, category_ids: Sequence[int]) -> list[dict[str, Any]]:
    """COCO results entries of (n, 6) [x1, y1, x2, y2, score, class] detections in original pixels."""
    return [
        {
            "image_id": image_id,
            "category_id": int(category_ids[int(cls)]),
            "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)],
            "score": round(score, 5),
        }
        for x1, y1, x2, y2, score, cls in dets.tolist()
    ]


@dataclass
class CocoIds:
    """How a dataset's images and classes are named in COCO JSON files.

    Attributes:
        category_ids: The category id of each class.
        image_ids: Image file name -> id, from an annotations file; None names images by their stem.
        annotations: The annotations file they came from, if any.
    """

    category_ids: list[int]
    image_ids: dict[str, int] | None = None
    annotations: Path | None = None

    def image_id(self, path: str | os.PathLike[str]) -> int | str:
        """The id of an image: from the annotations file, else its stem, as an int when it is a number."""
        p = Path(path)
        if self.image_ids is not None and p.name in self.image_ids:
            return self.image_ids[p.name]
        return int(p.stem) if p.stem.isnumeric() else p.stem

    @classmethod
    def for_names(cls, names: Sequence[str]) -> CocoIds:
        """Ids without an annotations file: COCO's 91-id numbering for COCO's 80 classes, else the class index."""
        from yolo5l.data.coco2yolo import COCO80_TO_91, COCO_NAMES

        return cls(list(COCO80_TO_91) if tuple(names) == COCO_NAMES else list(range(len(names))))

    @classmethod
    def from_annotations(cls, path: str | os.PathLike[str], num_classes: int) -> CocoIds:
        """Ids from a COCO instances file, with its categories mapped to classes as `yolo5l.data.coco2yolo` does.

        Raises:
            UserError: The file is missing, not COCO instances JSON, or has another number of categories.
        """
        from yolo5l.data.coco2yolo import _category_mapping

        path = Path(path)
        try:
            coco = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"anno_json={path}: cannot read it as JSON ({e}): pass a COCO instances file") from None
        if not isinstance(coco, dict) or not {"images", "categories"} <= coco.keys():
            raise UserError(f"anno_json={path}: not a COCO instances file (it needs 'images' and 'categories')")
        mapping, _ = _category_mapping(coco["categories"])
        if len(mapping) != num_classes:
            raise UserError(
                f"anno_json={path} has {len(mapping)} categories but the dataset {num_classes} classes: pass the "
                "annotations the dataset was converted from"
            )
        category_ids = [cid for cid, _ in sorted(mapping.items(), key=lambda kv: kv[1])]
        images = {Path(str(im["file_name"])).name: im["id"] for im in coco["images"]}
        return cls(category_ids, images, path)


class PredictionSaver:
    """Write the txt labels of each validated image and collect its COCO results entries.

    Args:
        out_dir: The run folder (`labels/` goes there).
        save_txt: Write `labels/<stem>.txt` per image with detections.
        save_conf: Add the score to each txt row.
        ids: Image and category ids for the JSON; None writes no JSON.
    """

    def __init__(self, out_dir: str | os.PathLike[str], save_txt: bool, save_conf: bool, ids: CocoIds | None) -> None:
        self.out_dir = Path(out_dir)
        self.save_txt, self.save_conf, self.ids = save_txt, save_conf, ids
        self.entries: list[dict[str, Any]] = []
        self.txt_files = 0

    def add(self, dets: Sequence[Tensor], paths: Sequence[str], shapes: Sequence[Any]) -> None:
        """One batch: (n, 6) detections in original pixels per image, the image paths and the batch's shapes
        (`shapes[i][0]` is the original (height, width))."""
        for det, path, shape in zip(dets, paths, shapes, strict=True):
            det = det.detach().float().cpu()
            if self.save_txt and det.shape[0]:
                lines = txt_lines(det, shape[0], self.save_conf)
                atomic_write(self.out_dir / "labels" / f"{Path(path).stem}.txt", "".join(f"{ln}\n" for ln in lines))
                self.txt_files += 1
            if self.ids is not None:
                self.entries += coco_entries(det, self.ids.image_id(path), self.ids.category_ids)

    def write_json(self, name: str) -> Path:
        """Write the collected entries as `<out_dir>/<name>`; returns the path."""
        return atomic_write(self.out_dir / name, json.dumps(self.entries))


def score_coco_json(anno_json: Path, pred_json: Path, image_ids: Sequence[int | str], max_det: int) -> dict[str, float]:
    """Score a results file against COCO annotations with faster-coco-eval (pycocotools' algorithm).

    Only `image_ids` (the images validated) count; up to `max_det` detections per image, as yolo5l's own metric.

    Returns:
        {"coco/map": mAP@0.5:0.95, "coco/map_50": mAP@0.5}; both 0 when the results file is empty.
    """
    from faster_coco_eval import COCO, COCOeval_faster

    entries = json.loads(pred_json.read_text())
    if not entries:
        return {"coco/map": 0.0, "coco/map_50": 0.0}
    gt = COCO(str(anno_json))
    evaluator = COCOeval_faster(gt, gt.loadRes(entries), "bbox", print_function=lambda *a, **k: None)
    evaluator.params.imgIds = list(image_ids)
    evaluator.params.maxDets = [1, 10, max_det]
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return {"coco/map": float(evaluator.stats[0]), "coco/map_50": float(evaluator.stats[1])}
