"""Validation of weights on a dataset split, the work behind `python -m yolo5l.val` (`yolo5l.val`), which the formats
benchmark (`yolo5l.benchmark`) also runs: `validate_weights(cfg)` for a `.pt`, a checkpoint or an exported file;
the table, `metrics.json`, the per-class table, v7.0's Speed line and the plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from yolo5l._cli import running
from yolo5l.base.console import info, print_outputs, warn
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.files import atomic_write
from yolo5l.config import check_val_config
from yolo5l.eval.stage_times import speed_line
from yolo5l.run_info import data_chosen, data_from_weights
from yolo5l.val_tasks import Detector, check_val_options, run_timing_task, split_of

__all__ = ["validate_weights"]

if TYPE_CHECKING:
    from yolo5l.callbacks.save_predictions import SavedOutputs
    from yolo5l.eval.per_class import PerClassResults

    #: The per-class results, the class names and the files written (name -> path).
    _PerClass = tuple[PerClassResults, list[str], dict[str, Path]]

_DEFAULT_IMGSZ = 640
_TABLE = (
    ("precision", "val/precision"), ("recall", "val/recall"), ("mAP@0.5", "val/map_50"), ("mAP@0.5:0.95", "val/map"),
)  # fmt: skip


def validate_weights(cfg: DictConfig) -> dict[str, float]:
    """Run validation as `cfg` (conf/val.yaml) says; returns the `val/*` metrics.

    On the CPU it runs at as many intra-op threads as cores are free at its start
    (`yolo5l.base.hardware.command_threads`), and gives the process its thread count back after it.
    """
    from yolo5l.base.hardware import command_threads

    check_val_config(cfg)
    check_val_options(cfg)
    with command_threads(_device(cfg)):
        return _validate(cfg)


def _device(cfg: DictConfig) -> str:
    """Where the validation runs: `cuda` where `trainer.accelerator` selects CUDA, `cpu` for `cpu` or `auto`
    without a GPU, else the accelerator's name."""
    from yolo5l.base.hardware import uses_cuda

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return "cuda" if uses_cuda(accelerator) else "cpu" if accelerator in ("auto", "cpu") else accelerator


def _validate(cfg: DictConfig) -> dict[str, float]:
    from yolo5l.base.hardware import resolve_precision
    from yolo5l.callbacks.val_plots import ValidationPlots
    from yolo5l.deploy.exported import is_exported
    from yolo5l.models.model_source import model_stride
    from yolo5l.models.weights import load_weights, resolve_weights

    if str(cfg.task) in ("speed", "study"):
        return run_timing_task(cfg, _settle_timing)
    if is_exported(str(cfg.weights)):  # an ONNX / TorchScript file: no LightningModule, a plain loop
        return _validate_exported(cfg)
    try:
        model, loaded = load_weights(resolve_weights(str(cfg.weights)), num_classes=None)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    _set_imgsz(cfg, loaded.imgsz, int(model.stride.max()))
    data_from_weights(cfg, loaded.data)  # without data= on the command line: the weights' own dataset
    datamodule = instantiate(cfg.data, val_split=split_of(cfg), _convert_="all")
    datamodule.stride = model_stride(model)  # rectangular batches: multiples of it (_set_imgsz fitted the size)
    _check_classes(cfg, model.num_classes, datamodule)
    import torch

    from yolo5l.callbacks.progress_bar import with_console_progress
    from yolo5l.callbacks.val_speed import ValidationSpeed

    module = instantiate(cfg.module, model=model, names=list(datamodule.names), _convert_="all")
    out = HydraConfig.get().runtime.output_dir
    plots = ValidationPlots(plots=bool(cfg.get("plots", True)), out_dir=out, print_table=False)  # printed below
    saved = _saved_outputs(cfg, datamodule)
    speed = ValidationSpeed(torch.device(_device(cfg)))
    # a bar on a terminal only (without a bar callback Lightning adds its rich bar, which draws into files too)
    callbacks = [plots, *saved.callbacks(), speed]
    callbacks = with_console_progress(callbacks, cfg.trainer.get("enable_progress_bar", True))
    precision = resolve_precision(cfg.trainer.precision, str(cfg.trainer.accelerator))  # `auto` typed: the conf's rule
    trainer = instantiate(
        cfg.trainer, callbacks=callbacks, precision=precision, profiler=speed.profiler, _convert_="all"
    )
    with running():
        results = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    metrics = {k: float(v) for k, v in results.items()}
    if not trainer.is_global_zero:
        return metrics
    per_class = (plots.results, module.names, plots.files) if plots.results is not None else None
    return _report(metrics, per_class, saved=saved, speed=speed.line(_shape(cfg, datamodule)))


