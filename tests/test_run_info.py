"""What a run shows it uses: the start-up block's figures and sources, the weights' dataset and image size as the
defaults of val, --help listing each command's own groups, and the hints for Windows paths and crowded CPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from omegaconf import open_dict

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.data.dataset_yaml import load_dataset_file
from yolo5l.data.layout import DatasetError
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.models.weights import load_weights, save_weights
from yolo5l.models.yolo import YOLOv5
from yolo5l.run_info import cpu_oversubscription, data_from_weights, model_gflops, source_of, training_rows
from yolo5l.train import build


@pytest.mark.parametrize(("depth", "width", "v7_gflops"), [(0.33, 0.25, 4.5), (0.33, 0.50, 16.5)])
def test_gflops_match_v7s_model_table(depth, width, v7_gflops):
    """ultralytics/yolov5 v7.0's README lists 4.5 and 16.5 GFLOPs at 640 for yolov5n and yolov5s."""
    model = YOLOv5(num_classes=80, depth=depth, width=width)
    assert model_gflops(model, 640) == pytest.approx(v7_gflops, abs=0.15)
    assert model_gflops(model, 320) == pytest.approx(model_gflops(model, 640) / 4)
    assert model.training  # left in the mode it was in


@pytest.mark.parametrize(("name", "v7_gflops"), [("yolov5n6", 4.6), ("yolov5s6", 16.8)])
def test_gflops_of_p6_models(name, v7_gflops):
    """P6 models (largest stride 64) are probed at 64 px: v7.0's README lists 4.6 and 16.8 GFLOPs at 640."""
    model = YOLOv5.from_name(name, num_classes=80)
    assert model_gflops(model, 640) == pytest.approx(v7_gflops, abs=0.15)


def test_source_of_each_value():
    overrides = ["data.imgsz=256", "trainer=cpu"]
    choices = {"experiment": "smoke", "data": "coco128", "trainer": "cpu"}
    assert source_of("data.imgsz", overrides, choices) == "command line"
    assert source_of("data.batch_size", overrides, choices) == "experiment=smoke"  # conf/experiment/smoke.yaml
    assert source_of("data.file", overrides, {"data": "coco128"}) == "data=coco128"  # the preset sets it
    assert source_of("data.cache", [], {"data": "coco128"}) == "data=coco128"
    assert source_of("trainer.accelerator", [], {"trainer": "cpu"}) == "trainer=cpu"
    assert source_of("data.reduced_decode", [], {"data": "coco128"}) is None  # the shipped default
    assert source_of("data.cache", [], {}, resumed=True) == "the checkpoint"
    assert source_of("data.cache", ["data.cache=ram"], {}, resumed=True) == "command line"
    # A group override picks an option: the values under it are the option's (or the defaults), not typed.
    assert source_of("data.cache", ["data=coco128"], {"data": "coco128"}) == "data=coco128"
    assert source_of("data.batch_size", ["data=coco128", "data.file=x.yaml"], {"data": "coco128"}) is None
    assert source_of("model", ["model=yolov5n"], {"model": "yolov5n"}) == "command line"
    assert source_of("model", [], {"experiment": "smoke"}) == "experiment=smoke"  # `override /model: yolov5n`


