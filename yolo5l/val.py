"""Validate weights on a dataset's val split: `python -m yolo5l.val weights=<weights.pt|yolov5s.pt> [data=...]`.

Prints the mAP table (precision, recall, mAP@0.5, mAP@0.5:0.95) and writes it as `metrics.json` in the run folder.
The model is BN-fused (`fuse=true`) and runs with a large batch (`batch_size`, per device).
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from yolo5l._cli import (
    UserError,
    guarded,
    one_console_line_per_log,
    print_outputs,
    relpath,
    resume_gc,
    run_entry_point,
    unfreeze_start_up,
)
from yolo5l.train import _uses_cuda, resolve_precision


def validate_weights(cfg: DictConfig) -> dict[str, float]:
    """Run validation as `cfg` (conf/val.yaml) says; returns the `val/*` metrics."""
    from yolo5l.module import YOLOv5Module
    from yolo5l.weights import load_weights

    weights = str(cfg.weights)
    if not Path(weights).is_file():
        raise UserError(f"weights file {weights!r} not found: pass weights=<path to weights.pt or yolov5*.pt>")
    if cfg.data.get("file") is not None and not Path(str(cfg.data.file)).is_file():
        raise UserError(f"dataset file {str(cfg.data.file)!r} not found: pass data.file=<path to a data yaml>")
    from yolo5l.metrics import MAP_BACKENDS

    map_backend = str(cfg.get("map_backend", "yolov5"))
    if map_backend not in MAP_BACKENDS:
        raise UserError(f"map_backend={map_backend!r} is not one of: {', '.join(MAP_BACKENDS)}")
    hyp = OmegaConf.to_container(cfg.hyp, resolve=True)
    channels_last = bool(cfg.get("channels_last", True))
    dm = instantiate(
        cfg.data,
        hyp=hyp,
        batch_size=int(cfg.batch_size),
        val_batch_size=int(cfg.batch_size),
        channels_last=channels_last,
        _convert_="all",
    )
    try:
        model, _ = load_weights(weights, num_classes=None)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    if model.num_classes != dm.num_classes:
        raise UserError(f"{weights} predicts {model.num_classes} classes but the dataset has {dm.num_classes}")
    if cfg.fuse:
        model = model.fuse()
    module = YOLOv5Module(
        model=model,
        hyp=hyp,
        batch_size=int(cfg.batch_size),
        imgsz=int(cfg.data.imgsz),
        names=list(dm.names),
        conf_thres=float(cfg.conf_thres),
        iou_thres=float(cfg.iou_thres),
        max_det=int(cfg.max_det),
        channels_last=channels_last,
        map_backend=map_backend,
    )
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    precision = resolve_precision(cfg.trainer.get("precision", "auto"), accelerator)
    trainer = instantiate(
        cfg.trainer,
        precision=precision,
        benchmark=_uses_cuda(accelerator),
        deterministic=False,
        callbacks=[],
        _convert_="all",
    )
    resume_gc()  # set-up is built (the command line paused the collector for it)
    results = trainer.validate(module, datamodule=dm, verbose=False)[0]
    unfreeze_start_up()  # this run's objects become collectable (the next run of a sweep needs the memory)
    metrics = {k: float(v) for k, v in results.items()}
    if trainer.is_global_zero:
        out = Path(HydraConfig.get().runtime.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        keys = [
            ("precision", "val/precision"),
            ("recall", "val/recall"),
            ("mAP@0.5", "val/map_50"),
            ("mAP@0.5:0.95", "val/map"),
        ]
        print("\n" + " ".join(f"{n:>13}" for n, _ in keys))
        print(" ".join(f"{metrics.get(k, float('nan')):>13.4f}" for _, k in keys))
        print_outputs("Outputs:", {"metrics": relpath(out / "metrics.json")})
    return metrics


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="val")
@guarded
def _hydra_main(cfg: DictConfig) -> float | None:
    one_console_line_per_log()
    return validate_weights(cfg).get("val/map")


def main() -> None:
    """Console entry point (`python -m yolo5l.val`, `yolo5l-val`)."""
    run_entry_point(_hydra_main)


if __name__ == "__main__":
    main()