def _shape(cfg: DictConfig, datamodule: Any) -> tuple[int, int, int, int]:
    """The shape of v7.0's Speed line: (batch, 3, imgsz, imgsz), the batch being the largest a device's loader makes
    (`data.val_batch_size` per device, fewer when the split is smaller); rectangular batches are letterboxed to other
    shapes, which v7.0's line does not say either."""
    return (int(datamodule.val_dataset.batch_size), 3, int(cfg.data.imgsz), int(cfg.data.imgsz))


def _saved_outputs(cfg: DictConfig, datamodule: Any) -> SavedOutputs:
    """What `save_txt`, `save_conf`, `save_hybrid` and `save_json` ask for (`save_json=null`: on for COCO's classes,
    as v7.0 turns it on for coco.yaml)."""
    from yolo5l.callbacks.save_predictions import SavedOutputs  # imports Lightning: not before the command runs
    from yolo5l.data.coco2yolo import COCO_NAMES

    save_json = cfg.save_json if cfg.save_json is not None else tuple(datamodule.names) == COCO_NAMES
    return SavedOutputs(
        HydraConfig.get().runtime.output_dir,
        save_txt=bool(cfg.save_txt or cfg.save_hybrid),  # v7.0: --save-hybrid implies --save-txt
        save_conf=bool(cfg.save_conf),
        save_json=bool(save_json),
        anno_json=cfg.anno_json,
        names=list(datamodule.names),
        root=datamodule.spec.root,
        split=datamodule.val_split,
        weights=str(cfg.weights),
        max_det=int(cfg.module.max_det),
        image_files=lambda: datamodule.val_dataset.im_files,  # what was validated (the label scan's survivors)
    )


def _check_classes(cfg: DictConfig, num_classes: int, datamodule: Any) -> None:
    """Refuse weights whose class count is not the dataset's (`data.single_cls=true` takes any model, as v7.0)."""
    if num_classes != datamodule.num_classes and not datamodule.single_cls:
        raise UserError(
            f"{cfg.weights} predicts {num_classes} classes but the dataset has {datamodule.num_classes}: "
            "pass the data= or data.file= the weights were trained on"
        )


def _settle_timing(cfg: DictConfig, detector: Detector) -> None:
    """`task=speed|study`: the image size and the dataset as `task=val` settles them (the weights' own, unless the
    command line chose), and for `study`, which scores the model, its checks of the dataset and the classes; `speed`
    only times it, on the default set when the weights name none."""
    _set_imgsz(cfg, detector.imgsz, detector.stride, detector.exported)
    if str(cfg.task) == "speed" or detector.exported is None:
        data_from_weights(cfg, detector.data)
    else:
        _data_of_exported(cfg, detector.names, detector.data)
    if str(cfg.task) == "study":
        _check_classes(cfg, len(detector.names), instantiate(cfg.data, val_split=split_of(cfg), _convert_="all"))


def _set_imgsz(cfg: DictConfig, imgsz: int | None, stride: int, exported: Any = None) -> None:
    """`data.imgsz=null`: validate at the size the weights were trained at, or YOLOv5's 640 when they do not say; a
    size typed that is not a multiple of the model's largest `stride` is rounded up to one, with a warning (v7.0).
    An `exported` file of one input shape validates at its own size, with a warning when another was typed (as
    predict runs it; v7.0's val.py fails on another size)."""
    from yolo5l.base.image_size import fit_to_stride

    typed = cfg.data.get("imgsz")
    if typed is not None and imgsz and getattr(exported, "size", None) is not None and int(typed) != imgsz:
        (h, w), how = exported.size, "dynamic=true" if exported.format in ("onnx", "openvino", "engine") else "imgsz="
        warn(f"{exported.path.name} takes {h}x{w} images (a fixed input): validating at {imgsz} px, not "
             f"data.imgsz={typed}; export with {how} for other sizes")  # fmt: skip
        typed = imgsz
    with open_dict(cfg):
        cfg.data.imgsz = fit_to_stride(int(typed if typed is not None else imgsz or _DEFAULT_IMGSZ), stride)
    if typed is None:
        why = "the weights' training size" if imgsz else "the weights do not record one"
        info(f"data.imgsz: {cfg.data.imgsz} ({why})")


