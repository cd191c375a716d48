"""Training results do not depend on the input pipeline's speed-ups: the losses of a few training steps on the
fast path (reduced-scale JPEG decode, the mosaic warped straight into the output) stay within bf16 noise of the
losses on YOLOv5's path (full decode, the 2s x 2s canvas of ``tests/_reference_augment.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _reference_augment import reference_load_mosaic

from yolo5l.data.dataset import YOLODataset, collate_fn
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.models.yolo import YOLOv5
from yolo5l.training.loss import YOLOv5Loss, loss_args

IMGSZ = 128  # the images are 512-640 px: decoded at 1/4 scale on the fast path
BATCH, STEPS = 8, 6
HYP = {"box": 0.05, "obj": 1.0, "cls": 0.5, "anchor_t": 4.0}


def _batches(ds: YOLODataset, seed: int = 0):
    order = np.random.default_rng(seed).permutation(len(ds))
    for step in range(STEPS):
        idx = order[step * BATCH : (step + 1) * BATCH]
        yield collate_fn([ds[(int(i), True, (seed, 0, 0))] for i in idx])


def _losses(ds: YOLODataset, precision: torch.dtype | None) -> list[float]:
    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5n", num_classes=4)
    loss_fn = YOLOv5Loss.from_model(model, IMGSZ, **loss_args(HYP))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    out = []
    for images, targets, _, _ in _batches(ds):
        with torch.autocast("cpu", dtype=precision or torch.bfloat16, enabled=precision is not None):
            total, _ = loss_fn(model(images.float() / 255), targets)
        opt.zero_grad()
        total.backward()
        opt.step()
        out.append(float(total.detach()) / BATCH)
    return out


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("camera") / "set"
    spec = load_dataset_file(
        ensure_synthetic(root, num_train=48, num_val=2, min_side=512, max_side=640, max_object_side=200)
    )
    return scan_labels(spec.files("train"), spec.num_classes, spec.cache_path("train"), "train")


def test_fast_pipeline_losses_within_bf16_noise_of_yolov5s_path(index, monkeypatch, one_thread):
    fast = YOLODataset(index, IMGSZ, augment=True, batch_size=BATCH)
    fast_fp32 = _losses(fast, None)
    fast_bf16 = _losses(fast, torch.bfloat16)

    reference = YOLODataset(index, IMGSZ, augment=True, batch_size=BATCH, reduced_decode=False)
    monkeypatch.setattr(YOLODataset, "load_mosaic", reference_load_mosaic)
    reference_fp32 = _losses(reference, None)

    # Mean |difference| per step: measured 0.8e-3 between the pipelines and 0.6e-3 between fp32 and bf16 on a loss of
    # ~0.18 per image; each speed-up alone (decode, mosaic) moves the losses about as much as the two together.
    bf16_noise = np.mean(np.abs(np.subtract(fast_fp32, fast_bf16)))
    pipeline_gap = np.mean(np.abs(np.subtract(fast_fp32, reference_fp32)))
    assert 0 < pipeline_gap <= 2 * bf16_noise, (fast_fp32, reference_fp32, fast_bf16)
