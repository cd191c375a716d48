"""The small trained detector that the deployment tests export: yolov5n on the synthetic shapes at 128 px.

`tests/data/deploy_yolov5n.pt` is kept in the repository so that the tests need no training (it takes about five
minutes on two busy CPU cores). `python tests/_deploy_model.py` makes it again: a `synthetic_learn` training of 35
epochs on 512 images at 128 px (mAP@0.5 0.85, mAP@0.5:0.95 0.50 on the val images, so that the formats' tolerances
compare real detections); the tests regenerate the same synthetic dataset (the same parameters give the same files)
and validate on its 64 val images.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WEIGHTS = Path(__file__).parent / "data" / "deploy_yolov5n.pt"
IMGSZ = 128
SYNTHETIC = {"num_train": 512, "num_val": 64, "seed": 0}
EPOCHS = 35


def data_overrides(root: Path) -> list[str]:
    """The `data.*` overrides of the dataset the weights were trained on (generated under `root`)."""
    return [f"data.synthetic.root={root}", *(f"data.synthetic.{k}={v}" for k, v in SYNTHETIC.items()),
            f"data.imgsz={IMGSZ}"]  # fmt: skip


def train(out: Path = WEIGHTS) -> Path:
    """Train the model (the run in the module docstring) and copy its weights to `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        root, env = Path(tmp) / "synthetic", {**os.environ, "HYDRA_FULL_ERROR": "0"}
        common = ["experiment=synthetic_learn", "data.num_workers=1", "logger=none", *data_overrides(root)]

        args = [f"trainer.max_epochs={EPOCHS}", f"hydra.run.dir={tmp}/a"]
        subprocess.run([sys.executable, "-m", "yolo5l.train", *common, *args], check=True, env=env)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "a" / "checkpoints" / "weights.pt", out)
    return out


if __name__ == "__main__":
    print(train())


def untrained_weights(path: Path, names: list[str]) -> Path:
    """An untrained yolov5n for `names`, seeded, with BatchNorm statistics that make fusing change the weights, saved
    as a yolo5l weights file at `path` (the export tests' model)."""
    import torch
    from torch import nn

    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    torch.manual_seed(0)
    model = YOLOv5.from_name("yolov5n", num_classes=len(names))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return save_weights(model, path, names=names, half=False)
