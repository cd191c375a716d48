"""An exported file names the dataset its weights were trained on (the metadata's `data` entry), and
`python -m yolo5l.val` of it defaults to that dataset as it does for the .pt; a file that names none is not validated
on the default synthetic set unless its classes are that set's."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import open_dict

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.data.synthetic import NAMES
from yolo5l.validation import validate_weights

COMMON = ["data.num_workers=0", "trainer.accelerator=cpu", "trainer.precision=32", "plots=false",
          "data.val_batch_size=4", "data.cache=none"]  # fmt: skip
SYNTHETIC = {"num_train": 5, "num_val": 4, "min_side": 80, "max_side": 140}
USER_NAMES = ["cat", "dog", "cow", "pig"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A user's 4-class dataset (4 val images, the classes renamed), tiny weights that record it and weights that
    do not, each exported to ONNX (through `python -m yolo5l.export`'s function) and TorchScript."""
    from yolo5l.data.synthetic import ensure_synthetic
    from yolo5l.export import export_weights
    from yolo5l.models.weights import save_weights
    from yolo5l.models.yolo import YOLOv5

    tmp = tmp_path_factory.mktemp("exported_data")
    data = ensure_synthetic(tmp / "userdata", **SYNTHETIC)
    spec = yaml.safe_load(data.read_text())
    data.write_text(yaml.safe_dump({**spec, "names": USER_NAMES}))
    out: dict[str, Path] = {"tmp": tmp, "data": data, "synthetic": data.parent}
    for name, recorded, names in (("best", data, USER_NAMES), ("old", None, USER_NAMES), ("shapes", None, NAMES)):
        torch.manual_seed(0)
        pt = save_weights(YOLOv5(num_classes=4, depth=0.33, width=0.125), tmp / f"{name}.pt", names=list(names),
                          imgsz=64, data=recorded)  # fmt: skip
        for fmt in ("onnx", "torchscript"):
            cfg = compose_config([f"weights={pt}", f"format={fmt}", "device=cpu"], "export", tmp / f"x_{name}_{fmt}")
            out[f"{name}.{fmt}"] = Path(export_weights(cfg))  # one format: its path
    return out


def _val(setup, weights: Path, run: str, *args: str):
    cfg = compose_config([f"weights={weights}", *COMMON, *args], "val", setup["tmp"] / run)
    return cfg, (lambda: validate_weights(cfg))


def test_the_files_carry_the_dataset_beside_v7_keys(setup):
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(setup["best.onnx"])).metadata_props}
    assert meta["data"] == str(setup["data"].absolute())
    assert (int(meta["stride"]), eval(meta["names"])) == (32, USER_NAMES)  # as v7.0's DetectMultiBackend reads them
    with zipfile.ZipFile(setup["best.torchscript"]) as zf:
        config = json.loads(zf.read(next(n for n in zf.namelist() if n.endswith("extra/config.txt"))))
    assert (config["data"], config["stride"], config["names"]) == (str(setup["data"].absolute()), 32, USER_NAMES)
    old = {p.key for p in onnx.load(str(setup["old.onnx"])).metadata_props}
    assert "data" not in old  # written only when the weights record a dataset
    assert {"stride", "names"} <= old


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_val_of_an_export_uses_the_dataset_it_names(setup, capsys, fmt):
    _, run = _val(setup, setup[f"best.{fmt}"], f"named_{fmt}")
    run()
    out = capsys.readouterr()
    text = out.out + out.err
    assert "(the dataset the weights were trained on)" in text
    line = next(ln for ln in text.splitlines() if "the dataset the weights were trained on" in ln)
    assert line.rstrip().endswith("userdata/data.yaml (the dataset the weights were trained on)")
    assert "val: 4 images" in text  # the user's 4 val images, not the default synthetic set's 128
    assert "cat" in text  # the per-class table names the user's classes


def test_the_users_data_choice_wins(setup, capsys):
    other = setup["synthetic"] / "other.yaml"  # beside data.yaml: the same root
    other.write_text(yaml.safe_dump({**yaml.safe_load(setup["data"].read_text()), "val": "images/train"}))
    _, run = _val(setup, setup["best.onnx"], "chosen", f"data.file={other}")
    run()
    out = capsys.readouterr()
    assert "the dataset the weights were trained on" not in out.out + out.err
    assert "val: 5 images" in out.out + out.err  # other.yaml's val split: the 5 train images


def test_an_export_without_a_dataset_is_refused_in_one_line(setup):
    for fmt in ("onnx", "torchscript"):
        _, run = _val(setup, setup[f"old.{fmt}"], f"refused_{fmt}")
        with pytest.raises(UserError, match=r"old\.\w+ does not say which dataset it was trained on: give data\.file="):
            run()
    _, run = _val(setup, setup["old.onnx"], "old_with_data", f"data.file={setup['data']}")
    assert 0.0 <= run()["val/map"] <= 1.0  # given data=, it validates


def test_an_export_with_the_synthetic_classes_goes_on_with_a_line(setup, capsys):
    cfg, run = _val(setup, setup["shapes.onnx"], "shapes")
    with open_dict(cfg):  # a small default set (not a command-line choice): the test's stand-in for the 640 images
        cfg.data.synthetic = {"root": str(setup["synthetic"]), **SYNTHETIC}
    run()
    out = capsys.readouterr()
    assert "data: the default synthetic set" in out.out + out.err
    assert "shapes.onnx does not say which dataset it was trained on" in out.out + out.err


def test_a_named_dataset_that_is_gone_is_one_line(setup, tmp_path):
    import onnx

    proto = onnx.load(str(setup["best.onnx"]))
    next(p for p in proto.metadata_props if p.key == "data").value = str(tmp_path / "gone.yaml")
    moved = tmp_path / "moved.onnx"
    onnx.save(proto, str(moved))
    _, run = _val(setup, moved, "gone")
    with pytest.raises(UserError, match=r"moved\.onnx was trained on .*gone\.yaml, which is not here: give data\.file"):
        run()
