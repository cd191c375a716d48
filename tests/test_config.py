"""The config tree composes, every group option instantiates, and the entry points' checks and choices hold."""

from __future__ import annotations

import math
import os
import re
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from yolo5l.base import hardware
from yolo5l.base.errors import UserError
from yolo5l.config import (
    CONFIG_MODULE,
    check_export_config,
    check_group_choices,
    check_predict_config,
    check_train_config,
    check_val_config,
    compose_config,
    config_choices,
)
from yolo5l.models.yolo import freeze_layers
from yolo5l.resume import find_resume_checkpoint, merge_resume_config, read_resume_state
from yolo5l.tracking.loggers import CORE_COLUMNS, EpochCSVLogger, read_metrics_csv


def _targets(node):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"]
        for v in node.values():
            yield from _targets(v)
    elif isinstance(node, list):
        for v in node:
            yield from _targets(v)


def _all_config_files():
    root = files(CONFIG_MODULE)
    stack = [root]
    while stack:
        folder = stack.pop()
        for p in folder.iterdir():
            if p.is_dir():
                stack.append(p)
            elif p.name.endswith(".yaml"):
                yield p


def test_every_target_in_conf_resolves():
    # A `_target_` typo anywhere in conf/ fails here, instead of at run time or as a skipped test.
    targets = {t for f in _all_config_files() for t in _targets(yaml.safe_load(f.read_text()))}
    assert {
        "yolo5l.training.module.YOLOv5Module",
        "torch.optim.SGD",
        "yolo5l.data.datamodule.YOLODataModule",
    } <= targets
    for target in sorted(targets):
        assert callable(get_object(target)), target


def test_compose_configs_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """A notebook that composes two runs within a second gets two run folders (`<stamp>`, `<stamp>_2`), as two
    commands do; an output_dir it names is used as it is."""
    import datetime as dt

    import hydra.core.utils
    from hydra.core.hydra_config import HydraConfig

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(hydra.core.utils, "datetime", Frozen)  # Hydra's ${now:...} resolver reads it
    monkeypatch.chdir(tmp_path)
    folders = []
    for _ in range(2):
        compose_config(["experiment=smoke"])
        folders.append(Path(HydraConfig.get().runtime.output_dir))
    assert folders == [tmp_path / "runs/train/2026-01-02_03-04-05", tmp_path / "runs/train/2026-01-02_03-04-05_2"]
    assert all(f.is_dir() for f in folders)
    compose_config(["experiment=smoke"], output_dir=folders[0])
    assert Path(HydraConfig.get().runtime.output_dir) == folders[0]


def test_default_config_composes_and_resolves(tmp_path):
    cfg = compose_config(output_dir=tmp_path / "run")
    assert cfg.model._target_ == "yolo5l.models.yolo.YOLOv5"
    assert cfg.data._target_ == "yolo5l.data.datamodule.YOLODataModule"
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    assert cfg.hyp.lr0 == 0.01
    assert cfg.hyp.momentum == 0.937
    assert cfg.hyp.mosaic == 1.0
    assert cfg.weights is None
    assert cfg.resume is None
    assert cfg.freeze is None
    assert cfg.seed == 0
    assert cfg.module._target_ == "yolo5l.training.module.YOLOv5Module"
    assert cfg.module.optimizer._target_ == "torch.optim.SGD"
    assert cfg.module.scheduler._target_ == "yolo5l.training.optim.LinearLR"
    assert cfg.module.metric._target_ == "yolo5l.eval.metrics.DetectionMAP"
    assert cfg.module.compile is False
    # The module's keys are one hop from the hyperparameters they feed.
    assert (cfg.module.optimizer.lr, cfg.module.weight_decay) == (cfg.hyp.lr0, cfg.hyp.weight_decay)
    assert {k: cfg.data.hyp[k] for k in cfg.data.hyp} == {k: cfg.hyp[k] for k in cfg.data.hyp}  # augmentation keys
    assert cfg.data.seed == cfg.seed
    assert {"lr0", "box", "iou_t"}.isdisjoint(cfg.data.hyp)  # the data gets its own keys only
    assert (cfg.module.loss.box, cfg.module.loss.anchor_t) == (cfg.hyp.box, cfg.hyp.anchor_t)
    # ${hydra:runtime.output_dir} resolves to the requested folder everywhere it is used.
    out = str((tmp_path / "run").absolute())
    assert cfg.trainer.default_root_dir == out
    assert cfg.logger.tensorboard.save_dir == out
    assert cfg.logger.csv.save_dir == out
    assert cfg.callbacks.checkpoint.dirpath == f"{out}/checkpoints"
    t = cfg.trainer
    assert t.use_distributed_sampler is False
    assert t.gradient_clip_val is None
    assert t.num_sanity_val_steps == 0
    # The TensorBoard logger comes first: trainer.logger is the one callbacks draw images on.
    assert list(cfg.logger) == ["tensorboard", "csv"]