def _hydra() -> tuple[list[str], dict[str, str]]:
    """The current Hydra run's overrides and group choices (what the start-up block's sources read)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return list(hc.overrides.task), dict(hc.runtime.choices)


def test_start_up_block_rows(tmp_path):
    cfg = compose_config(
        ["experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.cache=ram", "data.imgsz=64"],
        output_dir=tmp_path / "run",
    )
    datamodule, module, trainer = build(cfg)
    rows = training_rows(cfg, datamodule, module, trainer, *_hydra())
    model = "yolov5n, depth 0.33, width 0.25: 1.77 M parameters, 0.04 GFLOPs at 64 px   [experiment=smoke]"
    assert rows["model"] == model  # the experiment picks the model: `override /model: yolov5n`
    assert rows["image size"] == "64   [command line]"
    assert rows["cache"] == "ram   [command line]"
    assert rows["batch"] == "8 in all, 8 per device   [experiment=smoke]"
    assert rows["precision"] == "32-true   [experiment=smoke]"
    assert rows["devices"] == "1 cpu   [trainer=cpu]"
    assert rows["data"].endswith("s/data.yaml, 4 classes   [command line]")
    assert rows["workers"] == "0 per device   [experiment=smoke]"
    assert rows["pipeline"] == "host: images decoded and augmented in the training process   [auto: not CUDA]"


def test_start_up_block_says_which_input_path_and_cache(tmp_path):
    """The device path on the device the run trains on; a device cache the host path cannot use, and why."""
    base = ["experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.imgsz=64"]
    cfg = compose_config([*base, "data.pipeline=device", "data.cache=device"], output_dir=tmp_path / "a")
    datamodule, module, trainer = build(cfg)
    rows = training_rows(cfg, datamodule, module, trainer, *_hydra())
    assert rows["pipeline"] == "device: images decoded and augmented on cpu   [command line]"
    assert rows["cache"] == "device   [command line]"
    cfg = compose_config([*base, "data.cache=device", "data.num_workers=2"], output_dir=tmp_path / "b")
    datamodule, module, trainer = build(cfg)
    rows = training_rows(cfg, datamodule, module, trainer, *_hydra())
    assert rows["pipeline"] == "host: images decoded and augmented by 2 workers   [auto: not CUDA]"
    assert rows["cache"] == (
        "ram   [fallback: data.cache=device keeps images in GPU memory, and this run trains on cpu (no CUDA)]"
    )


def test_more_cpu_processes_than_cores_is_a_warning():
    assert cpu_oversubscription(2, on_cpu=True, cores=2) is None
    assert cpu_oversubscription(8, on_cpu=False, cores=2) is None  # GPUs: one process per GPU
    message = cpu_oversubscription(3, on_cpu=True, cores=2)
    assert message.startswith("trainer.devices=3 on the CPU starts 3 training processes on 2 cores")


def _weights(tmp_path, data):
    model = YOLOv5(num_classes=4, depth=0.33, width=0.25)
    return save_weights(model, tmp_path / "w.pt", ["rectangle", "ellipse", "triangle", "cross"], imgsz=64, data=data)


def test_weights_record_their_dataset_and_image_size(tmp_path):
    path = _weights(tmp_path, "rel/data.yaml")
    _, info = load_weights(path)
    assert info.imgsz == 64
    assert info.data == os.path.abspath("rel/data.yaml")  # absolute: val runs from anywhere


def test_a_training_checkpoint_names_its_runs_dataset():
    from yolo5l.models.weights import _run_data_file

    assert _run_data_file({"file": "d/data.yaml"}) == os.path.abspath("d/data.yaml")
    assert _run_data_file({"file": None, "synthetic": {"root": "ds/s"}}) == os.path.abspath("ds/s/data.yaml")
    assert _run_data_file({"file": "${oc.env:YOLO5L_DATASETS,datasets}/coco128/data.yaml"}) is None  # unresolved


def test_val_takes_the_weights_dataset_unless_the_command_line_chose(tmp_path, capsys):
    yaml = tmp_path / "data.yaml"
    yaml.write_text("path: .\ntrain: images\nval: images\nnames: [a]\n")
    cfg = compose_config([], config_name="val", output_dir=tmp_path / "run")
    assert data_from_weights(cfg, str(yaml), overrides=["weights=w.pt"]) == str(yaml)
    assert cfg.data.file == str(yaml)
    assert "(the dataset the weights were trained on)" in capsys.readouterr().out
    cfg = compose_config(["data=coco128"], config_name="val", output_dir=tmp_path / "run")
    assert data_from_weights(cfg, str(yaml), overrides=["data=coco128"]) is None
    assert cfg.data.file.endswith("coco128/data.yaml")
    assert data_from_weights(cfg, str(yaml), overrides=["data.file=x.yaml"]) is None
    assert data_from_weights(cfg, None, overrides=[]) is None
    with open_dict(cfg):
        cfg.weights = "runs/train/x/checkpoints/best.pt"
    with pytest.raises(UserError, match=r"best\.pt was trained on .*gone\.yaml, which is not here: give data\.file="):
        data_from_weights(cfg, str(tmp_path / "gone.yaml"), overrides=[])  # not the default set, silently or not


def test_val_command_without_data_uses_the_weights_dataset_and_size(tmp_path):
    """The issue's case: `val weights=...` without data= validated on the default synthetic set instead of the one
    the weights were trained on."""
    yaml = ensure_synthetic(tmp_path / "mine", num_train=4, num_val=4, seed=1)
    weights = _weights(tmp_path, yaml)
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.val", f"weights={weights}", "hydra.run.dir=run", "plots=false",
         "data.val_batch_size=4"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data.imgsz: 64 (the weights' training size)" in r.stdout
    assert "data.file: mine/data.yaml (the dataset the weights were trained on)" in r.stdout
    assert not (tmp_path / "datasets").exists()  # the default synthetic set was not generated
    assert (tmp_path / "run" / "val.log").read_text().count("data.file: mine/data.yaml") == 1


@pytest.mark.parametrize("entry", ["predict", "export", "benchmark"])
def test_help_lists_the_commands_own_groups(entry):
    r = subprocess.run([sys.executable, "-m", f"yolo5l.{entry}", "--help"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"python -m yolo5l.{entry} weights=" in r.stdout
    assert "paths: default" in r.stdout
    for training_only in ("callbacks:", "hparams_search:", "logger:", "model:", "experiment:"):
        assert training_only not in r.stdout
    assert "powered by Hydra" not in r.stdout  # the command's own template, not Hydra's stock one


def test_windows_paths_in_a_data_yaml_get_the_forward_slash_hint(tmp_path):
    (tmp_path / "images" / "train").mkdir(parents=True)
    yaml = tmp_path / "data.yaml"
    yaml.write_text("path: .\ntrain: images\\train\nval: images\\train\nnames: [a]\n")
    if os.sep == "\\":
        pytest.skip("backslashes are separators here")
    with pytest.raises(DatasetError, match=r"backslashes are Windows separators: write it with forward slashes "
                       r"\('images/train'\)"):  # fmt: skip
        load_dataset_file(yaml)


def test_a_windows_drive_path_gets_a_hint_in_this_systems_forms(tmp_path):
    """`path: C:\\Users\\me\\datasets\\mydata` is no path here even with forward slashes: the hint names this
    system's forms (an absolute path, or one relative to the yaml), never `C:/...`."""
    if os.sep == "\\":
        pytest.skip("drive paths are paths here")
    yaml = tmp_path / "data.yaml"
    yaml.write_text("path: C:\\Users\\me\\datasets\\mydata\ntrain: images\nval: images\nnames: [a]\n")
    with pytest.raises(DatasetError) as e:
        load_dataset_file(yaml)
    message = str(e.value)
    assert "Windows path on drive C:" in message
    assert "'/home/me/datasets/mydata'" in message
    assert "'datasets/mydata'" in message
    assert "C:/" not in message


def test_weights_gflops_probe_leaves_no_grad_state(tmp_path):
    model = YOLOv5(num_classes=2, depth=0.33, width=0.25)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model_gflops(model, 64)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN statistics untouched by the probe
