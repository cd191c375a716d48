"""What a run uses, shown before it starts: one block of model, image size, batch, cache, workers, precision,
devices and data, each value with where it came from when that is not the shipped default.

    Training in runs/train/2026-01-05_10-00-00:
      model:      yolov5n, depth 0.33, width 0.25: 1.77 M parameters, 4.1 GFLOPs at 640 px   [weights]
      data:       datasets/mine/data.yaml, 4 classes   [command line]
      image size: 640   [v7.0's default for a dataset file]
      batch:      24 in all, 24 per device   [batch search]
      cache:      none   [fallback: RAM cache disabled: 5000 images need 6.14 GB (x1.1 headroom) but only ...]
      ...

The sources are: `command line`, the config option that set it (`experiment=smoke`, `data=coco128`,
`trainer=cpu`), `v7.0's default for a dataset file` (`${if_file:...}` in conf/data/synthetic.yaml), `weights` for the
model a weights file holds, `batch search`, `auto: <why>` for a value yolo5l resolved (yolo5l/base/hardware.py),
`fallback: <why>` for a value the run fell back to (the AMP check, a cache that does not fit), `the checkpoint` for a
resumed run's own settings, and `the weights` for what val, predict and export take from a weights file.

The values settled while the run is built and set up (`SETTLED`: the model, image size, batch, cache, precision) are
written into the run's config with their sources (`settle`: the key itself, and `sources.<key>`), so that
`.hydra/config.yaml`, every checkpoint's copy of the config (what `resume=` reads) and this block say the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

from yolo5l.base.errors import UserError, shown_path
from yolo5l.config import override_key

__all__ = [
    "SETTLED", "cpu_oversubscription", "data_chosen", "data_from_weights", "epochs_done", "from_scratch_line",
    "model_gflops", "model_source_line", "print_block", "report_outputs", "settle", "settle_build", "settle_cache",
    "source_of", "training_rows", "warn_if_crowded",
]  # fmt: skip

_GLOBAL_GROUPS = ("debug", "experiment", "hparams_search")  # `# @package _global_` options: keys from the root
#: The values a run settles while it is built and set up, each recorded with its source in `sources.<key>`.
SETTLED = ("model", "data.imgsz", "data.batch_size", "data.cache", "trainer.precision")
DEFAULT = "default"  # the source of a value conf/ ships (the block shows none)
FILE_DEFAULT = "v7.0's default for a dataset file"


def _option_keys(group: str, option: str) -> frozenset[str]:
    """Every dotted key the option's `<group>/<option>.yaml` sets (relative to its package), `defaults` left out: the
    file of a `--config-dir` of the run's (searched first, as Hydra searches it), else yolo5l's `conf/`."""
    from hydra.core.hydra_config import HydraConfig

    dirs = []
    if HydraConfig.initialized():
        dirs = [str(s.path) for s in HydraConfig.get().runtime.config_sources if str(s.schema) == "file"]
    return _keys_of_option(group, option, tuple(dirs))


@cache
def _keys_of_option(group: str, option: str, config_dirs: tuple[str, ...]) -> frozenset[str]:
    import yaml

    mine = [Path(d, group, f"{option}.yaml") for d in config_dirs]
    path = next((p for p in mine if p.is_file()), files("yolo5l.conf").joinpath(group, f"{option}.yaml"))
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return frozenset()
    keys: set[str] = set()

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k != "defaults":
                    keys.add(f"{prefix}{k}")
                    walk(f"{prefix}{k}.", v)

    walk("", tree)
    for entry in tree.get("defaults") or []:  # `override /model: yolov5n` (an experiment picks a model)
        if isinstance(entry, dict):
            keys |= {str(k).removeprefix("override ").strip().lstrip("/") for k in entry}
    return frozenset(keys)


def _is_group(key: str) -> bool:
    """Whether `key` (`data`, `module.optimizer`) is a config group: its override picks an option, not values."""
    return files("yolo5l.conf").joinpath(*key.split(".")).is_dir()


def source_of(
    key: str, overrides: Sequence[str] = (), choices: Mapping[str, Any] | None = None, resumed: bool = False
) -> str | None:
    """Where the value of `key` (`data.imgsz`) came from: `command line`, the option that set it
    (`experiment=smoke`, `data=coco128`), `the checkpoint` (resumed run), or None for the shipped default. A group
    override (`data=coco128`) types the group only: the values under it are its option's."""
    for typed in reversed(list(overrides)):
        k = override_key(typed)
        if k == key or (not _is_group(k) and (key.startswith(f"{k}.") or k.startswith(f"{key}."))):
            return "command line"  # the key, a node above or below it
    if resumed:
        return "the checkpoint"
    choices = choices or {}
    for group in _GLOBAL_GROUPS:
        option = choices.get(group)
        if option and key in _option_keys(group, str(option)):
            return f"{group}={option}"
    top, _, rest = key.partition(".")
    option = choices.get(top)
    if option and rest and rest in _option_keys(top, str(option)):
        return f"{top}={option}"
    return None


