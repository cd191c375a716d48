"""Convert COCO JSON instance annotations to the YOLO layout, or write the data yaml of a YOLO-format COCO.

Conversion (``--json instances_train2017.json --images train2017/ --out datasets/coco``) writes:

- ``<out>/labels/<split>/<image stem>.txt``: one ``cls cx cy w h`` row per box, normalised. Categories map to
  0..79 in the standard order when the JSON holds COCO's 80 categories (ids 1..90 with gaps), otherwise to
  0..K-1 in the order of their sorted ids. Crowd boxes (``iscrowd=1``) are dropped; boxes are clipped to the
  image and dropped when nothing is left. Images without annotations get an **empty** label file (an explicit
  background, counted as "empty" by the label scan; a missing file would read as "not labelled").
- ``<out>/images/<split>``: a symlink to ``--images`` (a copy where symlinks are unavailable), so that the
  label of every image is found by replacing ``/images/`` with ``/labels/``; nothing is linked when
  ``--images`` already is that folder.
- ``<out>/<split>.txt``: the image list (``./images/<split>/<file>``), images missing on disk left out.
- ``<out>/data.yaml``: ``path: .``, names, and the split under ``train`` or ``val`` (``val`` when the split
  name contains "val"), merged with an existing data.yaml so that converting train then val yields both.

``--write-yaml coco`` / ``--write-yaml coco128`` writes ``<out>/data.yaml`` for ultralytics' ready-made
YOLO-format downloads (``get_coco.sh`` layout; coco128 trains and validates on ``images/train2017``).

Reference: ultralytics JSON2YOLO ``convert_coco`` and yolov5 ``coco80_to_coco91_class`` (behaviour only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from yolo5l.base.files import atomic_write
from yolo5l.data.box_format import xyxy_to_xywhn
from yolo5l.data.layout import DATA_YAML, IMAGES_DIR, LABEL_SUFFIX, LABELS_DIR, LIST_SUFFIX, format_labels

__all__ = [
    "COCO80_TO_91",
    "COCO91_TO_80",
    "COCO_NAMES",
    "PRESETS",
    "ConvertResult",
    "convert_coco_json",
    "main",
    "write_yaml",
]

COCO_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)  # fmt: skip
# COCO's 80 category ids (1..90 with 10 unused ids), index = YOLO class.
COCO80_TO_91 = (
    *range(1, 12),
    *range(13, 26),
    27,
    28,
    *range(31, 45),
    *range(46, 66),
    67,
    70,
    *range(72, 83),
    *range(84, 91),
)
COCO91_TO_80 = {cid: i for i, cid in enumerate(COCO80_TO_91)}

PRESETS: dict[str, dict[str, Any]] = {
    "coco": {"train": "train2017.txt", "val": "val2017.txt"},
    "coco128": {"train": "images/train2017", "val": "images/train2017"},
}
_DOWNLOAD_HINT = (
    "Put COCO in YOLO format here (ultralytics' get_coco.sh layout) or convert the official annotations with "
    "`python -m yolo5l.data.coco2yolo --json instances_<split>.json --images <image folder> --out <this folder>`."
)


@dataclass
class ConvertResult:
    """What a conversion wrote.

    Attributes:
        split: Split name (e.g. ``train2017``).
        images: Images listed in ``<split>.txt``.
        boxes: Label rows written.
        backgrounds: Images without any kept box (empty label files).
        crowd: Crowd annotations dropped.
        degenerate: Boxes dropped because nothing was left after clipping.
        unknown_category: Annotations of a category outside the mapping, dropped.
        missing_images: Images of the JSON not found in the image folder, left out.
        yaml_path: The data yaml written.
    """

    split: str
    images: int = 0
    boxes: int = 0
    backgrounds: int = 0
    crowd: int = 0
    degenerate: int = 0
    unknown_category: int = 0
    missing_images: int = 0
    yaml_path: Path | None = None

    def summary(self) -> str:
        """One line with every count."""
        return (
            f"{self.split}: {self.images} images, {self.boxes} boxes, {self.backgrounds} backgrounds; dropped "
            f"{self.crowd} crowd, {self.degenerate} degenerate, {self.unknown_category} unknown-category boxes; "
            f"{self.missing_images} images missing on disk; yaml {self.yaml_path}"
        )


def _category_mapping(categories: Sequence[Mapping[str, Any]]) -> tuple[dict[int, int], list[str]]:
    ids = sorted(int(c["id"]) for c in categories)
    if set(ids) <= set(COCO80_TO_91) and len(ids) > len(COCO80_TO_91) // 2:
        return dict(COCO91_TO_80), list(COCO_NAMES)  # COCO's own categories: the standard 80-class order
    names_by_id = {int(c["id"]): str(c.get("name", c["id"])) for c in categories}
    return {cid: i for i, cid in enumerate(ids)}, [names_by_id[cid] for cid in ids]


def _merge_yaml(yaml_path: Path, names: Sequence[str], updates: Mapping[str, Any], download: str | None) -> None:
    data: dict[str, Any] = {}
    if yaml_path.is_file():
        loaded = yaml.safe_load(yaml_path.read_text())
        data = loaded if isinstance(loaded, dict) else {}
    data["path"] = "."
    data.update(updates)
    data["names"] = dict(enumerate(names))
    if download:
        data["download"] = download
    ordered = {k: data[k] for k in ("path", "train", "val") if k in data}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    atomic_write(yaml_path, yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True))


def _link_images(images: Path, target: Path) -> None:
    if target.exists() or target.is_symlink():
        if target.resolve() == images.resolve():
            return
        raise FileExistsError(
            f"{target} already exists and is not the image folder {images}: remove it or choose another --out."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        target.symlink_to(images.resolve(), target_is_directory=True)
    except OSError:  # no symlinks (Windows without developer mode): copy
        shutil.copytree(images, target)


def convert_coco_json(
    json_path: str | os.PathLike, images: str | os.PathLike, out: str | os.PathLike, split: str | None = None
) -> ConvertResult:
    """Convert one COCO instances JSON to YOLO labels, an image list and a data yaml (see the module docstring).

    Args:
        json_path: COCO ``instances_<split>.json``.
        images: Folder holding the split's images.
        out: Dataset folder to write into.
        split: Split name; default from the JSON name (``instances_train2017.json`` -> ``train2017``).

    Returns:
        The counts of what was written.

    Raises:
        FileNotFoundError: The JSON or the image folder is missing.
        ValueError: The JSON is not COCO instances format.
    """
    json_path, images, out = Path(json_path), Path(images), Path(out)
    if not json_path.is_file():
        raise FileNotFoundError(f"COCO annotation file {json_path} not found (--json).")
    if not images.is_dir():
        raise FileNotFoundError(f"Image folder {images} not found (--images): pass the folder of the split's images.")
    split = split or json_path.stem.removeprefix("instances_")
    with open(json_path, encoding="utf-8") as f:
        coco = json.load(f)
    if not isinstance(coco, dict) or not {"images", "annotations", "categories"} <= coco.keys():
        raise ValueError(f"{json_path} is not a COCO instances file (needs images, annotations, categories).")
    mapping, names = _category_mapping(coco["categories"])
    result = ConvertResult(split)

    anns = defaultdict(list)
    for a in coco["annotations"]:
        anns[a["image_id"]].append(a)

    img_dir = out / IMAGES_DIR / split
    if img_dir.resolve() != images.resolve():
        _link_images(images, img_dir)
    label_dir = out / LABELS_DIR / split
    label_dir.mkdir(parents=True, exist_ok=True)
    listed = []
    for im in sorted(coco["images"], key=lambda im: im["file_name"]):
        file_name = Path(im["file_name"]).name
        if not (images / file_name).is_file():
            result.missing_images += 1
            continue
        w, h = float(im["width"]), float(im["height"])
        classes, corners = [], []
        for a in anns.get(im["id"], ()):
            if a.get("iscrowd", 0):
                result.crowd += 1
                continue
            cls = mapping.get(int(a["category_id"]))
            if cls is None:
                result.unknown_category += 1
                continue
            x, y, bw, bh = (float(v) for v in a["bbox"])  # top-left x, y, width, height in pixels
            x1, y1 = min(max(x, 0.0), w), min(max(y, 0.0), h)
            x2, y2 = min(max(x + bw, 0.0), w), min(max(y + bh, 0.0), h)
            if x2 - x1 <= 0 or y2 - y1 <= 0:
                result.degenerate += 1
                continue
            classes.append(cls)
            corners.append((x1, y1, x2, y2))
        xywhn = xyxy_to_xywhn(np.asarray(corners, np.float64).reshape(-1, 4), w, h, clip=False)
        rows = [(c, *box) for c, box in zip(classes, xywhn.tolist(), strict=True)]
        (label_dir / f"{Path(file_name).stem}{LABEL_SUFFIX}").write_text(format_labels(rows))
        listed.append(f"./{IMAGES_DIR}/{split}/{file_name}")
        result.images += 1
        result.boxes += len(rows)
        result.backgrounds += not rows
    (out / f"{split}{LIST_SUFFIX}").write_text("".join(p + "\n" for p in listed))
    key = "val" if "val" in split else "train"
    result.yaml_path = out / DATA_YAML
    _merge_yaml(result.yaml_path, names, {key: f"{split}{LIST_SUFFIX}"}, None)
    return result


def write_yaml(preset: str, out: str | os.PathLike) -> Path:
    """Write ``<out>/data.yaml`` for a ready-made YOLO-format ``coco`` or ``coco128`` download.

    Args:
        preset: ``coco`` or ``coco128``.
        out: The dataset folder.

    Returns:
        The yaml path.
    """
    if preset not in PRESETS:
        raise ValueError(f"--write-yaml takes one of {sorted(PRESETS)}, got {preset!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / DATA_YAML
    _merge_yaml(path, COCO_NAMES, PRESETS[preset], _DOWNLOAD_HINT)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``python -m yolo5l.data.coco2yolo --json ... --images ... --out ...``."""
    p = argparse.ArgumentParser(description="Convert COCO JSON annotations to YOLO labels (see the module docstring).")
    p.add_argument("--json", type=Path, help="COCO instances JSON, e.g. annotations/instances_train2017.json")
    p.add_argument("--images", type=Path, help="folder of the split's images, e.g. train2017/")
    p.add_argument("--out", type=Path, required=True, help="dataset folder to write (labels/, <split>.txt, data.yaml)")
    p.add_argument("--split", help="split name (default: from the JSON name)")
    p.add_argument("--write-yaml", choices=sorted(PRESETS), help="only write data.yaml for a YOLO-format download")
    a = p.parse_args(argv)
    if a.write_yaml:
        print(write_yaml(a.write_yaml, a.out))
        return
    if a.json is None or a.images is None:
        p.error("--json and --images are required (or --write-yaml)")
    print(convert_coco_json(a.json, a.images, a.out, a.split).summary())


if __name__ == "__main__":
    main()
