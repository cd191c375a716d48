"""Tiny model, dataset and module factory behind the fixtures of tests/conftest.py (`tiny_module`, `tiny_data`,
`tiny_collate`, `make_trainer`).

A plain module: conftest.py imports it (pytest puts tests/ on sys.path, it has no __init__.py); tests take the
fixtures instead of importing it.
"""

from __future__ import annotations

import time
from functools import partial

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from yolo5l.eval.coco_map import COCOMap
from yolo5l.eval.metrics import DetectionMAP
from yolo5l.models.yolo import YOLOv5
from yolo5l.training.loss import YOLOv5Loss, loss_args
from yolo5l.training.module import YOLOv5Module
from yolo5l.training.optim import LinearLR

HYP = {
    "lr0": 0.01,
    "lrf": 0.01,
    "momentum": 0.937,
    "weight_decay": 0.0005,
    "warmup_epochs": 3.0,
    "warmup_momentum": 0.8,
    "warmup_bias_lr": 0.1,
    "box": 0.05,
    "cls": 0.5,
    "obj": 1.0,
    "anchor_t": 4.0,
}
IMGSZ = 64


class BoxesDataset(Dataset):
    """Deterministic images with one bright rectangle each, labelled like a letterboxed val batch (no padding)."""

    def __init__(self, n: int = 8, size: int = IMGSZ, delay: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for _ in range(n):
            img = torch.rand(3, size, size, generator=g) * 0.2
            w, h = (torch.rand(2, generator=g) * 0.4 + 0.2).tolist()
            cx, cy = (torch.rand(2, generator=g) * 0.4 + 0.3).tolist()
            x1, y1 = int((cx - w / 2) * size), int((cy - h / 2) * size)
            x2, y2 = int((cx + w / 2) * size), int((cy + h / 2) * size)
            img[:, y1:y2, x1:x2] = 0.9
            cls = float(torch.randint(0, 2, (1,), generator=g))
            self.items.append((img, torch.tensor([[cls, cx, cy, w, h]])))
        self.size, self.delay = size, delay

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.items[i]


def collate(batch):
    images = torch.stack([b[0] for b in batch])
    targets = torch.cat([torch.cat((torch.full((len(b[1]), 1), float(i)), b[1]), 1) for i, b in enumerate(batch)])
    shape = ((IMGSZ, IMGSZ), ((1.0, 1.0), (0.0, 0.0)))
    return images, targets, [f"{i}.jpg" for i in range(len(batch))], [shape] * len(batch)


class TinyData(pl.LightningDataModule):
    def __init__(self, n: int = 8, batch_size: int = 4, delay: float = 0.0) -> None:
        super().__init__()
        self.ds = BoxesDataset(n, delay=delay)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False, collate_fn=collate)


def tiny_module(
    nbs: int = 8, ciou_backend: str = "auto", map_backend: str = "yolov5", model: YOLOv5 | None = None, **kw
) -> YOLOv5Module:
    """A 2-class yolov5 at width 0.125 (or ``model``) with the parts conf/module/yolov5.yaml injects (SGD, linear
    schedule)."""
    torch.manual_seed(0)
    model = YOLOv5(num_classes=2, depth=0.33, width=0.125) if model is None else model
    return YOLOv5Module(
        model,
        loss=partial(YOLOv5Loss.from_model, imgsz=IMGSZ, ciou_backend=ciou_backend, **loss_args(HYP)),
        optimizer=partial(torch.optim.SGD, lr=HYP["lr0"], momentum=HYP["momentum"], nesterov=True),
        scheduler=partial(LinearLR, lrf=HYP["lrf"]),
        metric=DetectionMAP() if map_backend == "yolov5" else COCOMap(),
        names=["a", "b"],
        weight_decay=HYP["weight_decay"],
        warmup_epochs=HYP["warmup_epochs"],
        warmup_momentum=HYP["warmup_momentum"],
        warmup_bias_lr=HYP["warmup_bias_lr"],
        nbs=nbs,
        **kw,
    )


def make_trainer(tmp_path, callbacks=(), **kw) -> pl.Trainer:
    """A quiet single-device CPU trainer for 2 epochs; checkpointing on only when a callback has a `dirpath`."""
    args = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(tmp_path),
        "enable_checkpointing": any(hasattr(c, "dirpath") for c in callbacks),
    }
    args.update(kw)
    return pl.Trainer(callbacks=list(callbacks), **args)