def model_gflops(model: Any, imgsz: int, stride: int | None = None) -> float | None:
    """GFLOPs of one forward pass at `imgsz` x `imgsz`: the convolutions' multiply-adds (x 2) counted on one image
    of the largest stride's size (`stride`; by default the model's, at least 32: 64 for P6) and scaled by area, as
    ultralytics/yolov5 v7.0 `utils/torch_utils.py::model_info` does (every convolution's cost grows with the area of
    its feature map): 4.5 for yolov5n, 16.4 for yolov5s at 640. None when the model does not run on the probe."""
    import torch
    from torch import nn

    if stride is None:
        strides = getattr(model, "stride", None)
        stride = max(int(strides.max()), 32) if isinstance(strides, torch.Tensor) and strides.numel() else 32
    total = [0]

    def count(conv: nn.Conv2d, _inputs: Any, output: torch.Tensor) -> None:
        kh, kw = conv.kernel_size
        total[0] += 2 * output.numel() * (conv.in_channels // conv.groups) * kh * kw

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.Conv2d)]
    was_training = model.training
    try:
        parameter = next(model.parameters())
        probe = torch.zeros(1, 3, stride, stride, device=parameter.device, dtype=parameter.dtype)
        model.eval()
        with torch.no_grad():
            model(probe)
    except Exception:  # a model that does not run on a small probe: the block leaves the figure out
        return None
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return total[0] / 1e9 * (imgsz / stride) ** 2


def cpu_oversubscription(processes: int, on_cpu: bool, cores: int | None = None) -> str | None:
    """A warning when CPU training starts more processes than the machine has cores, else None."""
    cores = cores or os.cpu_count() or 1
    if not on_cpu or processes <= cores:
        return None
    return (
        f"trainer.devices={processes} on the CPU starts {processes} training processes on {cores} cores: each gets "
        f"under one core and the steps are slower than with trainer.devices={cores}"
    )


def _count(n: float) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"


def _auto(value: Any) -> bool:
    """`auto`, or a conf default that yolo5l.base.resolvers resolves (`${auto_precision:...}`)."""
    return str(value) == "auto" or str(value).startswith("${auto_")


def _raw(cfg: Any, key: str) -> Any:
    """The value of `key` as composed, interpolations unresolved (`${if_file:${.file},640,320}`)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return OmegaConf.to_container(node, resolve=False).get(leaf) if OmegaConf.is_dict(node) else None


def _recorded(cfg: Any, key: str) -> str | None:
    value = OmegaConf.select(cfg, f"sources.{key}", default=None, throw_on_missing=False)
    return None if value is None else str(value)


def _typed_now(cfg: Any, overrides: Sequence[str]) -> list[str]:
    """The overrides that set something: on a resume, a request the run settled typed again (`data.batch_size=-1`,
    `yolo5l.resume.SETTLE_REQUESTS`) sets nothing, its checkpoint holds what the run settled; nor does the image size
    the run's start rounded up, typed again (`data.imgsz=100` for a run at 128: its recorded source stands)."""
    from yolo5l.resume import SETTLE_REQUESTS

    if not cfg.get("resume"):
        return list(overrides)
    requests = {f"{k}={v}" for k, v in SETTLE_REQUESTS.items()}
    size = str(OmegaConf.select(cfg, "data.imgsz", default=""))
    return [
        o for o in overrides
        if o.strip() not in requests and not (override_key(o) == "data.imgsz" and o.partition("=")[2].strip() != size)
    ]  # fmt: skip


