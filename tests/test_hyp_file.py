"""`hyp=path/to/hyp.yaml` (v7.0 `--hyp`): a file's hyperparameters as well as the shipped presets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from yolo5l.base.errors import UserError
from yolo5l.config import compose_config
from yolo5l.io.hyp_file import apply_hyp_file, hyp_file_argv, read_hyp_file

# ultralytics/yolov5 v7.0 data/hyps/hyp.scratch-high.yaml's values (it has no label_smoothing: train.py's flag)
V7_SCRATCH_HIGH = """
lr0: 0.01
lrf: 0.1
momentum: 0.937
weight_decay: 0.0005
warmup_epochs: 3.0
warmup_momentum: 0.8
warmup_bias_lr: 0.1
box: 0.05
cls: 0.3
cls_pw: 1.0
obj: 0.7
obj_pw: 1.0
iou_t: 0.20
anchor_t: 4.0
fl_gamma: 0.0
hsv_h: 0.015
hsv_s: 0.7
hsv_v: 0.4
degrees: 0.0
translate: 0.1
scale: 0.9
shear: 0.0
perspective: 0.0
flipud: 0.0
fliplr: 0.5
mosaic: 1.0
mixup: 0.1
copy_paste: 0.1
"""


def test_argv_rewrite(tmp_path):
    f = tmp_path / "my hyp.yaml"
    f.write_text("lr0: 0.02\n")
    g = tmp_path / "b.yml"
    g.write_text("lr0: 0.03\n")
    assert hyp_file_argv(["hyp=scratch-high", "model=yolov5n"]) == ["hyp=scratch-high", "model=yolov5n"]
    assert hyp_file_argv([f"hyp={f}", "hyp.lr0=0.5"]) == [f"hyp_file='{f}'", "hyp.lr0=0.5"]
    assert hyp_file_argv([f"hyp={f},{g}"]) == [f"hyp_file='{f}','{g}'"]  # a sweep over files
    with pytest.raises(UserError, match="file not found"):
        hyp_file_argv([f"hyp={tmp_path / 'missing.yaml'}"])
    with pytest.raises(UserError, match="not both"):
        hyp_file_argv([f"hyp=scratch-low,{f}"])


def test_a_v7_hyp_file_replaces_the_preset_and_keeps_what_it_lacks(tmp_path):
    f = tmp_path / "hyp.scratch-high.yaml"
    f.write_text(V7_SCRATCH_HIGH)
    cfg = compose_config([f"hyp={f}", "hyp.label_smoothing=0.1"], output_dir=tmp_path / "run")
    assert cfg.hyp_file == str(f)
    assert (cfg.hyp.lrf, cfg.hyp.scale, cfg.hyp.mixup, cfg.hyp.copy_paste, cfg.hyp.obj) == (0.1, 0.9, 0.1, 0.1, 0.7)
    assert cfg.hyp.label_smoothing == 0.1  # not in the file: the command line's (else the preset's)
    assert cfg.data.hyp.scale == 0.9  # what the dataset and module read through ${hyp}
    assert (cfg.module.loss.obj, cfg.module.loss.label_smoothing) == (0.7, 0.1)  # the loss gets its keys one by one
    preset = compose_config(["hyp=scratch-high"], output_dir=tmp_path / "preset")
    assert {k: v for k, v in cfg.hyp.items() if k != "label_smoothing"} == {
        k: v for k, v in preset.hyp.items() if k != "label_smoothing"
    }


def test_command_line_and_search_values_win_over_the_file(tmp_path):
    f = tmp_path / "best_hyp.yaml"
    f.write_text("# a search's best trial\nlr0: 0.02\nmomentum: 0.9\nweight_decay: 5e-4\n")
    cfg = compose_config([f"hyp={f}", "hyp.lr0=0.005"], output_dir=tmp_path / "run")
    assert (cfg.hyp.lr0, cfg.hyp.momentum, cfg.hyp.weight_decay) == (0.005, 0.9, 0.0005)
    # a sweep job: Hydra has applied the value the sweeper chose, and the file leaves it alone
    job = compose_config([f"hyp_file={f}", "hyp.momentum=0.7"], output_dir=tmp_path / "job")
    assert (job.hyp.lr0, job.hyp.momentum) == (0.02, 0.7)


def test_the_run_folder_config_holds_the_values_used(tmp_path):
    """A run's .hydra/config.yaml (which a search's best_hyp.yaml is read from) gets the file's values."""
    f = tmp_path / "hyp.yaml"
    f.write_text("lr0: 0.02\nmomentum: 0.9\n")
    cfg = compose_config(["hyp.momentum=0.7"], output_dir=tmp_path / "run")
    OmegaConf.update(cfg, "hyp_file", str(f))
    (tmp_path / "run" / ".hydra").mkdir()
    apply_hyp_file(cfg, ["hyp.momentum=0.7", f"hyp_file={f}"], tmp_path / "run")
    written = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert (written.hyp.lr0, written.hyp.momentum, written.hyp_file) == (0.02, 0.7, str(f))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr0: 0.01\nanchors: 3\n", "unknown key.*anchors"),
        ("lr0: fast\n", "lr0='fast' is not a number"),
        ("- 1\n- 2\n", "not a mapping"),
        ("lr0: [\n", "not valid YAML"),
    ],
)
def test_bad_files_are_one_line(tmp_path, text, message):
    f = tmp_path / "hyp.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=message) as e:
        read_hyp_file(f, ["lr0", "lrf"])
    assert "\n" not in str(e.value)
    assert str(f) in str(e.value)


def test_command_line_refuses_a_missing_file_in_one_line(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "yolo5l.train", "hyp=nowhere/hyp.yaml", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: hyp=nowhere/hyp.yaml: file not found; pass a hyp yaml (a v7.0 data/hyps file, a search's "
        "best_hyp.yaml) or a preset: hyp=scratch-low or hyp=scratch-high"
    ]
    assert not run.exists()