def test_public_override_names(tmp_path):
    cfg = compose_config(
        [
            "model=yolov5n",
            "data.file=some/data.yaml",
            "data.imgsz=416",
            "data.batch_size=32",
            "data.num_workers=0",
            "data.cache=disk",
            "trainer.max_epochs=7",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
            "trainer.precision=32",
            "weights=w.pt",
            "resume=true",
            "seed=3",
            "freeze=[0,1,2]",
        ],
        output_dir=tmp_path,
    )
    assert cfg.model.width == 0.25
    assert cfg.data.file == "some/data.yaml"
    assert cfg.data.imgsz == 416
    assert cfg.trainer.max_epochs == 7
    assert cfg.trainer.devices == 2
    assert cfg.trainer.precision == 32
    assert cfg.weights == "w.pt"
    assert cfg.resume is True
    assert cfg.seed == 3
    assert list(cfg.freeze) == [0, 1, 2]


def test_compose_config_names_a_string_where_a_list_was_meant(tmp_path):
    for wrong in ("train", "model=yolov5n"):
        with pytest.raises(TypeError, match=r"compose_config: overrides is a list of 'key=value' strings"):
            compose_config(wrong, output_dir=tmp_path)


def test_scratch_high_differs_from_low_where_yolov5_does(tmp_path):
    low = compose_config(output_dir=tmp_path).hyp
    high = compose_config(["hyp=scratch-high"], output_dir=tmp_path).hyp
    changed = {k for k in low if low[k] != high[k]}
    assert changed == {"lrf", "cls", "obj", "scale", "mixup", "copy_paste"}
    assert (high.lrf, high.cls, high.obj, high.scale, high.mixup, high.copy_paste) == (0.1, 0.3, 0.7, 0.9, 0.1, 0.1)