def _source(cfg: Any, key: str, overrides: Sequence[str], choices: Mapping[str, Any]) -> str:
    """Where the composed value of `key` came from, before the run settles it: a resumed run's recorded source
    unless this command line types the key; `auto: <why>` for the precision `auto` picks; v7.0's default for a
    dataset file (`${if_file:...}` with `data.file` given); the command line or a config option; else `default`."""
    from yolo5l.base.hardware import precision_reason

    resumed = bool(cfg.get("resume"))
    if resumed and source_of(key, overrides) is None and _recorded(cfg, key) is not None:
        return str(_recorded(cfg, key))
    raw = _raw(cfg, key)
    if key == "trainer.precision" and _auto(raw):
        return f"auto: {precision_reason(str(cfg.trainer.accelerator))}"
    if isinstance(raw, str) and raw.startswith("${if_file:") and cfg.data.get("file"):
        return FILE_DEFAULT
    return source_of(key, overrides, choices, resumed) or DEFAULT


def settle(cfg: Any, key: str, value: Any, source: str) -> None:
    """Record what the run uses for `key` in its config: `value` in the key itself (None leaves it: the model,
    whose build `model_built` records) and where it came from in `sources.<key>`."""
    with open_dict(cfg):
        if value is not None:
            OmegaConf.update(cfg, key, value, merge=False)
        OmegaConf.update(cfg, f"sources.{key}", source, force_add=True)


def settle_build(
    cfg: Any,
    datamodule: Any,
    trainer: Any,
    precision: Any,
    from_weights: bool,
    overrides: Sequence[str] = (),
    choices: Mapping[str, Any] | None = None,
) -> None:
    """Settle what `yolo5l.train.build` decided (`SETTLED`): the model built (`weights` when a weights file chose
    it), the image size and batch as composed (a batch search settles the batch again), the cache as the
    pipeline allows it (the set-up settles it again when the images do not fit: `settle_cache`), and the precision
    the Trainer got (`precision`: a fallback when the AMP check turned a mixed precision into 32-true).

    Args:
        cfg: the run's config, written in place.
        datamodule: the run's YOLODataModule.
        trainer: the run's Trainer (its device decides the pipeline).
        precision: the precision the Trainer was given.
        from_weights: whether `weights=` built the model.
        overrides: the command line's overrides.
        choices: Hydra's group choices (`model: yolov5n`).
    """
    from yolo5l.base.hardware import resolve_precision
    from yolo5l.data.plan import cache_fallback

    choices, overrides = choices or {}, _typed_now(cfg, overrides)
    sources = {key: _source(cfg, key, overrides, choices) for key in SETTLED}  # before any value is written
    if from_weights and not cfg.get("resume"):
        sources["model"] = "weights"
    asked = resolve_precision(cfg.trainer.precision, str(cfg.trainer.accelerator))
    if str(precision) != str(asked):
        sources["trainer.precision"] = f"fallback: the AMP check failed for {asked} on this GPU"
    _, cache, _ = datamodule.resolve_input(trainer.strategy.root_device)
    if cache != str(cfg.data.cache):
        sources["data.cache"] = f"fallback: {cache_fallback(trainer.strategy.root_device)}"
    values = {
        "model": None, "data.imgsz": int(cfg.data.imgsz), "data.batch_size": int(cfg.data.batch_size),
        "data.cache": cache, "trainer.precision": precision,
    }  # fmt: skip
    for key in SETTLED:
        settle(cfg, key, values[key], sources[key])


