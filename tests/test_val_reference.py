"""`python -m yolo5l.val` on a .pt gives ultralytics/yolov5 v7.0's `val.py::run` mAP on the same weights, at val's
default precision (float32, as v7.0 without `--half`).

v7.0 (PyPI `yolov5==7.0.14`, in `.refvenv/` or the python named by YOLO5L_REFERENCE_PYTHON; skipped without it) builds
its `DetectionModel` from its own yolov5n.yaml, loads the state dict of tests/data/deploy_yolov5n.pt and saves it as a
v7.0 checkpoint; both sides validate that on the same synthetic images at 128 px, batch 32, rectangular batches.

The images are 240 x 240, so that resizing them to 128 px is exact and undecoded at a reduced scale: on images whose
resized side is fractional, yolo5l rounds it to the nearest pixel where 7.0.14 rounds up (`load_image`), and JPEGs at
least twice `data.imgsz` are decoded at a reduced scale (`data.reduced_decode`), which moves the mAP by up to ~0.01
on 128 px images. Those are the data pipeline's differences, not val's; this test compares the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _deploy_model import IMGSZ, WEIGHTS

from yolo5l.config import compose_config
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.models.weights import load_weights
from yolo5l.validation import validate_weights

pytestmark = pytest.mark.reference  # make refvenv; CI runs them with make test-ci
REPO = Path(__file__).resolve().parents[1]

_REFERENCE = """
import json, sys
from pathlib import Path
import torch, yolov5
from yolov5 import val
from yolov5.models.yolo import Model

out, data, imgsz, names = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
model = Model(str(Path(yolov5.__file__).parent / "models" / "yolov5n.yaml"), ch=3, nc=len(names))
model.load_state_dict(torch.load(out / "state.pt"), strict=True)
model.nc, model.names = len(names), names  # as v7.0's train.py sets them
torch.save({"model": model.half(), "epoch": -1}, out / "v7.pt")  # as v7.0's strip_optimizer leaves a file
(p, r, map50, map_, *_), *_ = val.run(data=data, weights=str(out / "v7.pt"), imgsz=imgsz, batch_size=32, device="cpu",
                                      workers=0, plots=False, project=str(out), name="v7val")
print(json.dumps({"map50": map50, "map": map_}))
"""


def _reference_python() -> str | None:
    path = os.environ.get("YOLO5L_REFERENCE_PYTHON") or str(REPO / ".refvenv" / "bin" / "python")
    return path if os.path.isfile(path) else None


def test_val_of_a_pt_gives_v7s_map_at_the_default_precision(tmp_path):
    python = _reference_python()
    if python is None:
        pytest.skip(
            "no reference environment (.refvenv/ with yolov5==7.0.14, or YOLO5L_REFERENCE_PYTHON): "
            "python scripts/bench_reference.py prints how to make it"
        )
    data = ensure_synthetic(tmp_path / "synthetic", num_train=1, num_val=64, seed=0, min_side=240, max_side=240)
    model, info = load_weights(WEIGHTS, num_classes=None)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "state.pt")
    v7_data = tmp_path / "v7_data.yaml"  # v7.0 resolves a relative `path:` against its package, not the yaml
    v7_data.write_text(yaml.safe_dump({"path": str(data.parent), "train": "images/train", "val": "images/val",
                                       "names": dict(enumerate(info.names))}))  # fmt: skip
    config = tmp_path / "v7_config"  # offline: v7.0 fetches Arial.ttf into its config folder unless it is there
    config.mkdir()
    import matplotlib

    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", config / "Arial.ttf")
    env = {**os.environ, "YOLOV5_CONFIG_DIR": str(config), "YOLO_CONFIG_DIR": str(config), "YOLO_OFFLINE": "1",
           "ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS": "1", "YOLO_AUTOINSTALL": "false", "WANDB_MODE": "disabled",
           "COMET_MODE": "disabled", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    args = [python, "-c", _REFERENCE, str(tmp_path), str(v7_data), str(IMGSZ), json.dumps(info.names)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads(r.stdout.strip().splitlines()[-1])

    overrides = [f"weights={WEIGHTS}", f"data.file={data}", f"data.imgsz={IMGSZ}", "data.val_batch_size=32",
                 "data.num_workers=0", "trainer.accelerator=cpu", "plots=false"]  # fmt: skip
    cfg = compose_config(overrides, "val", tmp_path / "ours")
    assert cfg.trainer.precision == "32-true"  # the default: v7.0's float32 (also on CPUs with bf16)
    ours = validate_weights(cfg)
    assert ours["val/map_50"] > 0.5, ours  # it detects most shapes: the comparison is of real detections
    assert ref["map50"] == pytest.approx(ours["val/map_50"], abs=0.002)
    assert ref["map"] == pytest.approx(ours["val/map"], abs=0.002)