@pytest.mark.heavy
@pytest.mark.parametrize("name", config_choices("model"))
def test_every_model_instantiates(tmp_path, name):
    cfg = compose_config([f"model={name}"], output_dir=tmp_path)
    model = instantiate(cfg.model, num_classes=3, _convert_="all")
    if name not in ("yolov5l", "yolov5x", "yolov5l6", "yolov5x6"):  # the big ones: construction is the check
        size = 2 * int(model.stride.max())  # 64, or 128 for P6 (BatchNorm needs more than one value in training)
        heads = model(torch.zeros(1, 3, size, size))
        strides = (8, 16, 32, 64) if name.endswith("6") else (8, 16, 32)
        assert [tuple(h.shape) for h in heads] == [(1, 3, size // s, size // s, 8) for s in strides]
    assert model.num_classes == 3


@pytest.mark.parametrize("name", config_choices("trainer"), ids=lambda n: f"trainer-{n}")  # not the `gpu` marker
def test_every_trainer_instantiates(tmp_path, name):
    from lightning.pytorch import Trainer

    cfg = compose_config([f"trainer={name}", "trainer.accelerator=cpu", "trainer.precision=32"], output_dir=tmp_path)
    trainer = instantiate(cfg.trainer, benchmark=False, deterministic=False, logger=False, enable_checkpointing=False)
    assert isinstance(trainer, Trainer)
    assert trainer.num_devices == (2 if name == "ddp" else 1)
    assert trainer.log_every_n_steps == 50


@pytest.mark.parametrize("name", ["tensorboard", "csv", "none"])  # mlflow, wandb: tests/test_tracking.py
def test_every_core_logger_instantiates(tmp_path, name):
    cfg = compose_config([f"logger={name}"], output_dir=tmp_path)
    loggers = [instantiate(v) for v in (cfg.get("logger") or {}).values()]
    kinds = sorted(type(lg).__name__ for lg in loggers)
    assert (
        kinds == {"tensorboard": ["EpochCSVLogger", "TensorBoardLogger"], "csv": ["EpochCSVLogger"], "none": []}[name]
    )
    for lg in loggers:
        assert str(lg.save_dir) == str(tmp_path.absolute())
        if type(lg).__name__ == "TensorBoardLogger":
            # name="" and version="": events in the run folder
            assert os.path.normpath(lg.log_dir) == str(tmp_path.absolute())


@pytest.mark.parametrize("name", config_choices("callbacks"))
def test_every_callback_instantiates(tmp_path, name):
    from lightning.pytorch.callbacks import Callback

    cfg = compose_config([f"callbacks={name}"], output_dir=tmp_path)
    nodes = dict(cfg.get("callbacks") or {})
    for node in nodes.values():
        assert isinstance(instantiate(node, _convert_="all"), Callback)


@pytest.mark.parametrize("name", config_choices("data"))
def test_every_data_preset_composes(tmp_path, name):
    cfg = compose_config([f"data={name}"], output_dir=tmp_path)
    assert cfg.data._target_ == "yolo5l.data.datamodule.YOLODataModule"
    assert cfg.data.imgsz % 32 == 0


def test_data_and_module_instantiate_from_the_config_alone(tmp_path):
    from yolo5l.eval.coco_map import COCOMap
    from yolo5l.eval.metrics import DetectionMAP
    from yolo5l.training.optim import CosineLR

    cfg = compose_config(
        ["experiment=smoke", f"data.synthetic.root={tmp_path / 'syn'}", "data.batch_size=8"], output_dir=tmp_path / "r"
    )
    dm = instantiate(cfg.data, _convert_="all")
    assert dm.num_classes == len(dm.names) > 0
    assert (dm.batch_size, dm.rank_batch_size) == (8, 8)  # the total batch; one rank without a trainer
    assert dm.hyp["mosaic"] == cfg.hyp.mosaic
    model = instantiate(cfg.model, num_classes=dm.num_classes)
    module = instantiate(cfg.module, model=model, names=dm.names, _convert_="all")
    assert isinstance(module.map_metric, DetectionMAP)
    assert module.loss.num_classes == dm.num_classes
    opt = module.optimizer_factory([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["nesterov"], opt.defaults["lr"]) == (True, cfg.hyp.lr0)
    swaps = ["module/metric=coco", "module/scheduler=cosine", "module/optimizer=adamw"]
    cfg = compose_config(swaps, output_dir=tmp_path)
    module = instantiate(cfg.module, model=model, names=dm.names, _convert_="all")
    assert isinstance(module.map_metric, COCOMap)
    opt = module.optimizer_factory([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (cfg.hyp.momentum, 0.999)
    assert isinstance(module.scheduler_factory(optimizer=opt, epochs=10), CosineLR)


@pytest.mark.parametrize("name", [*config_choices("experiment"), *config_choices("debug")])
def test_every_experiment_and_debug_composes(tmp_path, name):
    group = "experiment" if name in config_choices("experiment") else "debug"
    cfg = compose_config([f"{group}={name}"], output_dir=tmp_path)
    assert cfg.data.imgsz % 32 == 0


def test_val_and_predict_configs_compose(tmp_path):
    val = compose_config(["weights=w.pt"], config_name="val", output_dir=tmp_path)
    assert val.weights == "w.pt"
    assert val.module.conf_thres == 0.001
    assert "model" not in val
    assert "model" not in compose_config(["weights=w.pt", "source=a.jpg"], "predict", tmp_path)
    pred = compose_config(["weights=w.pt", "source=img.jpg"], config_name="predict", output_dir=tmp_path)
    assert pred.conf_thres == 0.25
    assert pred.iou_thres == 0.45


# ------------------------------------------------------------------------------------------- rules


def test_precision_auto_rule(monkeypatch):
    assert hardware.resolve_precision(32, "cpu") == 32  # explicit wins
    assert hardware.resolve_precision("bf16-mixed", "gpu") == "bf16-mixed"
    assert hardware.resolve_precision("auto", "gpu") == "16-mixed"
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    assert hardware.resolve_precision("auto", "cpu") == "bf16-mixed"
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    assert hardware.resolve_precision("auto", "cpu") == "32-true"


def test_trainer_defaults_say_what_auto_means(tmp_path, monkeypatch):
    """conf/trainer/default.yaml resolves precision, deterministic and benchmark by the machine's accelerator
    (yolo5l.base.resolvers); a value given on the command line is used as given."""
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    cpu = compose_config(["trainer.accelerator=cpu"], output_dir=tmp_path / "cpu").trainer
    assert (cpu.precision, cpu.deterministic, cpu.benchmark) == ("32-true", True, False)
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    assert cpu.precision == "bf16-mixed"  # resolved when read
    gpu = compose_config(["trainer.accelerator=cuda"], output_dir=tmp_path / "gpu").trainer
    assert (gpu.precision, gpu.deterministic, gpu.benchmark) == ("16-mixed", False, True)
    exact = compose_config(["trainer.accelerator=cuda", "trainer.deterministic=true"], output_dir=tmp_path / "x")
    assert exact.trainer.benchmark is False  # the autotuner's timing-based choice would break the repeatability
    given = compose_config(["trainer.precision=32", "trainer.benchmark=true"], output_dir=tmp_path / "given").trainer
    assert (given.precision, given.benchmark) == (32, True)


def test_tensor_cores_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.use_tensor_cores("gpu")
    assert hardware.use_tensor_cores("auto")
    assert not hardware.use_tensor_cores("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not hardware.use_tensor_cores("auto")
    assert calls == ["high", "high"]


def test_loader_workers_rule():
    assert hardware.loader_workers(3, on_accelerator=False) == 3
    assert hardware.loader_workers("auto", on_accelerator=False) == 0
    assert hardware.loader_workers("auto", on_accelerator=True, local_devices=64) == 1  # at least one


def test_loader_workers_auto_uses_the_cores_a_device_has(monkeypatch):
    """A 16-core host: one GPU gets 15 workers (its process keeps a core), two get 7 each; no cap at v7.0's 8."""
    monkeypatch.setattr(hardware, "owned_cores", lambda: 16)
    assert hardware.loader_workers("auto", on_accelerator=True, local_devices=1) == 15
    assert hardware.loader_workers("auto", on_accelerator=True, local_devices=2) == 7
    assert hardware.loader_workers("auto", on_accelerator=False, local_devices=1) == 0


def test_num_devices_uses_lightnings_parser():
    cfg = OmegaConf.create
    assert hardware.num_devices(cfg({"devices": 2, "accelerator": "cpu"})) == 2
    assert hardware.num_devices(cfg({"devices": "2", "accelerator": "cpu"})) == 2
    assert hardware.num_devices(cfg({"devices": 2, "num_nodes": 2, "accelerator": "cpu"})) == 4
    assert hardware.num_devices(cfg({"devices": "auto", "accelerator": "cpu"})) == 1
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"trainer\.devices"):
            hardware.num_devices(cfg({"devices": [0, 1], "accelerator": "gpu"}))


#: (key, value as typed, the line): each key's own check, the same wherever it runs.
VALUE_MISTAKES = [
    ("data.imgsz", "-64", "data.imgsz=-64 must be a positive image size in pixels"),
    ("data.imgsz", "abc", "data.imgsz='abc' must be a whole number"),
    ("data.imgsz", "null", "data.imgsz=null: training needs an image size"),
    ("trainer.max_epochs", "abc", "trainer.max_epochs='abc' must be a whole number"),
    ("data.cache", "gpu", "data.cache='gpu' is not one of: none, ram, disk"),
    ("data.reduced_decode", "maybe", "data.reduced_decode='maybe' must be true or false"),
    ("data.val_reduced_decode", "1", "data.val_reduced_decode=1 must be true or false"),
    ("data.num_workers", "-2", "data.num_workers=-2 must be at least 0"),
    ("data.batch_size", "0", "data.batch_size=0 must be positive"),
    ("data.batch_size", "abc", "data.batch_size='abc' must be a whole number"),
    ("module.optimizer_impl", "adam", "module.optimizer_impl='adam' is not one of: auto, fused, foreach, loop"),
    ("freeze", "abc", "freeze='abc' must be an int"),
]


@pytest.mark.parametrize(("key", "value", "needle"), VALUE_MISTAKES)
def test_a_bad_value_is_refused_by_compose_config_and_by_the_train_check(tmp_path, key, value, needle):
    """The notebook's `compose_config` refuses the value with the command's line, before any folder is made; the
    check of a run (`check_train_config`) refuses it too in a config changed after composing."""
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        compose_config([f"{key}={value}"], output_dir=tmp_path / "refused")
    assert "\n" not in str(e.value)
    assert e.value.__cause__ is None  # no Hydra or OmegaConf error below it
    assert e.value.__suppress_context__
    assert not (tmp_path / "refused").exists()
    cfg = compose_config([], output_dir=tmp_path / "run")
    OmegaConf.update(cfg, key, yaml.safe_load(value))
    with pytest.raises(UserError, match=re.escape(needle)):
        check_train_config(cfg)


def test_compose_config_refuses_an_unknown_key_with_the_command_lines_words(tmp_path):
    """`trainer.max_epoch=2` in a notebook: the line `python -m yolo5l.train` prints, not Hydra's advice to add a +
    (which would send the key on to Lightning's Trainer)."""
    from yolo5l.overrides import check_overrides

    typed = ["experiment=smoke", "trainer.max_epoch=2"]
    with pytest.raises(UserError) as e:
        compose_config(typed, output_dir=tmp_path / "refused")
    line = "trainer.max_epoch=2: unknown key trainer.max_epoch; did you mean trainer.max_epochs?"
    assert str(e.value) == line
    with pytest.raises(UserError) as cli:
        check_overrides(typed, "train")  # the command line's check
    assert str(cli.value) == line
    with pytest.raises(UserError, match=r"^\+trainer\.max_epoch=2: Trainer \(trainer\) takes no argument 'max_epoch'; "
                       r"did you mean trainer\.max_epochs\?$"):  # fmt: skip
        compose_config(["+trainer.max_epoch=2"], output_dir=tmp_path / "refused")  # Hydra's advice, followed
    with pytest.raises(UserError, match=r"^unknown model 'yolov5q': choose one of "):
        compose_config(["model=yolov5q"], output_dir=tmp_path / "refused")
    with pytest.raises(UserError, match=r"^max_det='x' must be a whole number$"):
        compose_config(["weights=w.pt", "max_det=x"], "predict", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["data.batch_size=15", "trainer.devices=2", "trainer.accelerator=cpu"], "does not divide by the 2 devices"),
        (["data.batch_size=-1", "trainer.devices=2", "trainer.accelerator=cpu"], "single device"),
        (["data.file=/nonexistent/data.yaml"], "data.file='/nonexistent/data.yaml': file not found"),
        (["weights=/nonexistent/w.pt"], "weights='/nonexistent/w.pt': file not found"),
        (["data.rect=true", "data.image_weights=true"], "exclude each other"),
    ],
)
def test_train_check_rejects_with_one_sentence(tmp_path, overrides, needle):
    """What takes more than one key's value, or a file: the check of a run, on a config that composes."""
    cfg = compose_config(overrides, output_dir=tmp_path)
    with pytest.raises(UserError, match=needle) as e:
        check_train_config(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "overrides", "needle"),
    [
        ("val", [], "weights= is required"),
        ("val", ["weights=/nonexistent/w.pt"], "file not found"),
        ("val", ["weights={w}", "data.imgsz=0"], "data.imgsz=0 must be a positive image size"),
        ("val", ["weights={w}", "data.cache=gpu"], "data.cache='gpu'"),
        ("predict", ["source=a.jpg"], "weights= is required"),
        ("predict", ["weights={w}"], "source= is required"),
        ("predict", ["weights={w}", "source=a.jpg", "imgsz=-32"], "imgsz=-32 must be a positive image size"),
        ("predict", ["weights={w}", "source=a.jpg", "max_det=x"], "max_det='x' must be a whole number"),
    ],
)
def test_val_and_predict_checks(tmp_path, name, overrides, needle):
    w = tmp_path / "w.pt"
    w.write_bytes(b"")
    check = check_val_config if name == "val" else check_predict_config
    with pytest.raises(UserError, match=needle):  # a value of the wrong kind: compose_config refuses it first
        check(compose_config([o.format(w=w) for o in overrides], config_name=name, output_dir=tmp_path / "run"))


def test_an_exported_model_is_refused_where_pytorch_weights_are_needed(tmp_path):
    """train's and export's weights= need the .pt an export was made from; val and predict run exported files."""
    onnx = tmp_path / "best.onnx"
    onnx.write_bytes(b"\x08\x01 not a pickle")
    fix = "give the .pt it was exported from (best.pt, weights.pt or last.ckpt)"
    cfg = compose_config([f"weights={onnx}"], output_dir=tmp_path / "train")
    with pytest.raises(UserError) as e:
        check_train_config(cfg)
    assert str(e.value) == f"weights={onnx}: an exported model (format=onnx), which cannot be trained from: {fix}"
    folder = tmp_path / "best_openvino_model"
    folder.mkdir()
    (folder / "best.xml").write_text("<net/>")
    with pytest.raises(UserError, match=r"best_openvino_model: an exported model \(format=openvino\), which cannot"):
        check_train_config(compose_config([f"weights={folder}"], output_dir=tmp_path / "train2"))
    with pytest.raises(UserError, match=r"best\.onnx: an exported model \(format=onnx\), which cannot be exported"):
        check_export_config(compose_config([f"weights={onnx}"], "export", tmp_path / "export"))
    check_val_config(compose_config([f"weights={onnx}"], "val", tmp_path / "val"))
    check_predict_config(compose_config([f"weights={folder}", "source=a.jpg"], "predict", tmp_path / "predict"))


def test_group_choices_are_checked_before_composing():
    check_group_choices(["model=yolov5n", "module/metric=coco", "experiment=null", "data.imgsz=320"])
    with pytest.raises(UserError, match="unknown model 'yolov5q': choose one of yolov5l, yolov5l6, yolov5m"):
        check_group_choices(["model=yolov5q"])
    with pytest.raises(UserError, match="unknown module/metric 'voc': choose one of coco, yolov5"):
        check_group_choices(["module/metric=voc"])
    with pytest.raises(UserError, match="unknown data '_base'"):
        check_group_choices(["data=_base"])
    check_group_choices(["hparams_search=evolve", "hparams_search=null"])
    with pytest.raises(UserError, match="unknown hparams_search 'foo': choose one of evolve"):
        check_group_choices(["hparams_search=foo"])


def test_a_file_given_as_a_group_option_gets_the_key_that_takes_it(tmp_path, monkeypatch):
    """v7.0's `--data data.yaml` written `data=data.yaml`: the line says what to write (the file key, or the preset)."""
    monkeypatch.chdir(tmp_path)
    data, models = "coco, coco128, synthetic", ", ".join(config_choices("model"))
    cases = {
        "data=/u/data.yaml": f"unknown data '/u/data.yaml': choose one of {data}; for a dataset yaml write "
        "data.file=/u/data.yaml",
        "data=coco128.yaml": f"unknown data 'coco128.yaml': choose one of {data}; write data=coco128",
        "data=mydata": f"unknown data 'mydata': choose one of {data}",  # no file: the plain line
        "model=yolov5s.yml": f"unknown model 'yolov5s.yml': choose one of {models}; write model=yolov5s",
        "model=path/my.yaml": f"unknown model 'path/my.yaml': choose one of {models}; for a model yaml write "
        "model.cfg=path/my.yaml",
        "logger=x.yaml": "unknown logger 'x.yaml': choose one of clearml, comet, csv, mlflow, none, tensorboard, wandb",
    }
    for arg, message in cases.items():
        with pytest.raises(UserError) as e:
            check_group_choices([arg])
        assert str(e.value) == message
    (tmp_path / "coco128.yaml").write_text("nc: 1\n")  # a file of that name here: either reading
    with pytest.raises(
        UserError, match=r"; write data=coco128 for the preset, or data.file=coco128.yaml for this file$"
    ):
        check_group_choices(["data=coco128.yaml"])
    (tmp_path / "mydata").write_text("nc: 1\n")  # an existing file without a yaml suffix
    with pytest.raises(UserError, match=r"; for a dataset yaml write data.file=mydata$"):
        check_group_choices(["data=mydata"])


def test_train_check_refuses_ddp_in_multirun_but_allows_spawn(tmp_path):
    cfg = compose_config(["trainer.devices=2", "trainer.accelerator=cpu", "trainer.strategy=ddp"], output_dir=tmp_path)
    with pytest.raises(UserError, match="ddp_spawn"):
        check_train_config(cfg, multirun=True)
    assert check_train_config(cfg, multirun=False) == 2
    cfg.trainer.strategy = "ddp_spawn"
    assert check_train_config(cfg, multirun=True) == 2


def test_resume_checks(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(UserError, match="not found"):
        find_resume_checkpoint(str(tmp_path / "missing.ckpt"), tmp_path, exclude=run)
    with pytest.raises(UserError, match="found no"):
        find_resume_checkpoint(True, tmp_path, exclude=run)
    old = tmp_path / "old" / "checkpoints"
    old.mkdir(parents=True)
    torch.save({"epoch": 2, "state_dict": {}, "yolo5l_config": {"seed": 1}}, old / "last.ckpt")
    assert find_resume_checkpoint(True, tmp_path, exclude=run) == old / "last.ckpt"
    with pytest.raises(UserError, match="found no"):
        find_resume_checkpoint(True, tmp_path, exclude=tmp_path / "old")
    state = read_resume_state(old / "last.ckpt")
    assert (state.epochs_done, state.config) == (3, {"seed": 1})
    torch.save({"model": {}}, tmp_path / "w.pt")
    with pytest.raises(UserError, match="not a training checkpoint"):
        read_resume_state(tmp_path / "w.pt")
    (tmp_path / "cut.ckpt").write_bytes((old / "last.ckpt").read_bytes()[:100])
    with pytest.raises(UserError, match=r"cut\.ckpt.* damaged"):
        read_resume_state(tmp_path / "cut.ckpt")


def test_resume_config_takes_the_checkpoints_run_and_only_allowed_overrides(tmp_path):
    saved = OmegaConf.to_container(compose_config(["model=yolov5n", "data.imgsz=128"], output_dir=tmp_path))
    now = compose_config(["trainer.max_epochs=7", "data.num_workers=1"], output_dir=tmp_path)
    merged = merge_resume_config(now, saved, ["trainer.max_epochs=7", "data.num_workers=1"], "last.ckpt")
    assert (merged.model.width, merged.data.imgsz) == (0.25, 128)  # the run's own, not the defaults
    assert (merged.trainer.max_epochs, merged.data.num_workers) == (7, 1)  # allowed to change
    changed = compose_config(["model=yolov5s"], output_dir=tmp_path)
    with pytest.raises(
        UserError,
        match=r"resume: model=yolov5s changes what the run in last\.ckpt trains "
        r"\(model\.width is 0\.25 there, 0\.5 here\); drop it",
    ):  # the leaf, not the whole node
        merge_resume_config(changed, saved, ["model=yolov5s"], "last.ckpt")
    same = compose_config(["model=yolov5n"], output_dir=tmp_path)
    assert merge_resume_config(same, saved, ["model=yolov5n"], "last.ckpt").model.width == 0.25  # agrees: fine


def test_freeze_layers():
    model = torch.nn.Module()
    model.model = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(12)])
    assert len(freeze_layers(model, 10)) == 20  # weight + bias of layers 0..9
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"model.{i}.{k}" for i in (10, 11) for k in ("weight", "bias")
    ]
    for p in model.parameters():
        p.requires_grad_(True)
    assert freeze_layers(model, [1, 11]) == ["model.1.weight", "model.1.bias", "model.11.weight", "model.11.bias"]
    assert freeze_layers(model, None) == []


