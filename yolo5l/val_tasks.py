"""`python -m yolo5l.val task=speed|study`, and the plain validation loop they share with exported files.

- `task=speed`: v7.0's per-image line "Speed: pre-process, inference, NMS" at batch 1 and at `data.val_batch_size`,
  on square `data.imgsz` images at v7.0's speed thresholds (conf 0.25, IoU 0.45), after one untimed warm-up batch;
  written as `speed.json`.
- `task=study`: mAP and those times at each of `study_sizes` (v7.0's 256..1536 by 128), as `study.csv` and
  `study.png` (mAP@0.5:0.95 against inference ms per image, and against the image size).

Pre-process is the copy to the device and the uint8 -> [0, 1] float conversion; inference the forward pass and the
decode (every augmented pass with `augment=true`); NMS the suppression. Each stage waits for the device (CUDA
synchronises before its clock stops), so on a GPU the stages add up to the wall time of the loop minus the loading.

Reference: ultralytics/yolov5 v7.0 `val.py::run` (its `Profile` stages, the square loader of the speed task) and
`val.py::main` (`task == 'speed'`, `task == 'study'`), `utils/plots.py::plot_val_study`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from yolo5l.base.console import info
from yolo5l.base.errors import UserError
from yolo5l.base.image_size import check_image_size
from yolo5l.eval.stage_times import StageTimes, speed_line

__all__ = [
    "SPEED_CONF", "SPEED_IOU", "TASKS", "Detector", "check_val_options", "load_detector", "plot_study",
    "run_timing_task", "split_of", "validate_exported", "validation_loop", "write_speed", "write_study",
]  # fmt: skip

#: v7.0's thresholds for `--task speed`.
SPEED_CONF, SPEED_IOU = 0.25, 0.45


@torch.no_grad()
def validation_loop(
    detector: Callable[[Tensor], Tensor],
    datamodule: Any,
    device: torch.device,
    conf_thres: float,
    iou_thres: float,
    max_det: int,
    *,
    metric: Any = None,
    times: StageTimes | None = None,
    saver: Any = None,
    hybrid: bool = False,
    single_cls: bool = False,
    warmup: bool = False,
    autocast: torch.dtype | None = None,
) -> dict[str, float]:
    """`YOLOv5Module.validation_step` for a callable that returns decoded boxes, over `datamodule`'s val loader.

    The same batches, NMS, scaling back to the original images and ground truth as the LightningModule.

    Args:
        detector: (B, 3, H, W) in [0, 1] -> (B, N, 5 + C) decoded boxes (a fused model, `TTADetector`, an exported
            file).
        datamodule: A `YOLODataModule` (set up for validation).
        device: Where the batches go.
        conf_thres: NMS score threshold.
        iou_thres: NMS IoU threshold.
        max_det: Detections kept per image.
        metric: `DetectionMAP` or `COCOMap`, updated per batch; None computes no metric.
        times: Stage clocks (`StageTimes`); None times nothing.
        saver: A `yolo5l.eval.save_preds.PredictionSaver` (txt, JSON entries); None saves nothing.
        hybrid: Add the labels to the NMS candidates (`save_hybrid`).
        single_cls: NMS across classes and every detection class 0 (`data.single_cls`, v7.0's `--single-cls`).
        warmup: Run the first batch once untimed before timing it.
        autocast: Run the detector under `torch.autocast` in this dtype (the trainer's mixed precision).

    Returns:
        `val/<key>` -> value of the metric, as `trainer.validate` reports them; {} without a metric.
    """
    from yolo5l.eval.save_preds import with_label_candidates
    from yolo5l.infer.boxes import labels_to_original, non_max_suppression, to_original

    if metric is not None:
        metric = metric.to(device)
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    clock = times if times is not None else StageTimes(torch.device("cpu"))
    for i, batch in enumerate(datamodule.val_dataloader()):
        images, targets, paths, shapes = batch
        if warmup and i == 0:
            with amp:
                detector(datamodule.on_after_batch_transfer((images.to(device), targets, paths, shapes), 0)[0])
        with clock.stage(0):
            images, targets, _, shapes = datamodule.on_after_batch_transfer(
                (images.to(device, non_blocking=True), targets.to(device), paths, shapes), 0
            )
        bsz, (h, w) = images.shape[0], images.shape[2:]
        with clock.stage(1), amp:
            decoded = detector(images).float()
        if hybrid:
            decoded = with_label_candidates(decoded, targets, (h, w))
        with clock.stage(2):
            dets = non_max_suppression(
                decoded, conf_thres=conf_thres, iou_thres=iou_thres, agnostic=single_cls, multi_label=True,
                max_det=max_det, max_nms=30000,
            )  # fmt: skip
        if single_cls:  # as YOLOv5Module._detect
            for det in dets:
                det[:, 5] = 0
        clock.images += bsz
        dets = to_original(dets, (h, w), shapes)
        if saver is not None:
            saver.add(dets, paths, shapes)
        if metric is not None:
            metric.update(dets, labels_to_original(targets, (h, w), bsz, shapes))
    return {f"val/{k}": float(v) for k, v in metric.compute().items()} if metric is not None else {}


#: Columns of study.csv.
STUDY_COLUMNS = ("imgsz", "precision", "recall", "map_50", "map", "pre_process_ms", "inference_ms", "nms_ms")


def write_study(rows: Sequence[Sequence[float]], path: Path) -> Path:
    """Write study rows (`STUDY_COLUMNS`) as CSV, atomically."""
    from yolo5l.base.files import atomic_write

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(STUDY_COLUMNS)
    for row in rows:
        writer.writerow([int(row[0]), *(f"{v:.6g}" for v in row[1:])])
    return atomic_write(path, buf.getvalue())


def plot_study(rows: Sequence[Sequence[float]], path: Path, label: str) -> Path:
    """study.png: mAP@0.5:0.95 (%) against inference ms per image (v7.0's figure) and against the image size."""
    from yolo5l.eval.plots import new_figure, render
    from yolo5l.infer.annotate import save_rgb

    fig = new_figure(10, 4)
    left, right = fig.subplots(1, 2)
    sizes = [r[0] for r in rows]
    maps = [100 * r[4] for r in rows]
    left.plot([r[6] for r in rows], maps, ".-", linewidth=2, markersize=8, label=label)
    left.set_xlabel("inference (ms/img)")
    right.plot(sizes, maps, ".-", linewidth=2, markersize=8, label=f"{label} mAP@0.5:0.95")
    right.plot(sizes, [100 * r[3] for r in rows], ".--", linewidth=1, markersize=6, label=f"{label} mAP@0.5")
    right.set_xlabel("image size (px)")
    for ax in (left, right):
        ax.set_ylabel("mAP (%)")
        ax.grid(alpha=0.2)
        ax.legend(loc="lower right")
    return save_rgb(render(fig), path)


def write_speed(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """speed.json: one entry per batch size, {shape, pre_process_ms, inference_ms, nms_ms, images}."""
    from yolo5l.base.files import atomic_write

    return atomic_write(path, json.dumps(list(results), indent=2))


# ---- the command line's tasks ----------------------------------------------------------------------------------------
#: `task=` values: a split of the data yaml, or a timing task on the val split.
TASKS = ("val", "test", "train", "speed", "study")


def split_of(cfg: DictConfig) -> str:
    """The data yaml split `task` validates on (`speed` and `study` use val, as v7.0)."""
    task = str(cfg.task)
    return task if task in ("val", "test", "train") else "val"


def check_val_options(cfg: DictConfig) -> None:
    """Check `task`, `study_sizes` and the options exported files cannot take.

    Raises:
        UserError: One line naming the key and the fix.
    """
    from yolo5l.deploy.exported import is_exported

    if str(cfg.task) not in TASKS:
        raise UserError(f"task={cfg.task!r} is not a task: choose one of {', '.join(TASKS)}")
    if str(cfg.task) == "study":
        sizes = list(cfg.study_sizes or [])
        if not sizes or any(not isinstance(s, int) or s <= 0 or s % 32 for s in sizes):
            raise UserError(f"study_sizes={sizes} must be a list of image sizes, each a multiple of 32")
    if cfg.augment and is_exported(str(cfg.weights)):
        raise UserError(f"augment=true needs .pt weights: {cfg.weights} runs its own exported graph; drop augment")
    if float(cfg.module.conf_thres) > 0.001 and str(cfg.task) in ("val", "test", "train"):
        info(f"module.conf_thres={cfg.module.conf_thres} > 0.001 lowers the mAP (v7.0 warns of the same)")
    if cfg.save_hybrid:
        info("save_hybrid=true: the labels join the predictions, so the mAP is that of labels + predictions")
    _check_half(cfg)


def _check_half(cfg: DictConfig) -> None:
    """Refuse a `half` that is not a boolean; say what `half=true` does where it is not v7.0's fp16 on CUDA."""
    from omegaconf import OmegaConf

    from yolo5l.base.hardware import uses_cuda
    from yolo5l.deploy.exported import is_exported

    half = cfg.get("half", False)
    if not isinstance(half, bool):
        raise UserError(f"half={half!r} must be true or false")
    if not half:
        return
    if is_exported(str(cfg.weights)):
        info(f"half=true: {cfg.weights} runs at the precision it was exported with (export half=true for fp16)")
    elif not OmegaConf.is_interpolation(cfg.trainer, "precision"):
        info(f"half=true is ignored: trainer.precision={cfg.trainer.precision} decides")
    elif not uses_cuda(str(cfg.trainer.accelerator)):
        info(
            "half=true on the CPU: bf16 autocast (trainer.precision=bf16-mixed; v7.0 validates in float32 here)"
            if str(cfg.trainer.precision) == "bf16-mixed"
            else "half=true: fp16 runs on CUDA only and this CPU has no bf16 (AMX or AVX512-BF16): validating in "
            "float32"
        )


def _autocast(cfg: DictConfig) -> torch.dtype | None:
    from yolo5l.base.hardware import resolve_precision

    precision = str(resolve_precision(cfg.trainer.get("precision", "auto"), str(cfg.trainer.get("accelerator"))))
    return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)


@dataclass
class Detector:
    """What `load_detector` loads from `weights=`.

    Attributes:
        run: images -> decoded boxes (B, N, 5 + nc).
        imgsz: The image size the file records (None when it records none).
        stride: The model's largest stride (64 for P6): rectangular batches and image sizes are multiples of it.
        names: The model's class names.
        data: The dataset yaml the weights record (None when they record none).
        exported: The `ExportedModel` of an exported file, None for .pt weights.
    """

    run: Callable[[Tensor], Tensor]
    imgsz: int | None
    stride: int
    names: list[str]
    data: str | None
    exported: Any = None


def load_detector(cfg: DictConfig, device: torch.device) -> Detector:
    """The detector of `cfg.weights` on `device`: a fused eval copy of .pt weights (with `TTADetector` when
    `augment`), or an exported file."""
    from yolo5l.deploy.exported import is_exported, load_exported
    from yolo5l.models.weights import load_weights, resolve_weights

    if is_exported(str(cfg.weights)):
        model, names, imgsz, stride = load_exported(str(cfg.weights), device)
        return Detector(model, imgsz, int(stride), list(names), model.data, model)
    try:
        net, loaded = load_weights(resolve_weights(str(cfg.weights)), num_classes=None)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    net = net.fuse().eval().requires_grad_(False).to(device)
    stride = int(net.stride.max())
    if cfg.module.get("channels_last"):
        net = net.to(memory_format=torch.channels_last)
    if cfg.augment:
        from yolo5l.infer.tta import TTADetector

        return Detector(TTADetector(net), loaded.imgsz, stride, list(loaded.names), loaded.data)

    def detector(images: Tensor) -> Tensor:
        return net.decode(net(images))

    return Detector(detector, loaded.imgsz, stride, list(loaded.names), loaded.data)


def run_timing_task(cfg: DictConfig, settle: Callable[[DictConfig, Detector], None]) -> dict[str, float]:
    """`task=speed` or `task=study` (see the module docstring); returns the last size's metrics (study) or {}.
    `settle(cfg, detector)` settles `data.imgsz` and the dataset, as for `task=val`, and checks the classes."""
    from hydra.core.hydra_config import HydraConfig

    from yolo5l._cli import running
    from yolo5l.base.console import print_outputs
    from yolo5l.base.errors import shown_path
    from yolo5l.base.hardware import uses_cuda

    device = torch.device("cuda" if uses_cuda(str(cfg.trainer.get("accelerator", "auto"))) else "cpu")
    loaded = load_detector(cfg, device)
    settle(cfg, loaded)
    detector, stride = loaded.run, loaded.stride
    autocast = None if loaded.exported is not None else _autocast(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    m = cfg.module
    if str(cfg.task) == "speed":
        results = []
        with running():
            for batch in dict.fromkeys((1, int(cfg.data.val_batch_size))):
                datamodule = instantiate(cfg.data, val_split="val", val_batch_size=batch, _convert_="all")
                datamodule.stride = stride
                datamodule.setup("validate")
                datamodule.val_dataset.rect = False  # square images, as v7.0 times them
                times = StageTimes(device)
                validation_loop(
                    detector, datamodule, device, SPEED_CONF, SPEED_IOU, int(m.max_det), times=times, warmup=True,
                    autocast=autocast, single_cls=datamodule.single_cls,
                )  # fmt: skip
                shape = (datamodule.val_dataset.batch_size, 3, datamodule.imgsz, datamodule.imgsz)
                ms = times.per_image_ms()
                print(speed_line(ms, shape))
                results.append(
                    {"shape": list(shape), "images": times.images, **dict(zip(STUDY_COLUMNS[5:], ms, strict=True))}
                )
        print_outputs("Outputs:", {"speed": shown_path(write_speed(results, out / "speed.json"))})
        return {}
    rows, metrics = [], {}
    for size in cfg.study_sizes:
        check_image_size(size, stride, "study_sizes", of="the model")
    with running():
        for size in cfg.study_sizes:
            datamodule = instantiate(cfg.data, val_split="val", imgsz=int(size), _convert_="all")
            datamodule.stride = stride
            times = StageTimes(device)
            metrics = validation_loop(
                detector, datamodule, device, float(m.conf_thres), float(m.iou_thres), int(m.max_det),
                metric=instantiate(m.metric, _convert_="all"), times=times, warmup=True, autocast=autocast,
                single_cls=datamodule.single_cls,
            )  # fmt: skip
            ms = times.per_image_ms()
            keys = ("val/precision", "val/recall", "val/map_50", "val/map")
            rows.append([int(size), *(metrics[k] for k in keys), *ms])
            print(f"study: imgsz {size}: mAP@0.5 {metrics['val/map_50']:.4f}, mAP@0.5:0.95 {metrics['val/map']:.4f}, "
                  f"{speed_line(ms, (datamodule.val_dataset.batch_size, 3, size, size))[7:]}")  # fmt: skip
    csv_path = write_study(rows, out / "study.csv")
    png = plot_study(rows, out / "study.png", Path(str(cfg.weights)).stem)
    print_outputs("Outputs:", {"study table": shown_path(csv_path), "study plot": shown_path(png)})
    return metrics


def validate_exported(
    model: Callable[[Tensor], Tensor],
    datamodule: Any,
    metric: Any,
    conf_thres: float = 0.001,
    iou_thres: float = 0.6,
    max_det: int = 300,
    device: str | torch.device = "cpu",
    single_cls: bool = False,
    **loop_kwargs: Any,
) -> dict[str, float]:
    """The validation of `YOLOv5Module` for a callable that returns decoded boxes (no LightningModule, no loss).

    The same batches, NMS, scaling back to the original images and ground truth as `YOLOv5Module.validation_step`
    (`validation_loop`), so a file exported with dynamic=true gets the `.pt`'s metrics. A file of
    one fixed size cannot take the rectangular batches, so it gets square ones at `data.imgsz`, as ultralytics'
    val.py gives exported models.

    Args:
        model: `ExportedModel` (or any callable images -> (B, N, 5 + nc)).
        datamodule: A `YOLODataModule`.
        metric: `DetectionMAP` or `COCOMap` (`update(dets, gt)`, `compute()`).
        conf_thres: NMS score threshold.
        iou_thres: NMS IoU threshold.
        max_det: Detections kept per image.
        device: Where the batches and the metric go.
        single_cls: NMS across classes and every detection class 0 (`YOLOv5Module(single_cls=True)`).
        **loop_kwargs: `validation_loop`'s options (`saver`, `hybrid`, `times`).

    Returns:
        `val/<key>` -> value, as `trainer.validate` reports them.
    """
    if getattr(model, "size", None) is not None:
        datamodule.setup("validate")
        datamodule.val_dataset.rect = False  # read per item: every image is letterboxed to data.imgsz square
        name = Path(str(getattr(model, "path", "the model"))).name
        info(
            f"{name} takes one input size: validating square {datamodule.imgsz} px images, not rectangular batches "
            "(the mAP differs from the .pt's; export with dynamic=true for the same)"
        )
    return validation_loop(
        model, datamodule, torch.device(device), conf_thres, iou_thres, max_det, metric=metric, single_cls=single_cls,
        **loop_kwargs,
    )  # fmt: skip