def _validate_exported(cfg: DictConfig) -> dict[str, float]:
    """Validate an exported file (`yolo5l.val_tasks.validate_exported`) with the module config's NMS and metric, and
    report it (`_report`)."""
    import torch

    from yolo5l.base.hardware import uses_cuda
    from yolo5l.callbacks.val_plots import write_outputs
    from yolo5l.deploy.exported import load_exported
    from yolo5l.eval.stage_times import StageTimes
    from yolo5l.val_tasks import validate_exported

    device = torch.device("cuda" if uses_cuda(str(cfg.trainer.get("accelerator", "auto"))) else "cpu")
    model, names, file_imgsz, stride = load_exported(str(cfg.weights), device)
    _set_imgsz(cfg, file_imgsz, stride, model)
    _data_of_exported(cfg, names, model.data)
    datamodule = instantiate(cfg.data, val_split=split_of(cfg), _convert_="all")
    saved = _saved_outputs(cfg, datamodule)
    _check_classes(cfg, len(names), datamodule)
    if datamodule.single_cls:
        names = datamodule.names
    metric = instantiate(cfg.module.metric, _convert_="all")
    if cfg.get("plots", True):
        metric.set_num_classes(len(names))
    m, times = cfg.module, StageTimes(device)
    with running():
        metrics = validate_exported(
            model, datamodule, metric, m.conf_thres, m.iou_thres, m.max_det, device,
            single_cls=datamodule.single_cls, saver=saved.saver, hybrid=bool(cfg.save_hybrid), times=times,
        )  # fmt: skip
    out, results = HydraConfig.get().runtime.output_dir, metric.per_class()
    files = write_outputs(results, names, out, bool(cfg.get("plots", True)))
    speed = speed_line(times.per_image_ms(), _shape(cfg, datamodule))
    return _report(metrics, (results, list(names), files), saved=saved, speed=speed)


def _data_of_exported(cfg: DictConfig, names: list[str], recorded: str | None) -> None:
    """Without `data=` / `data.file=` on the command line: the dataset the file records (its `data` entry), as for a
    .pt (`data_from_weights`); a file that records none (an older export, ultralytics' own) validates on the default
    synthetic set only when its classes are that set's, with a line saying so; otherwise one error line."""
    from yolo5l.data.coco2yolo import COCO_NAMES
    from yolo5l.data.synthetic import NAMES

    if data_chosen():
        return
    if data_from_weights(cfg, recorded, overrides=[]):
        return
    if cfg.data.get("file") is None and tuple(names) == NAMES:
        root = shown_path(Path(str(cfg.data.synthetic.root)))
        info(f"data: the default synthetic set ({root}): {cfg.weights} does not say which dataset it was trained "
             "on, and its classes are this set's (give data.file= to validate on another)")  # fmt: skip
        return
    hint = "data=coco128 or " if tuple(names) == COCO_NAMES else ""
    raise UserError(
        f"{cfg.weights} does not say which dataset it was trained on: give {hint}data.file=<your data.yaml>"
    )


def _report(
    metrics: dict[str, float],
    per_class: _PerClass | None = None,
    saved: SavedOutputs | None = None,
    speed: str | None = None,
) -> dict[str, float]:
    """Write `metrics.json` into the run folder and print the table, then the per-class table, v7.0's `speed` line
    and the saved predictions (scored against the COCO annotations when there are some); returns `metrics`."""
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, Any] = {}
    if saved is not None:
        metrics.update(saved.finish())
        outputs.update(saved.outputs())
    atomic_write(out / "metrics.json", json.dumps(metrics, indent=2))
    print("\n" + " ".join(f"{name:>13}" for name, _ in _TABLE))
    print(" ".join(f"{metrics.get(key, float('nan')):>13.4f}" for _, key in _TABLE))
    outputs = {"metrics": shown_path(out / "metrics.json"), **outputs}
    if per_class is not None:
        from yolo5l.eval.plots import format_per_class_table

        results, names, files = per_class
        print("\n" + format_per_class_table(results, names))
        outputs["per-class table"] = shown_path(files["per_class.csv"]) if "per_class.csv" in files else None
        drawn = [name for name in files if name != "per_class.csv"]
        outputs["plots"] = f"{len(drawn)} files in {shown_path(out)} ({', '.join(drawn[:2])}, ...)" if drawn else None
    if speed is not None:
        print(speed)
    print_outputs("Outputs:", outputs)
    return metrics
