"""Time yolo5l's AutoAnchor check (`yolo5l.training.autoanchor.check_anchors`) against ultralytics/yolov5 v7.0's
(`utils/autoanchor.py::check_anchors`, run from the `yolov5==7.0.14` package) on the same labels.

Two label sets: the thin boxes of issue 23 (vertical and horizontal bars 2-5 px wide, 60-300 px long, 640 px images,
~600 boxes) and ~100k boxes with log-normal sizes at 320 px. For each: seconds, BPR before and after, anchors per
target after. The reference runs in its own interpreter (`--reference path/to/python` with yolov5==7.0.14 installed),
fed the labels through an .npz file.

Usage: ``python scripts/bench_autoanchor.py [--reference .refvenv/bin/python] [--images 12500]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from yolo5l.models.yolo import ANCHORS_P3_P5
from yolo5l.training.autoanchor import anchor_metrics, check_anchors, label_wh

# Runs in the reference interpreter: v7.0's check_anchors on a stand-in dataset (shapes (w, h), labels per image).
_REFERENCE = """
import json, os, random, sys, time
import numpy as np, torch
import yolov5
from yolov5.models.yolo import Model
from yolov5.utils.autoanchor import check_anchors
z = np.load(sys.argv[1])
class Data: pass
ds = Data()
ds.shapes = z["shapes_hw"][:, ::-1].astype(float)
ds.labels = np.split(z["labels"], np.cumsum(z["counts"])[:-1])
model = Model(os.path.join(os.path.dirname(yolov5.__file__), "models", "yolov5s.yaml"))
np.random.seed(0); random.seed(0); torch.manual_seed(0)
t = time.perf_counter()
check_anchors(ds, model=model, thr=4.0, imgsz=int(sys.argv[2]))
m = model.model[-1]
print(json.dumps({"seconds": time.perf_counter() - t,
                  "anchors": (m.anchors * m.stride.view(-1, 1, 1)).reshape(-1, 2).tolist()}))
"""


def thin_boxes(images: int = 100, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = []
    for _ in range(images):
        rows = []
        for _ in range(rng.integers(3, 10)):
            a, b = rng.uniform(2, 5) / 640, rng.uniform(60, 300) / 640
            w, h = (a, b) if rng.random() < 0.5 else (b, a)
            rows.append([0, 0.5, 0.5, w, h])
        labels.append(np.asarray(rows, np.float32))
    return labels, np.full((images, 2), 640)


def lognormal_boxes(images: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = []
    for _ in range(images):
        n = int(rng.integers(1, 15))
        wh = np.exp(rng.normal(np.log(0.15), 1.0, (n, 2))).clip(0.003, 1)
        labels.append(np.c_[np.zeros(n), np.full((n, 2), 0.5), wh].astype(np.float32))
    return labels, np.tile([480, 640], (images, 1))


def _reference(python: str, labels: list[np.ndarray], shapes_hw: np.ndarray, imgsz: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "labels.npz"
        np.savez(path, labels=np.concatenate(labels), counts=[len(lb) for lb in labels], shapes_hw=shapes_hw)
        r = subprocess.run(
            [python, "-c", _REFERENCE, str(path), str(imgsz)], capture_output=True, text=True, timeout=3600
        )
    if r.returncode:
        raise SystemExit(f"the reference failed (is yolov5==7.0.14 installed for {python}?):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="a Python interpreter with yolov5==7.0.14 (v7.0's code)")
    parser.add_argument("--images", type=int, default=12500, help="images of the log-normal set (~7.5 boxes each)")
    args = parser.parse_args()
    coco = torch.tensor(ANCHORS_P3_P5, dtype=torch.float32).reshape(3, 3, 2)
    for name, (labels, shapes), imgsz in (
        ("thin boxes", thin_boxes(), 640),
        ("log-normal boxes", lognormal_boxes(args.images), 320),
    ):
        t = time.perf_counter()
        result = check_anchors(coco, labels, shapes, imgsz)
        ours = time.perf_counter() - t
        wh = label_wh(labels, shapes, imgsz)
        after = result.anchors if result.anchors is not None else coco
        bpr, aat = anchor_metrics(wh, after)
        line = f"{name} ({len(wh)} boxes at {imgsz} px): BPR {result.bpr:.3f} -> {bpr:.3f}, {aat:.2f} anchors/target"
        print(f"{line}; yolo5l {ours:.2f} s")
        if args.reference:
            ref = _reference(args.reference, labels, shapes, imgsz)
            rbpr, raat = anchor_metrics(wh, torch.tensor(ref["anchors"]))
            print(f"  v7.0: BPR -> {rbpr:.3f}, {raat:.2f} anchors/target; {ref['seconds']:.2f} s "
                  f"({ref['seconds'] / ours:.0f}x yolo5l's time)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
