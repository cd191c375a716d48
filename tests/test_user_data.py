"""A dataset of one's own, trained as YOLOv5 v7.0's `train.py --data my.yaml`: 640 px and no cache unless asked (the
synthetic preset's 320 px / RAM cache are for the synthetic data only), a note when training from scratch, and, run
as a user runs it, AutoAnchor re-fitting a fine-tune's anchors with the run folder's files written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def write_thin_dataset(root: Path, n_train: int = 12, n_val: int = 4, size: int = 64, seed: int = 0) -> Path:
    """Two classes of thin bars (1-2% of the image wide, 40-80% long) on dark noise; returns the data.yaml."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            img = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            rows = []
            for _ in range(4):
                a, b = rng.uniform(0.01, 0.02), rng.uniform(0.4, 0.8)
                vertical = rng.random() < 0.5
                w, h = (a, b) if vertical else (b, a)
                cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
                x1, y1 = int((cx - w / 2) * size), int((cy - h / 2) * size)
                x2, y2 = int((cx + w / 2) * size), int((cy + h / 2) * size)
                img[y1 : y2 + 1, x1 : x2 + 1] = 230
                rows.append(f"{int(vertical)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
            cv2.imwrite(str(root / "images" / split / f"{i}.jpg"), img)
            (root / "labels" / split / f"{i}.txt").write_text("\n".join(rows) + "\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: [horizontal, vertical]\n")
    return data


def _compose(tmp_path: Path, *overrides: str):
    from yolo5l.config import compose_config

    return compose_config(list(overrides), output_dir=tmp_path / "run")


def test_data_file_alone_gets_yolov5s_640_px_and_no_cache(tmp_path):
    own = _compose(tmp_path, "data.file=my.yaml").data
    assert (own.imgsz, own.cache) == (640, "none")
    synthetic = _compose(tmp_path).data
    assert (synthetic.imgsz, synthetic.cache) == (320, "ram")  # the generated shapes keep their preset
    explicit = _compose(tmp_path, "data.file=my.yaml", "data.imgsz=416", "data.cache=disk").data
    assert (explicit.imgsz, explicit.cache) == (416, "disk")
    coco128 = _compose(tmp_path, "data=coco128").data
    assert (coco128.imgsz, coco128.cache) == (640, "ram")


def test_a_saved_synthetic_config_still_gives_its_image_size():
    from yolo5l.models.weights import _resolved_imgsz

    preset = {"file": None, "imgsz": "${if_file:${.file},640,320}", "hyp": "${hyp}"}
    assert _resolved_imgsz({"data": preset}) == 320
    assert _resolved_imgsz({"data": {**preset, "file": "my.yaml"}}) == 640
    assert _resolved_imgsz({"data": {"imgsz": "${elsewhere}"}}) is None
    assert _resolved_imgsz({"data": {"imgsz": 512}}) == 512


def test_training_from_scratch_on_ones_own_data_says_how_to_fine_tune(tmp_path, capsys):
    from yolo5l.train import build

    data = write_thin_dataset(tmp_path / "thin")
    build(_compose(tmp_path, "experiment=smoke", f"data.file={data}", "model=yolov5m"))
    out = capsys.readouterr().out
    assert "training from scratch" in out
    assert "weights=yolov5m.pt" in out
    build(_compose(tmp_path, "experiment=smoke", f"data.synthetic.root={tmp_path / 'syn'}"))
    assert "from scratch" not in capsys.readouterr().out  # the synthetic shapes are trained from scratch on purpose


def test_a_fine_tune_on_thin_boxes_refits_the_anchors_and_writes_yolov5s_files(tmp_path):
    from yolo5l.models.weights import load_weights, save_weights
    from yolo5l.models.yolo import ANCHORS_P3_P5, YOLOv5
    from yolo5l.training.autoanchor import anchor_metrics, label_wh

    data = write_thin_dataset(tmp_path / "thin")
    torch.manual_seed(0)
    start = save_weights(YOLOv5(num_classes=2, depth=0.33, width=0.25), tmp_path / "start.pt", ["h", "v"])
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"data.file={data}", f"weights={start}",
            "data.imgsz=64", "data.batch_size=4", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={run}",
        ],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "AutoAnchor:" in out
    assert "poor fit" in out
    assert "new anchors" in out
    files = {p.name for p in run.iterdir()}
    assert {"labels.jpg", "labels_correlogram.jpg", "results.csv", "metrics.csv"} <= files
    assert {f"train_batch{i}.jpg" for i in range(3)} <= files
    header = (run / "results.csv").read_text().splitlines()[0]
    assert [c.strip() for c in header.split(",")][:4] == ["epoch", "train/box_loss", "train/obj_loss", "train/cls_loss"]
    assert (run / ".hydra" / "config.yaml").is_file()  # YOLOv5's hyp.yaml + opt.yaml, in one file

    model, _ = load_weights(run / "checkpoints" / "weights.pt")
    coco = torch.tensor(ANCHORS_P3_P5, dtype=torch.float32).reshape(3, 3, 2)
    assert not torch.allclose(model.anchor_pixels(), coco)
    labels = [np.loadtxt(f, ndmin=2) for f in sorted((data.parent / "labels" / "train").glob("*.txt"))]
    wh = label_wh(labels, np.full((len(labels), 2), 64), 64)
    assert anchor_metrics(wh, coco)[0] < 0.5
    assert anchor_metrics(wh, model.anchor_pixels())[0] >= 0.98  # the run's weights carry the re-fitted anchors


def test_a_dataset_without_its_labels_folder_stops_training_with_one_error_line(tmp_path):
    """The new user's case: `rm -rf labels` trained on nothing, exit 0; v7.0 stops ("No labels found ..., can not
    start training"). One error line names where the labels were looked for and what to put there."""
    data = write_thin_dataset(tmp_path / "thin")
    shutil.rmtree(data.parent / "labels")
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", "experiment=smoke", f"data.file={data}", "data.imgsz=64",
         "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert [ln for ln in lines if ln.startswith("error:")] == [lines[-1]]
    assert lines[-1].startswith(
        f"error: train: no label file for any of its 12 images, and training needs labels: looked for them in "
        f"{data.parent / 'labels' / 'train'}{os.sep} (e.g. 0.txt for 0.jpg). Put one <image stem>.txt per image there"
    )
    assert "AutoAnchor" not in r.stdout
    assert "epoch 0/" not in r.stdout
