"""`python -m yolo5l.val` on a .pt gives ultralytics/yolov5 v7.0's `val.py::run` mAP@0.5 and mAP@0.5:0.95 on the same
weights, within 0.002, at val's default precision (float32, as v7.0 without `--half`).

The reference is PyPI's `yolov5==7.0.14` (in `.refvenv/` or the python named by YOLO5L_REFERENCE_PYTHON; skipped
without it) with its `LoadImagesAndLabels.load_image` set back to the v7.0 tag's resize, which truncates the resized
sides (`int(w0 * r)`) where 7.0.14 rounds them up (`math.ceil`); nothing else of it is changed. It builds its
`DetectionModel` from its own yolov5n.yaml, loads the state dict of tests/data/deploy_yolov5n.pt and saves it as a
v7.0 checkpoint; both sides validate that on the same synthetic JPEGs at 128 px, batch 32, rectangular batches, with
their default options: the whole pipeline is compared (decode, resize, rectangular batch shapes, letterbox and its
pad, label scaling, NMS, box rescaling, the metric). Two sets of 64 images: square 240 px ones, and 100 to 560 px
ones, 45 of them non-square, most with fractional resized sides, 53 at least twice the 128 px (validation decodes
them in full, as v7.0; training's reduced decode, `data.val_reduced_decode=true`, moves this set's mAP by ~0.006).
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
import inspect, json, sys, textwrap
from pathlib import Path
import torch, yolov5
from yolov5 import val
from yolov5.models.yolo import Model
from yolov5.utils import dataloaders

# ultralytics/yolov5 v7.0 utils/dataloaders.py::LoadImagesAndLabels.load_image truncates the resized sides,
# (int(w0 * r), int(h0 * r)); PyPI's 7.0.14 rounds them up with math.ceil. Its method, recompiled with the tag's rule:
src = textwrap.dedent(inspect.getsource(dataloaders.LoadImagesAndLabels.load_image))
ceil = "(math.ceil(w0 * r), math.ceil(h0 * r))"
assert src.count(ceil) == 1, "7.0.14's load_image is not the one this patch knows"
ns = {}
exec(compile(src.replace(ceil, "(int(w0 * r), int(h0 * r))"), dataloaders.__file__, "exec"), vars(dataloaders), ns)
dataloaders.LoadImagesAndLabels.load_image = ns["load_image"]

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


def v7_map(tmp_path: Path, data: Path, names: list[str]) -> dict[str, float]:
    """v7.0's val.py mAP (``map50``, ``map``) of the test weights on the dataset yaml ``data``."""
    python = _reference_python()
    if python is None:
        pytest.skip(
            "no reference environment (.refvenv/ with yolov5==7.0.14, or YOLO5L_REFERENCE_PYTHON): "
            "python scripts/bench_reference.py prints how to make it"
        )
    model, _ = load_weights(WEIGHTS, num_classes=None)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "state.pt")
    v7_data = tmp_path / "v7_data.yaml"  # v7.0 resolves a relative `path:` against its package, not the yaml
    v7_data.write_text(yaml.safe_dump({"path": str(data.parent), "train": "images/train", "val": "images/val",
                                       "names": dict(enumerate(names))}))  # fmt: skip
    config = tmp_path / "v7_config"  # offline: v7.0 fetches Arial.ttf into its config folder unless it is there
    config.mkdir()
    import matplotlib

    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", config / "Arial.ttf")
    env = {**os.environ, "YOLOV5_CONFIG_DIR": str(config), "YOLO_CONFIG_DIR": str(config), "YOLO_OFFLINE": "1",
           "ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS": "1", "YOLO_AUTOINSTALL": "false", "WANDB_MODE": "disabled",
           "COMET_MODE": "disabled", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    args = [python, "-c", _REFERENCE, str(tmp_path), str(v7_data), str(IMGSZ), json.dumps(names)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def our_map(tmp_path: Path, data: Path, *overrides: str) -> dict[str, float]:
    """`python -m yolo5l.val`'s metrics of the test weights on ``data``, v7.0's val.py settings."""
    overrides = (f"weights={WEIGHTS}", f"data.file={data}", f"data.imgsz={IMGSZ}", "data.val_batch_size=32",
                 "data.num_workers=0", "trainer.accelerator=cpu", "plots=false", *overrides)  # fmt: skip
    cfg = compose_config(list(overrides), "val", tmp_path / "ours")
    assert cfg.trainer.precision == "32-true"  # the default: v7.0's float32 (also on CPUs with bf16)
    return validate_weights(cfg)


# (min_side, max_side, seed) of the 64 val images
DATASETS = {"square": (240, 240, 0), "mixed": (100, 560, 2)}


@pytest.mark.parametrize("images", DATASETS.values(), ids=DATASETS.keys())
def test_val_of_a_pt_gives_v7s_map_at_the_default_precision(tmp_path, images):
    min_side, max_side, seed = images
    data = ensure_synthetic(tmp_path / "synthetic", num_train=1, num_val=64, seed=seed, min_side=min_side,
                            max_side=max_side)  # fmt: skip
    names = load_weights(WEIGHTS, num_classes=None)[1].names
    ref = v7_map(tmp_path, data, names)
    ours = our_map(tmp_path, data)
    assert ours["val/map_50"] > 0.5, ours  # it detects most shapes: the comparison is of real detections
    assert ref["map50"] == pytest.approx(ours["val/map_50"], abs=0.002)
    assert ref["map"] == pytest.approx(ours["val/map"], abs=0.002)
