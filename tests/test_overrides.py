"""Every override mistake is one line naming the fix: unknown keys get the closest valid key, a `+key` the target
does not take is refused before anything is built, an argparse-style option gets its override (yolo5l.overrides)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from yolo5l.base.errors import UserError
from yolo5l.overrides import check_overrides, closest_key

TYPOS = [
    # the issue's own
    ("train", ["data.imgsiz=256"], "unknown key data.imgsiz; did you mean data.imgsz?"),
    ("train", ["+data.imgsiz=256"], "YOLODataModule (data) takes no argument 'imgsiz'; did you mean data.imgsz?"),
    # a handful more
    ("train", ["trainer.max_epoch=3"], "did you mean trainer.max_epochs?"),
    ("train", ["imgsz=320"], "unknown key imgsz; did you mean data.imgsz?"),
    ("train", ["data.batchsize=8"], "did you mean data.batch_size?"),
    ("train", ["trainer.device=2"], "did you mean trainer.devices?"),
    ("train", ["weigths=a.pt"], "did you mean weights?"),
    ("train", ["data.cach=ram"], "did you mean data.cache?"),
    ("train", ["hydra.run.dri=runs/x"], "did you mean hydra.run.dir?"),
    ("train", ["~callbacks.emma"], "did you mean callbacks.ema?"),
    ("train", ["+trainer.profilr=simple"], "Trainer (trainer) takes no argument 'profilr'; did you mean trainer.prof"),
    ("train", ["+callbacks.mine._target_=yolo5l.callbacks.val_interval.ValEveryNEpochs", "+callbacks.mine.m=2"],
     "ValEveryNEpochs (callbacks.mine) takes no argument 'm'; it takes: n"),
    ("train", ["+hyp.lr00=0.1"], "nothing in python -m yolo5l.train reads hyp.lr00; did you mean hyp.lr0?"),
    ("train", ["+data.imgsz=320"], "data.imgsz is already a key: drop the +"),
    ("train", ["module.optimizer=adamw"], "pick the option with module/optimizer="),
    ("train", ["--epochs", "3"], "unknown option --epochs: yolo5l takes key=value overrides; write trainer.max_"),
    # the value typed after a v7.0 option carries over to the override; none typed: the placeholder
    ("val", ["--task", "test"], "unknown option --task: yolo5l takes key=value overrides; write task=test"),
    ("val", ["--task"], "write task=val"),
    ("train", ["--epochs", "3", "data.imgsz=64"], "write trainer.max_epochs=3"),
    ("train", ["--epochs=3"], "write trainer.max_epochs=3"),
    ("train", ["--epochs", "data.imgsz=64"], "write trainer.max_epochs=N"),
    ("train", ["--img", "320"], "write data.imgsz=320"),
    ("train", ["--batch", "-1"], "write data.batch_size=-1"),
    ("train", ["--data", "my/data.yaml"], "write data.file=my/data.yaml"),
    ("train", ["--data", "coco128.yaml"], "write data=coco128"),  # v7.0's own data/coco128.yaml: the preset here
    ("train", ["--optimizer", "AdamW"], "write module/optimizer=adamw"),
    ("train", ["--device", "0,1"], "write trainer.devices=[0,1]"),
    ("train", ["--device", "cpu"], "write trainer.accelerator=cpu"),
    ("predict", ["--device", "1"], "write device=cuda:1"),
    ("train", ["epochs=3"], "epochs=3: unknown key epochs; write trainer.max_epochs=3"),
    ("train", ["data.imgsz"], "cannot read the override 'data.imgsz': write key=value"),
    ("train", ["-m", "model=yolov5n,yolov5s", "data.imgsiz=128,256"], "did you mean data.imgsz?"),
    ("val", ["weights=w.pt", "imgsz=320"], "did you mean data.imgsz?"),
    ("val", ["weights=w.pt", "model=yolov5n"], "python -m yolo5l.val has no model group"),
    ("predict", ["weights=w.pt", "source=a.jpg", "conf=0.5"], "did you mean conf_thres?"),
    ("predict", ["weights=w.pt", "source=a.jpg", "+conf_thresh=0.5"],
     "nothing in python -m yolo5l.predict reads conf_thresh; did you mean conf_thres?"),
    ("predict", ["--conf-thres", "0.5"], "write conf_thres=0.5"),
    ("export", ["weights=w.pt", "fromat=onnx"], "did you mean format?"),
    ("export", ["weights=w.pt", "include=onnx"], "write format=onnx (several: format=[onnx,openvino])"),
    ("export", ["weights=w.pt", "format=onnx,openvino"],
     "format=onnx,openvino: values separated by commas are a sweep, one run each (add -m); for a list write "
     "format=[onnx,openvino], for text with commas quote it: format='onnx,openvino'"),
    ("train", ["data.imgsz=128,256"], "write data.imgsz=[128,256]"),
    ("train", ["-m", "hydra.run.dir=a,b"], "hydra.run.dir=a,b: Hydra's own settings (hydra.*) are not swept"),
    # a sweep's values: each gets its job's check before the first job
    ("train", ["-m", "model=yolov5n,yolov5s", "data.batch_size=8,abc"],
     "data.batch_size=8,abc: data.batch_size='abc' must be a whole number"),
    ("val", ["-m", "weights=w.pt", "data.imgsz=range(0,128,64)"], "data.imgsz=0 must be a positive image size"),
    ("export", ["weights=w.pt", "inplace=true"],
     "unknown key inplace; v7.0's --inplace has no counterpart here: the exported decode is written with split"),
    ("export", ["weights=w.pt", "--verbose"],
     "unknown option --verbose: yolo5l takes key=value overrides; v7.0's --verbose has no counterpart here"),
    ("export", ["weights=w.pt", "keras=true"], "--keras has no counterpart here: it picks Keras for TF SavedModel"),
    ("export", ["weights=w.pt", "topk_all=100"], "write max_det=100 (with nms=true)"),
    ("export", ["weights=w.pt", "--agnostic-nms"], "write agnostic_nms=true (with nms=true)"),
    ("export", ["weights=w.pt", "--data", "coco128.yaml"], "write calib_data=coco128.yaml (int8 calibration)"),
]  # fmt: skip

VALID = [
    ("train", ["experiment=smoke", "data.imgsz=64", "trainer.max_epochs=1", "callbacks.val_interval.n=2"]),
    ("train", ["+trainer.profiler=simple", "~callbacks.batch_plotter", "+logger.tensorboard.filename_suffix=.x"]),
    ("train", ["logger=mlflow", "+logger.mlflow.tags.team=vision", "+callbacks.mine={_target_: a.B}"]),
    ("train", ["+callbacks.mine._target_=yolo5l.callbacks.val_interval.ValEveryNEpochs", "+callbacks.mine.n=2"]),
    ("train", ["-m", "model=yolov5n,yolov5s", "data.batch_size=8,16", "hydra.sweep.dir=runs/s"]),
    ("train", ["-m", "hparams_search=evolve", "hydra.sweeper.n_trials=3", "+hydra.job.env_set.A=1"]),
    ("val", ["weights=w.pt", "data=coco128", "data.imgsz=640", "module/metric=coco"]),
    ("predict", ["weights=w.pt", "source=[a.jpg,b.jpg]", "conf_thres=0.5"]),
    ("export", ["weights=w.pt", "format=torchscript", "imgsz=320"]),
    ("export", ["weights=w.pt", "format=[onnx,openvino]", "imgsz=[480,640]", "nms=true", "agnostic_nms=true"]),
    ("export", ["weights=w.pt", "format='onnx,openvino'", "nms=true", "topk_per_class=10"]),
]  # fmt: skip


@pytest.mark.parametrize(("entry", "argv", "needle"), TYPOS)
def test_each_typo_is_one_sentence_with_the_fix(entry, argv, needle):
    with pytest.raises(UserError) as e:
        check_overrides(argv, entry)
    message = str(e.value)
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(("entry", "argv"), VALID)
def test_valid_command_lines_pass(entry, argv):
    check_overrides(argv, entry)


def test_closest_key_prefers_siblings_then_the_same_leaf():
    tree = {"data": {"imgsz": 1, "cache": "none"}, "trainer": {"max_epochs": 1}, "predict": {"imgsz": 2}}
    assert closest_key(tree, "data.imgsiz") == "data.imgsz"
    assert closest_key(tree, "trainer.imgsz") == "data.imgsz"  # the same leaf elsewhere, shallowest first
    assert closest_key(tree, "max_epochs") == "trainer.max_epochs"
    assert closest_key(tree, "nothing.like.it") is None


ENTRY_MISTAKES = [
    ("train", ["data.imgsiz=256"], "did you mean data.imgsz?"),
    ("train", ["+data.imgsiz=256"], "takes no argument 'imgsiz'; did you mean data.imgsz?"),
    ("val", ["weights={w}", "data.imgsiz=256"], "did you mean data.imgsz?"),
    ("predict", ["weights={w}", "source=a.jpg", "iou=0.5"], "did you mean iou_thres?"),
    ("export", ["weights={w}", "--include", "onnx"], "write format=onnx (several: format=[onnx,openvino])"),
]


@pytest.mark.heavy
@pytest.mark.parametrize(("entry", "args", "needle"), ENTRY_MISTAKES)
def test_entry_points_print_one_line_exit_2_and_leave_no_run_folder(tmp_path, entry, args, needle):
    w = tmp_path / "w.pt"
    w.write_bytes(b"not read: the overrides are checked first")
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", f"yolo5l.{entry}", f"hydra.run.dir={run_dir}", *(a.format(w=w) for a in args)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert needle in lines[0]
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]  # nothing else written either


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["a.pt", "b.pt", "--numclasses", "3"], "did you mean --num-classes?"),
     (["weights=a.pt", "b.pt"], "convert takes two paths, not key=value"),
     (["a.pt"], "required: output; usage: python -m yolo5l.convert")],
)  # fmt: skip
def test_convert_usage_mistakes_are_one_line(tmp_path, capsys, monkeypatch, args, needle):
    """In this process: the command line around it is tests/test_cli.py's
    test_a_convert_mistake_on_the_command_line_is_one_line_and_status_2."""
    from test_cli import convert

    monkeypatch.chdir(tmp_path)
    code, lines = convert(args, capsys)
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert needle in lines[0]


def test_an_argument_left_at_its_default_is_added_with_plus():
    with pytest.raises(UserError, match=r"trainer\.profiler is not in the config, but Trainer takes it: add it with "
                       r"\+trainer\.profiler=simple$"):  # fmt: skip
        check_overrides(["trainer.profiler=simple"], "train")


@pytest.mark.heavy
@pytest.mark.parametrize("entry", ["train", "val", "predict", "export"])
def test_every_v7_option_hint_is_a_valid_override(entry):
    """What `--epochs 3` and the others are told to write passes the same check."""
    import re

    from yolo5l.v7_options import V7_OPTIONS

    required = {"val": ["weights=w.pt"], "predict": ["weights=w.pt", "source=a.jpg"], "export": ["weights=w.pt"]}
    for option, hint in V7_OPTIONS[entry].items():
        override = re.sub(r"\s*\(.*\)$", "", hint).split("|")[0]  # the first of the alternatives, no note
        override = re.sub(r"=N$", "=2", re.sub(r"=X$", "=0.1", override))
        check_overrides([*required.get(entry, []), override], entry)  # raises for a hint that is not valid
        assert option.startswith("--")


@pytest.mark.parametrize(
    ("entry", "flag", "value"),
    [("train", "--epochs", "3"), ("train", "--img", "320"), ("train", "--device", "0,1"), ("train", "--device", "cpu"),
     ("train", "--optimizer", "SGD"), ("train", "--cache", "disk"), ("train", "--data", "coco128.yaml"),
     ("val", "--task", "test"), ("val", "--device", "0"), ("val", "--conf-thres", "0.25"),
     ("predict", "--device", "0"), ("export", "--include", "onnx"), ("export", "--img", "320")],
)  # fmt: skip
def test_a_v7_option_hint_with_the_typed_value_is_a_valid_override(entry, flag, value):
    """`--task test` is told `task=test` (not task=val), and that override passes the check."""
    from yolo5l.v7_options import v7_hint

    hint = v7_hint(entry, flag, value)
    assert hint is not None
    assert value.lower() in hint or hint == "data=coco128", hint
    required = {"val": ["weights=w.pt"], "predict": ["weights=w.pt", "source=a.jpg"], "export": ["weights=w.pt"]}
    check_overrides([*required.get(entry, []), *hint.split(" (")[0].split()], entry)


QUIET = ["hydra/job_logging=none", "hydra/hydra_logging=none"]  # no log handlers left in this process


def _counted_app(monkeypatch):
    """A Hydra app of train's config recording what it ran with, and a list of each composition Hydra's loader makes."""
    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.hydra_config import HydraConfig

    from yolo5l.run_info import source_of

    compositions, runs = [], []
    compose = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        compositions.append(kwargs.get("overrides"))
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)

    @hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="train")
    def app(cfg):
        hc = HydraConfig.get()
        imgsz_from = source_of("data.imgsz", list(hc.overrides.task), hc.runtime.choices)  # the start-up block's
        runs.append((hc.mode.name, int(cfg.data.imgsz), cfg.data.get("mine"), Path(hc.runtime.output_dir), imgsz_from))

    return app, compositions, runs


def test_a_run_composes_its_config_once_and_a_sweep_once_before_its_jobs(tmp_path, monkeypatch):
    """The composition that checks the overrides is the one the run gets (Hydra alone composes twice)."""
    from yolo5l._cli import run_hydra_app

    monkeypatch.chdir(tmp_path)
    app, compositions, runs = _counted_app(monkeypatch)
    run_hydra_app(app, "train", ["data.imgsz=96", "hydra.run.dir=run", *QUIET])
    assert len(compositions) == 1
    assert runs == [("RUN", 96, None, tmp_path / "run", "command line")]
    assert "imgsz: 96" in (tmp_path / "run/.hydra/config.yaml").read_text()
    compositions.clear(), runs.clear()
    run_hydra_app(app, "train", ["-m", "data.imgsz=64,96", "hydra.sweep.dir=sweep", *QUIET])
    # the sweep's; then Hydra's: its sweeper checks each job's config before the first job starts, its launcher
    # composes each job as it starts it
    assert len(compositions) == 1 + 2 * 2
    assert [r[:2] for r in runs] == [("MULTIRUN", 64), ("MULTIRUN", 96)]
    assert [r[3].name for r in runs] == ["0", "1"]
    compositions.clear(), runs.clear()
    with pytest.raises(UserError, match=r"^data\.imgsiz=3: unknown key data\.imgsiz; did you mean data\.imgsz\?$"):
        run_hydra_app(app, "train", ["data.imgsiz=3", "hydra.run.dir=bad", *QUIET])
    assert len(compositions) == 1
    assert not runs
    assert not (tmp_path / "bad").exists()


def test_a_config_dir_of_the_users_own_is_checked_as_it_composes(tmp_path, monkeypatch):
    """`--config-dir` adds options (`data=mine`) that the check sees, as the run does, and the start-up block names as
    the source of what they set; a typo is still one line."""
    from yolo5l._cli import run_hydra_app

    mine = tmp_path / "configs" / "data"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("defaults:\n  - synthetic\n  - _self_\nimgsz: 128\nmine: 1\n")
    monkeypatch.chdir(tmp_path)
    app, compositions, runs = _counted_app(monkeypatch)
    cd = ["--config-dir", str(tmp_path / "configs")]
    run_hydra_app(app, "train", [*cd, "data=mine", "hydra.run.dir=run", *QUIET])
    assert len(compositions) == 1
    assert runs == [("RUN", 128, 1, tmp_path / "run", "data=mine")]  # the option's own file says 128
    with pytest.raises(UserError, match=r"^data\.imgsiz=3: unknown key data\.imgsiz; did you mean data\.imgsz\?$"):
        run_hydra_app(app, "train", [*cd, "data=mine", "data.imgsiz=3", *QUIET])
    with pytest.raises(UserError, match=r"^unknown data 'mien': choose one of coco, coco128, mine, synthetic$"):
        run_hydra_app(app, "train", [*cd, "data=mien", *QUIET])
    file_hint = r"^unknown data 'my/d.yaml': choose .*, synthetic; for a dataset yaml write data\.file=my/d\.yaml$"
    with pytest.raises(UserError, match=file_hint):
        run_hydra_app(app, "train", [*cd, "data=my/d.yaml", *QUIET])
    (tmp_path / "configs" / "extra").mkdir()  # a group of the user's own, picked with + (train's defaults lack it)
    (tmp_path / "configs" / "extra" / "one.yaml").write_text("# @package _global_\ndata:\n  imgsz: 160\n")
    run_hydra_app(app, "train", [*cd, "+extra=one", "hydra.run.dir=run2", *QUIET])
    assert runs[-1][1] == 160
    with pytest.raises(UserError, match=r"^--config-dir nowhere: no such folder"):
        run_hydra_app(app, "train", ["--config-dir", "nowhere", *QUIET])


@pytest.mark.parametrize(
    ("argv", "overrides", "multirun"),
    [
        (["data=coco", "-m", "data.batch_size=16,32", "seed=1"], ["data=coco", "data.batch_size=16,32", "seed=1"],
         True),
        (["-m", "seed=1,2"], ["seed=1,2"], True),
        (["seed=1,2", "-m"], ["seed=1,2"], True),
        (["seed=1", "--config-dir", "configs", "data=mine"], ["seed=1", "data=mine"], False),
    ],
)  # fmt: skip
def test_overrides_on_both_sides_of_an_option_are_all_taken_in_order(argv, overrides, multirun):
    """argparse takes the first run of overrides only (Hydra's own parser then refuses the rest): none is lost."""
    from yolo5l.overrides import parse_command_line

    args, got = parse_command_line(argv, "train")
    assert got == overrides
    assert bool(args.multirun) is multirun