def test_freezing_every_layer_is_one_line(tmp_path):
    """yolov5n has 25 layers: freeze=25 (or more) would train nothing, and failed deep in the first backward."""
    from yolo5l.train import build

    base = ["experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.imgsz=64"]
    with pytest.raises(UserError, match=r"freeze=25 freezes every layer of the model \(25 layers\), so nothing would "
                                        r"train: freeze fewer \(freeze=10 is v7.0's backbone; 24 leaves"):  # fmt: skip
        build(compose_config([*base, "freeze=25"], output_dir=tmp_path / "all"))
    build(compose_config([*base, "freeze=24"], output_dir=tmp_path / "detect"))  # the Detect layer trains


def test_epoch_csv_logger_one_row_per_epoch(tmp_path):
    lg = EpochCSVLogger(tmp_path)
    # As Lightning logs: step metrics (with "epoch") several times per epoch, then the epoch's val metrics.
    lg.log_metrics({"train/loss_box": 0.5, "epoch": 0}, step=0)
    lg.log_metrics({"train/loss_box": 0.4, "train/images_per_sec": 100.0, "epoch": 0}, step=50)
    lg.log_metrics({"val/map_50": 0.1, "val/map": 0.05, "epoch": 0}, step=99)
    lg.log_metrics({"train/data_wait": 0.25}, step=100)  # logged by a callback without "epoch": last epoch seen
    lg.save()
    lg.log_metrics({"train/loss_box": 0.3, "lr/pg0": 0.01, "epoch": 1}, step=150)
    lg.finalize("success")
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert list(rows[0])[: len(CORE_COLUMNS)] == list(CORE_COLUMNS)
    assert list(rows[0])[-1] == "lr/pg0"
    assert float(rows[0]["train/loss_box"]) == 0.4
    assert float(rows[0]["val/map_50"]) == 0.1
    assert float(rows[0]["train/data_wait"]) == 0.25
    assert rows[1]["val/map"] == ""
    assert lg.history["train/loss_box"] == [0.5, 0.4, 0.3]
    assert not math.isnan(float(rows[1]["train/loss_box"]))


