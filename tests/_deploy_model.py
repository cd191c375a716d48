"""The small trained detector that the deployment tests export: yolov5n on the synthetic shapes at 128 px.

`tests/data/deploy_yolov5n.pt` is kept in the repository so that the tests need no training (it takes about half
an hour on two busy CPU cores). `python tests/_deploy_model.py` makes it again: a `synthetic_learn` training of 10
epochs on 256 images, then 15 more epochs from its weights without warm-up; the tests regenerate the same synthetic
dataset (the same parameters give the same files) and validate on its 32 val images.
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
SYNTHETIC = {"num_train": 256, "num_val": 32, "seed": 0}


def data_overrides(root: Path) -> list[str]:
    """The `data.*` overrides of the dataset the weights were trained on (generated under `root`)."""
    return [f"data.synthetic.root={root}", *(f"data.synthetic.{k}={v}" for k, v in SYNTHETIC.items()),
            f"data.imgsz={IMGSZ}"]  # fmt: skip


def train(out: Path = WEIGHTS) -> Path:
    """Train the model (the two runs in the module docstring) and copy its weights to `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        root, env = Path(tmp) / "synthetic", {**os.environ, "HYDRA_FULL_ERROR": "0"}
        common = ["experiment=synthetic_learn", "data.num_workers=1", "logger=none", *data_overrides(root)]

        def run(*args: str) -> None:
            subprocess.run([sys.executable, "-m", "yolo5l.train", *common, *args], check=True, env=env)

        run("trainer.max_epochs=10", f"hydra.run.dir={tmp}/a")
        run(f"weights={tmp}/a/checkpoints/weights.pt", "hyp.warmup_epochs=0", "trainer.max_epochs=15",
            f"hydra.run.dir={tmp}/b")  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "b" / "checkpoints" / "weights.pt", out)
    return out


if __name__ == "__main__":
    print(train())