def settle_cache(cfg: Any, datamodule: Any) -> None:
    """Settle `data.cache` as the training set-up left it: `none` when the images did not fit (RAM, disk or GPU
    memory), with the data module's reason as the source."""
    used, why = getattr(datamodule, "cache_used", None), getattr(datamodule, "cache_reason", "")
    if used is not None and used != str(cfg.data.cache):
        settle(cfg, "data.cache", used, f"fallback: {why}" if why else "fallback")


def _model_text(model: Any, imgsz: int) -> str:
    """`yolov5n, depth 0.33, width 0.25: 1.77 M parameters, 4.5 GFLOPs at 640 px`: the model as built."""
    params = sum(p.numel() for p in model.parameters())
    gflops = model_gflops(model, imgsz)
    flops = f", {gflops:.{1 if gflops >= 1 else 2}f} GFLOPs at {imgsz} px" if gflops is not None else ""
    describe = getattr(model, "describe", None)
    name = describe() if callable(describe) else type(model).__name__
    if hasattr(model, "depth") and "depth" not in name:  # a released size: its multiples too
        name = f"{name}, depth {model.depth:g}, width {model.width:g}"
    return f"{name}: {_count(params)} parameters{flops}"


def training_rows(
    cfg: Any,
    datamodule: Any,
    module: Any,
    trainer: Any,
    overrides: Sequence[str] = (),
    choices: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """The start-up block of a training run: label -> `value   [source]`. The settled values (`SETTLED`) are
    shown as `cfg` records them, with their recorded sources."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from yolo5l.base.hardware import loader_workers

    choices, overrides = choices or {}, _typed_now(cfg, overrides)
    resumed = bool(cfg.get("resume"))

    def row(value: str, *keys: str, why: str | None = None) -> str:
        source = why or next((s for s in (source_of(k, overrides, choices, resumed) for k in keys) if s), None)
        return f"{value}   [{source}]" if source else value

    def settled(value: str, key: str, *typed_with: str) -> str:
        source = _recorded(cfg, key) or _source(cfg, key, overrides, choices)
        if resumed and not any(source_of(k, overrides) for k in (key, *typed_with)):
            source = "the checkpoint" if source in (DEFAULT, "the checkpoint") else f"the checkpoint: {source}"
        return f"{value}   [{source}]" if source != DEFAULT else value

    imgsz = int(cfg.data.imgsz)
    on_cpu = isinstance(trainer.accelerator, CPUAccelerator)
    devices = int(trainer.num_devices) * int(trainer.num_nodes)
    batch = int(cfg.data.batch_size)
    workers = loader_workers(datamodule.num_workers, not on_cpu, int(trainer.num_devices))
    auto_workers = "auto: the CPU's cores go to compute" if on_cpu else "auto: its CPU cores less one"
    pipeline, _, pipeline_why = datamodule.resolve_input(trainer.strategy.root_device)
    if pipeline == "device":
        where = f"on {trainer.strategy.root_device}"
    else:
        where = f"by {workers} worker{'s' * (workers != 1)}" if workers else "in the training process"
    pipeline_text = f"{pipeline}: images decoded and augmented {where}"
    spec = datamodule.spec
    data = shown_path(spec.file) if spec.file is not None else "(a mapping)"
    kind = "cpu" if on_cpu else type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    per_device = f"{batch} in all, {batch // max(1, devices)} per device" if batch > 0 else "the largest that fits"
    nodes = f" ({trainer.num_nodes} nodes)" if trainer.num_nodes > 1 else ""
    rows = {
        "model": settled(_model_text(module.model, imgsz), "model"),
        "data": row(f"{data}, {len(spec.names)} classes", "data.file", "data.synthetic", "data"),
        "image size": settled(str(imgsz), "data.imgsz"),
        "batch": settled(per_device, "data.batch_size"),
        "cache": settled(str(cfg.data.cache), "data.cache"),
        "pipeline": row(pipeline_text, "data.pipeline", why=pipeline_why or None),
        "workers": row(
            f"{workers} per device", "data.num_workers", why=auto_workers if _auto(datamodule.num_workers) else None
        ),
        "precision": settled(str(trainer.precision), "trainer.precision", "trainer.accelerator"),
        "devices": row(f"{devices} {kind}{nodes}", "trainer.devices", "trainer.accelerator"),
        "weights": str(cfg.weights) if cfg.get("weights") else None,
        "resumed from": str(cfg.resume) if resumed else None,
        "epochs": row(str(cfg.trainer.max_epochs), "trainer.max_epochs"),
    }
    return {k: v for k, v in rows.items() if v is not None}


def print_block(title: str, rows: Mapping[str, str | None]) -> None:
    """Print the block (rank 0 only): `title`, then one aligned `label: value   [source]` line per row."""
    from yolo5l.base.console import print_outputs

    print_outputs(title, rows)


#: Overrides that choose a dataset: with one of them on the command line, val keeps it.
_DATA_CHOICES = ("data", "data.file", "data.synthetic")


def data_chosen(overrides: Sequence[str] | None = None) -> bool:
    """Whether the command line (`overrides`, default: the current Hydra run's) chose the dataset: `data=`,
    `data.file=` or `data.synthetic...=`."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return any(override_key(o) in _DATA_CHOICES or override_key(o).startswith("data.synthetic.") for o in overrides)


def data_from_weights(cfg: Any, recorded: str | None, overrides: Sequence[str] | None = None) -> str | None:
    """`python -m yolo5l.val` without `data=` / `data.file=`: validate on the dataset yaml the weights record
    (`yolo5l.models.weights.save_weights(data=...)`), and say so in one line. Returns the yaml taken, or None when the
    command line chose the data or the weights record none.

    Args:
        cfg: the val config (`data.file` is set in place).
        recorded: the weights' dataset yaml (`LoadInfo.data`).
        overrides: the command line's overrides (default: the current Hydra run's).

    Raises:
        UserError: The recorded yaml is not here (validating on the default set instead would score the weights on
            data they were not trained for).
    """
    from yolo5l.base.console import info

    if data_chosen(overrides) or not recorded:
        return None
    if not os.path.isfile(recorded):
        raise UserError(
            f"{cfg.weights} was trained on {recorded}, which is not here: give data.file=<your data.yaml> "
            "(or data=coco128, ...)"
        )
    with open_dict(cfg):
        cfg.data.file = recorded
    info(f"data.file: {shown_path(recorded)} (the dataset the weights were trained on)")
    return recorded


def warn_if_crowded(cfg: Any, world: int) -> None:
    """One warning line when CPU training starts more processes on this machine than it has cores
    (`cpu_oversubscription`); `world`: the processes of the run, all nodes."""
    from yolo5l.base.console import warn
    from yolo5l.base.hardware import uses_cuda

    crowded = cpu_oversubscription(
        world // int(cfg.trainer.get("num_nodes") or 1), not uses_cuda(cfg.trainer.accelerator)
    )
    if crowded:
        warn(crowded)


def model_source_line(cfg: Any, model: Any, loaded: Any) -> str | None:
    """What the model starts from: the weights file's items transferred, or for a dataset of one's own without
    `weights=`, the note that it trains from scratch (`from_scratch_line`); None for a resumed run."""
    if loaded is not None:
        return f"transferred {loaded.transferred}/{loaded.total} items from {cfg.weights} ({model.describe()})"
    return from_scratch_line() if cfg.data.get("file") and not cfg.get("resume") else None


def from_scratch_line() -> str:
    """The note for a run on a dataset of one's own without `weights=` (YOLOv5's train.py fine-tunes yolov5s.pt by
    default)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get() if HydraConfig.initialized() else None
    choice = str(hc.runtime.choices.get("model", "")) if hc is not None else ""
    name = choice if choice.startswith("yolov5") else "yolov5s"
    return (
        f"training from scratch (no weights=); to fine-tune the COCO-pretrained {name} as YOLOv5's train.py does "
        f"by default, add weights={name}.pt"
    )


def report_outputs(
    trainer: Any, module: Any, output_dir: Path, wall: float, sweep_dir: Path | None, best_pt: dict | None = None
) -> None:
    """The closing block of a training run: the best and last validation rows, and where its outputs are (the
    weights leave the run also without a checkpoint callback); the sweep's summary in a multirun. `best_pt`: the
    closing validation of best.pt (`validate_best`), whose figures the best row shows, as the table above it does
    (best.pt holds the weights in half precision: its figures may differ from its epoch's by a rounding)."""
    from yolo5l.base.console import print_outputs
    from yolo5l.base.run_files import checkpoint_dir
    from yolo5l.callbacks.val_summary import ValidationSummary, format_row

    ckpt_dir = checkpoint_dir(trainer)
    if ckpt_dir is None:  # no LastCheckpoint (callbacks=none): the weights still leave the run
        from yolo5l.models.weights import save_weights

        spec = getattr(trainer.datamodule, "spec", None)
        data, imgsz = getattr(spec, "file", None), getattr(trainer.datamodule, "imgsz", None)
        ckpt_dir = save_weights(module.model, output_dir / "weights.pt", module.names, imgsz=imgsz, data=data).parent

    def existing(path: Path | None) -> str | None:
        return shown_path(path) if path is not None and path.exists() else None

    csv = next((Path(lg.path) for lg in trainer.loggers if hasattr(lg, "history")), None)
    tb = any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers)
    summary = next((cb for cb in trainer.callbacks if isinstance(cb, ValidationSummary)), None)
    rows = {"best": summary.best, "last": summary.last} if summary is not None and summary.last else {}
    if rows and best_pt:
        rows["best"] = {**rows["best"], **{k: v for k, v in best_pt.items() if k in rows["best"]}}
    print_outputs(
        f"Training done in {wall:.1f} s, {epochs_done(trainer)}. Outputs:",
        {
            **{f"{k} (epoch {r['epoch']})": format_row(r) for k, r in rows.items()},
            "run folder": shown_path(output_dir),
            "best weights": existing(ckpt_dir / "best.pt" if ckpt_dir else None),  # what val/predict/export take
            "weights": existing(ckpt_dir / "weights.pt" if ckpt_dir else None),
            "checkpoint": existing(ckpt_dir / "last.ckpt" if ckpt_dir else None),
            "logs": f"tensorboard --logdir {shown_path(output_dir)}" if tb else None,
            "metrics CSV": existing(csv),
            "config": existing(output_dir / ".hydra" / "config.yaml"),
        },
    )
    if sweep_dir is not None:
        from yolo5l.callbacks.sweep import record_training_time

        record_training_time(trainer, wall)  # the row's time is the one printed above
        print_outputs("Sweep summary:", {"table": shown_path(sweep_dir / "summary.md")})


def epochs_done(trainer: Any) -> str:
    """`3 epochs`, or for a resumed or extended run `1 epoch (epoch 3), 4 in all`: the epochs this command trained
    (numbered from 0, as the epoch lines)."""
    from yolo5l.callbacks.epoch_line import EpochLine

    line = next((cb for cb in trainer.callbacks if isinstance(cb, EpochLine)), None)
    if line is None or line.first_epoch is None:
        return f"{trainer.current_epoch} epoch(s)"
    n, first = line.epochs_run, line.first_epoch
    text = f"{n} epoch{'s' if n != 1 else ''}"
    if first > 0:
        which = f"epoch {first}" if n == 1 else f"epochs {first}-{first + n - 1}"
        text += f" ({which}), {first + n} in all" if n else f", {first} in all"
    return text