def test_every_conf_folder_ships_in_the_wheel():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    packages = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        "yolo5l.conf" + "".join(f".{part}" for part in p.relative_to(root / "conf").parts)
        for p in [root / "conf", *(root / "conf").rglob("*")]
        if p.is_dir() and any(p.glob("*.yaml"))
    }
    assert folders <= packages, f"add to pyproject's packages: {sorted(folders - packages)}"


@pytest.mark.parametrize(
    ("typed", "stride", "used", "says"),
    [
        (100, 32, 128, "data.imgsz=100 is not a multiple of 32, the model's largest stride: using data.imgsz=128"),
        (32, 32, 64, "data.imgsz=32 is below 64, twice the model's largest stride: using data.imgsz=64"),
        (96, 64, 128, "data.imgsz=96 is not a multiple of 64, the model's largest stride: using data.imgsz=128"),
        (640, 32, 640, None),
    ],
)
def test_training_rounds_an_image_size_up_as_v7_train_does(tmp_path, capsys, typed, stride, used, says):
    """v7.0's train.py: `check_img_size(opt.imgsz, gs, floor=gs * 2)`, one warning line (it was refused here)."""
    from yolo5l.train import fit_image_size

    cfg = compose_config(["experiment=smoke", f"data.imgsz={typed}"], output_dir=tmp_path)
    check_train_config(cfg)  # not refused
    assert fit_image_size(cfg, stride) == used
    assert cfg.data.imgsz == used
    printed = "".join(capsys.readouterr())
    assert (says in printed) if says else "warning" not in printed


