"""Train a YOLOv5 detector: `python -m yolo5l.train [overrides]` (or `yolo5l-train`).

Examples:
    python -m yolo5l.train experiment=smoke
    python -m yolo5l.train model=yolov5n data.file=datasets/coco128/data.yaml trainer.max_epochs=30
    python -m yolo5l.train weights=yolov5s.pt data=coco128                  # fine-tune ultralytics weights
    python -m yolo5l.train resume=true                                      # continue the most recent run
    python -m yolo5l.train trainer=ddp trainer.devices=2 data.batch_size=32 # DDP, 16 images per device
    python -m yolo5l.train -m data.batch_size=8,16 data.num_workers=0,2     # sweep + summary table

`data.batch_size` is the total batch over all devices, as YOLOv5's `--batch-size` (each device gets
batch_size / devices); `data.batch_size=-1` finds the largest batch that fits (one device only).

`resume=<path to last.ckpt>` continues an interrupted run with its optimizer, EMA and epoch counter;
`resume=true` picks the newest `checkpoints/last.ckpt` among the runs next to this run's folder
(`runs/train/*` by default). Pass the same overrides as the interrupted run: its `.hydra/overrides.yaml`
lists them. A finished run cannot be resumed; start a new one with `weights=<its weights.pt>`.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # the collector stays off through the imports: see yolo5l._cli.pause_gc
    gc.disable()

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from yolo5l._cli import (
    UserError,
    guarded,
    is_rank_zero,
    one_console_line_per_log,
    print_outputs,
    relpath,
    resume_gc,
    run_entry_point,
    unfreeze_start_up,
)
from yolo5l.config import config_choices

log_prefix = "[yolo5l]"


def _info(msg: str) -> None:
    if is_rank_zero():
        print(f"{log_prefix} {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- checks


def num_devices(trainer_cfg: DictConfig) -> int:
    """How many processes training will use: devices per node x nodes (`auto`/-1 counted on this machine)."""
    devices = trainer_cfg.get("devices", 1)
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    if devices in ("auto", -1, "-1"):
        cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        n = torch.cuda.device_count() if cuda else 1
        if devices == "auto" and not cuda:
            n = 1
    elif isinstance(devices, int):
        n = devices
    else:
        n = len(list(devices))
    return max(1, n) * int(trainer_cfg.get("num_nodes", 1) or 1)


def validate(cfg: DictConfig, multirun: bool = False) -> int:
    """Check the values a user typically gets wrong; raise `UserError` with one sentence naming the fix.

    Returns:
        The number of training processes (devices x nodes).
    """
    world = num_devices(cfg.trainer)
    model_name = HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None
    if model_name is not None and model_name not in config_choices("model"):
        raise UserError(f"unknown model {model_name!r}: choose one of {', '.join(config_choices('model'))}")
    data = cfg.data
    file = data.get("file")
    if file is not None and not Path(str(file)).is_file():
        raise UserError(
            f"dataset file {str(file)!r} not found: pass data.file=<path to a data yaml> or data=synthetic"
        )
    imgsz = int(data.imgsz)
    if imgsz <= 0 or imgsz % 32:
        raise UserError(
            f"data.imgsz={imgsz} is not a positive multiple of 32 (the largest stride): try {_round32(imgsz)}"
        )
    batch = int(data.batch_size)
    if batch == -1:
        if world > 1:
            raise UserError(
                f"data.batch_size=-1 (find the largest batch) needs a single device, got {world}: "
                "tune on one device, then pass the batch size"
            )
    elif batch <= 0:
        raise UserError(f"data.batch_size={batch} must be positive (or -1 to find the largest that fits)")
    elif batch % world:
        raise UserError(
            f"data.batch_size={batch} (the total over all devices) does not divide by the {world} devices: "
            f"use a multiple of {world}"
        )
    strategy = str(cfg.trainer.get("strategy", "auto"))
    if multirun and world > 1 and "spawn" not in strategy and "fork" not in strategy:
        raise UserError(
            "DDP re-launches this script per device, which re-runs the whole sweep: in a multirun (-m) use "
            "trainer.strategy=ddp_spawn, or sweep on one device"
        )
    freeze = cfg.get("freeze")
    if freeze is not None and not isinstance(freeze, int) and not OmegaConf.is_list(freeze):
        raise UserError(f"freeze={freeze!r} must be an int N (first N layers) or a list of layer indices")
    weights = cfg.get("weights")
    if weights and not Path(str(weights)).is_file():
        raise UserError(f"weights file {str(weights)!r} not found")
    from yolo5l.metrics import MAP_BACKENDS
    from yolo5l.module import OPTIMIZER_IMPLS

    module_opts = cfg.get("module") or {}
    for key, allowed in (("map_backend", MAP_BACKENDS), ("optimizer_impl", OPTIMIZER_IMPLS)):
        value = module_opts.get(key)
        if value is not None and str(value) not in allowed:
            raise UserError(f"module.{key}={value!r} is not one of: {', '.join(allowed)}")
    return world


def _round32(x: int) -> int:
    return max(32, round(x / 32) * 32)


def resolve_resume(resume: Any, output_dir: Path, max_epochs: int | None) -> str | None:
    """The checkpoint to resume from (`None`, a path, or `True` = newest last.ckpt beside `output_dir`).

    Raises:
        UserError: The checkpoint does not exist, none was found, or its run already finished.
    """
    if resume is None or resume is False:
        return None
    if resume is True or str(resume).lower() == "true":
        runs_root = output_dir.parent
        found = [
            p
            for pattern in ("*/checkpoints/last.ckpt", "*/*/checkpoints/last.ckpt")
            for p in runs_root.glob(pattern)
            if output_dir not in p.parents
        ]
        if not found:
            raise UserError(f"resume=true found no */checkpoints/last.ckpt under {runs_root}: pass resume=<path>")
        path = max(found, key=lambda p: p.stat().st_mtime)
    else:
        path = Path(str(resume))
        if not path.is_file():
            raise UserError(f"resume checkpoint {str(path)!r} not found: pass the last.ckpt of an interrupted run")
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if "epoch" not in ckpt or "state_dict" not in ckpt:
        raise UserError(
            f"{path} is not a training checkpoint (no optimizer/epoch state): start a new run with weights={path}"
        )
    done = int(ckpt["epoch"]) + 1  # epochs completed when it was written at an epoch end
    if max_epochs is not None and max_epochs >= 0 and done >= max_epochs:
        raise UserError(
            f"{path} already trained {done} of {max_epochs} epochs, nothing to resume: start a new run with "
            f"weights={path} (or raise trainer.max_epochs, which changes the LR schedule)"
        )
    _info(f"resuming from {relpath(path)} (epoch {done} of {max_epochs})")
    return str(path)


# ------------------------------------------------------------------------------------ hardware choices


def cpu_has_bf16() -> bool:
    """True on CPUs with AMX or AVX512-BF16 (where bf16 autocast is fast), from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _uses_cuda(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_precision(precision: Any, accelerator: str) -> Any:
    """`auto` -> 16-mixed on CUDA, bf16-mixed on CPUs with AMX/AVX512-BF16, else 32-true; other values unchanged."""
    if str(precision) != "auto":
        return precision
    if _uses_cuda(accelerator):
        return "16-mixed"
    return "bf16-mixed" if cpu_has_bf16() else "32-true"


# ------------------------------------------------------------------------------------------ building


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def instantiate_group(node: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a named group node (callbacks, loggers)."""
    if not node:
        return []
    return [instantiate(v, _convert_="all") for v in node.values() if OmegaConf.is_dict(v) and "_target_" in v]


def freeze_layers(model: torch.nn.Module, freeze: int | Sequence[int] | None) -> list[str]:
    """Stop gradients of layers `model.{i}.` (YOLOv5 --freeze): an int N = layers 0..N-1, or a list of indices.

    BatchNorm running statistics still update, as in YOLOv5. Returns the names frozen.
    """
    if freeze is None:
        return []
    layers = range(int(freeze)) if isinstance(freeze, int) else [int(i) for i in freeze]
    prefixes = tuple(f"model.{i}." for i in layers)
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def load_weights(model: torch.nn.Module, path: str) -> None:
    """Copy the weights of an ultralytics `.pt` or a yolo5l checkpoint into `model` (weights only).

    The file's Detect convolutions are skipped when its class count differs (fine-tuning on new classes).

    Raises:
        UserError: The file is not a YOLOv5 checkpoint, or holds another model size than `model`.
    """
    from yolo5l.weights import load_weights as _load

    try:
        loaded, info = _load(path, num_classes=model.num_classes)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    if (loaded.depth, loaded.width) != (model.depth, model.width):
        raise UserError(
            f"weights {path} are a depth={loaded.depth} width={loaded.width} model but the config builds "
            f"depth={model.depth} width={model.width}: pick the matching model= option"
        )
    model.load_state_dict(loaded.state_dict())
    _info(f"transferred {info.transferred}/{info.total} items from {path}")


def build(cfg: DictConfig, world: int = 1) -> tuple[Any, Any, Any]:
    """Instantiate the DataModule, YOLOv5Module and Trainer that `cfg` describes (no fitting).

    Usable from notebooks after `yolo5l.compose_config(...)`.

    Returns:
        (datamodule, module, trainer).
    """
    from lightning.pytorch import seed_everything

    from yolo5l.module import YOLOv5Module

    seed_everything(int(cfg.seed), workers=True, verbose=False)
    hyp = _plain(cfg.hyp)
    total_batch = int(cfg.data.batch_size)
    per_device = total_batch // world if total_batch > 0 else 16  # -1: the tuner's start point is set below
    module_opts = _plain(cfg.get("module") or {})
    datamodule = instantiate(
        cfg.data,
        hyp=hyp,
        batch_size=per_device,
        seed=int(cfg.seed),
        channels_last=bool(module_opts.get("channels_last", False)),  # batches in the model's memory format
        _convert_="all",
    )
    model = instantiate(cfg.model, num_classes=datamodule.num_classes, _convert_="all")
    if cfg.get("weights"):
        load_weights(model, str(cfg.weights))
    frozen = freeze_layers(model, _plain(cfg.get("freeze")))
    if frozen:
        _info(f"froze {len(frozen)} parameter tensors (freeze={_plain(cfg.freeze)})")
    module = YOLOv5Module(
        model=model,
        hyp=hyp,
        batch_size=per_device,  # the module scales by world size itself (accumulation to nbs, weight decay)
        imgsz=int(cfg.data.imgsz),
        names=list(datamodule.names),
        optimizer=str(cfg.optimizer),
        cos_lr=bool(cfg.cos_lr),
        compile=bool(cfg.compile),
        **module_opts,
    )

    tcfg = cfg.trainer
    accelerator = str(tcfg.get("accelerator", "auto"))
    cuda = _uses_cuda(accelerator)
    precision = resolve_precision(tcfg.get("precision", "auto"), accelerator)
    if str(tcfg.get("precision", "auto")) == "auto":
        _info(f"precision auto -> {precision} ({'CUDA' if cuda else 'CPU bf16' if cpu_has_bf16() else 'CPU'})")
    overrides: dict[str, Any] = {"precision": precision}
    if tcfg.get("benchmark") is None:
        overrides["benchmark"] = cuda
    if tcfg.get("deterministic") is None:
        overrides["deterministic"] = not cuda  # reproducible CPU runs; cudnn.benchmark wins on CUDA
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        from yolo5l.callbacks.sweep import SweepSummary

        hc = HydraConfig.get()
        callbacks.append(
            SweepSummary(hc.sweep.dir, int(hc.job.num), list(hc.overrides.task), str(hc.runtime.output_dir))
        )
    plugins = _checkpoint_plugins(callbacks)
    trainer = instantiate(
        tcfg,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins or None,
        _convert_="all",
        **overrides,
    )
    return datamodule, module, trainer


def _checkpoint_plugins(callbacks: list[Any]) -> list[Any]:
    # Atomic checkpoint writes (temp file + rename) so an interrupted save never leaves a broken last.ckpt.
    try:
        from yolo5l.callbacks.checkpoint import AtomicCheckpointIO
    except ImportError:
        return []
    return [AtomicCheckpointIO()]


def tune_batch_size(trainer: Any, module: Any, datamodule: Any, cfg: DictConfig) -> int:
    """`data.batch_size=-1`: Lightning's `Tuner.scale_batch_size` on one device; returns the batch found."""
    from lightning.pytorch.tuner import Tuner

    tune = cfg.get("tune") or {}
    found = Tuner(trainer).scale_batch_size(
        module,
        datamodule=datamodule,
        mode=str(tune.get("mode", "power")),
        init_val=int(tune.get("init_val", 2)),
        max_val=int(tune.get("max_val", 256)),
        steps_per_trial=int(tune.get("steps_per_trial", 3)),
    )
    if not found:
        raise UserError("data.batch_size=-1: the batch size search found no batch that fits; pass data.batch_size")
    _info(f"batch size search: using data.batch_size={found}")
    return int(found)


def weights_file(trainer: Any, module: Any, output_dir: Path) -> Path:
    """The stripped weights of the run: LastCheckpoint's `weights.pt`, else written here to `output_dir`."""
    for cb in trainer.checkpoint_callbacks:
        name, dirpath = getattr(cb, "weights_name", None), getattr(cb, "dirpath", None)
        if name and dirpath and (Path(dirpath) / name).is_file():
            return Path(dirpath) / name
    from yolo5l.weights import save_checkpoint

    path = output_dir / "weights.pt"
    save_checkpoint(module.model, path, names=list(module.names))
    return path


# ------------------------------------------------------------------------------------------- running


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says, write the run folder, print where everything is; returns the final metrics."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    output_dir = Path(hc.runtime.output_dir)
    world = validate(cfg, multirun=multirun)
    ckpt_path = resolve_resume(cfg.get("resume"), output_dir, cfg.trainer.get("max_epochs"))

    datamodule, module, trainer = build(cfg, world)
    resume_gc()  # set-up is built (the command line paused the collector for it); batch-size search makes cycles
    if int(cfg.data.batch_size) == -1:
        found = tune_batch_size(trainer, module, datamodule, cfg)
        with open_dict(cfg):
            cfg.data.batch_size = found
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    wall = time.perf_counter() - t0

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    unfreeze_start_up()  # this run's objects become collectable (the next run of a sweep needs the memory)
    if trainer.is_global_zero:
        weights = weights_file(trainer, module, output_dir)
        ckpt = next((Path(p) for p in _checkpoint_files(trainer) if p.endswith(".ckpt")), None)
        csv_path = next((Path(lg.path) for lg in trainer.loggers if hasattr(lg, "history")), None)
        tb = any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers)
        print_outputs(
            f"Training done in {wall:.1f} s, {trainer.current_epoch} epoch(s). Outputs:",
            {
                "run folder": relpath(output_dir),
                "weights": relpath(weights),
                "checkpoint": relpath(ckpt) if ckpt else None,
                "logs": f"tensorboard --logdir {relpath(output_dir)}" if tb else None,
                "metrics CSV": relpath(csv_path) if csv_path else None,
                "config": relpath(output_dir / ".hydra" / "config.yaml")
                if (output_dir / ".hydra" / "config.yaml").exists()
                else None,
            },
        )
        if multirun:
            print_outputs("Sweep summary:", {"table": relpath(Path(hc.sweep.dir) / "summary.md")})
    return metrics


def _checkpoint_files(trainer: Any) -> list[str]:
    files = []
    for cb in trainer.checkpoint_callbacks:
        for attr in ("last_model_path", "best_model_path"):
            p = getattr(cb, attr, "")
            if p and os.path.exists(p):
                files.append(p)
        dirpath = getattr(cb, "dirpath", None)
        if dirpath and (Path(dirpath) / "last.ckpt").exists():
            files.append(str(Path(dirpath) / "last.ckpt"))
    return files


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="train")
@guarded
def _hydra_main(cfg: DictConfig) -> float | None:
    one_console_line_per_log()
    metrics = train(cfg)
    # A sweeper optimising something gets mAP@0.5:0.95.
    return metrics.get("val/map")


def main() -> None:
    """Console entry point (`python -m yolo5l.train`, `yolo5l-train`)."""
    run_entry_point(_hydra_main)


if __name__ == "__main__":
    main()
