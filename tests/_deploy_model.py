"""The small trained detector that the deployment tests export: yolov5n on the synthetic shapes at 128 px.

`tests/data/deploy_yolov5n.pt` is kept in the repository so that the tests need no training (it takes about a quarter
of an hour on two CPU cores). `python tests/_deploy_model.py` makes it again: one `synthetic_learn` training of
30 epochs on 512 images (at 128 px); the tests regenerate the same synthetic
dataset (the same parameters give the same files) and validate on its 32 val images, where it scores mAP@0.5 above
0.5, so the formats' tolerances (0.002 to 0.03 mAP) compare detections, not noise.
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
SYNTHETIC = {"num_train": 512, "num_val": 32, "seed": 0}
EPOCHS = 30


def data_overrides(root: Path) -> list[str]:
    """The `data.*` overrides of the dataset the weights were trained on (generated under `root`)."""
    return [f"data.synthetic.root={root}", *(f"data.synthetic.{k}={v}" for k, v in SYNTHETIC.items()),
            f"data.imgsz={IMGSZ}"]  # fmt: skip


def train(out: Path = WEIGHTS, *extra: str) -> Path:
    """Train the model (the run in the module docstring; `extra`: more overrides) and copy its weights to `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        root, env = Path(tmp) / "synthetic", {**os.environ, "HYDRA_FULL_ERROR": "0"}
        args = ["experiment=synthetic_learn", "data.num_workers=1", "logger=none", *data_overrides(root),
                f"trainer.max_epochs={EPOCHS}", f"hydra.run.dir={tmp}/run", *extra]  # fmt: skip
        subprocess.run([sys.executable, "-m", "yolo5l.train", *args], check=True, env=env)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "run" / "checkpoints" / "weights.pt", out)
    return out


if __name__ == "__main__":
    print(train(Path(sys.argv[1]) if len(sys.argv) > 1 else WEIGHTS, *sys.argv[2:]))