def test_the_start_up_block_says_why_the_training_size_is_not_the_one_typed(tmp_path):
    from yolo5l.train import build

    cfg = compose_config(["experiment=smoke", "data.imgsz=100"], output_dir=tmp_path)
    datamodule, _, _ = build(cfg)
    assert datamodule.imgsz == 128
    assert cfg.data.imgsz == 128
    assert cfg.sources.data.imgsz == "command line: 100 rounded up to a multiple of 32, at least 64"


def test_compose_config_takes_an_option_of_a_searched_folder(tmp_path):
    """`hydra.searchpath=[file://<folder>]` adds the folder's options (a search's best_hyp.yaml as `hyp=best_hyp`):
    the check of group options before Hydra composes lets them through, as for a --config-dir."""
    (tmp_path / "conf" / "hyp").mkdir(parents=True)
    preset = Path(__file__).resolve().parents[1] / "conf" / "hyp" / "scratch-low.yaml"
    (tmp_path / "conf" / "hyp" / "mine.yaml").write_text(preset.read_text().replace("lr0: 0.01", "lr0: 0.02"))
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hyp=mine"], output_dir=tmp_path / "r")
    assert cfg.hyp.lr0 == 0.02
    with pytest.raises(UserError, match="unknown hyp 'mien'"):
        compose_config([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hyp=mien"], output_dir=tmp_path / "r2")
