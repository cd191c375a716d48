"""What a run uses, shown before it starts: one block of model, image size, batch, cache, workers, precision,
devices and data, each value with where it came from when that is not the shipped default.

    Run: runs/train/2026-01-05_10-00-00
      model:      yolov5n: 1.77 M parameters, 0.2 GFLOPs at 128 px   [experiment=smoke]
      image size: 128                                                 [experiment=smoke]
      batch:      8 in all, 8 per device                              [command line]
      workers:    0 per device                                        [auto: the CPU's cores go to compute]
      ...

The sources are: `command line`, the config option that set it (`experiment=smoke`, `data=coco128`,
`trainer=cpu`), `auto: <why>` for a value yolo5l resolved (yolo5l/base/hardware.py), `the weights` for what val,
predict and export take from a weights file, `the checkpoint` for a resumed run's own settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from importlib.resources import files
from typing import Any

__all__ = [
    "cpu_oversubscription", "data_from_weights", "model_gflops", "print_block", "source_of", "training_rows",
]  # fmt: skip

_GLOBAL_GROUPS = ("debug", "experiment", "hparams_search")  # `# @package _global_` options: keys from the root


@cache
def _option_keys(group: str, option: str) -> frozenset[str]:
    """Every dotted key a `conf/<group>/<option>.yaml` sets (relative to its package), `defaults` left out."""
    import yaml

    path = files("yolo5l.conf").joinpath(group, f"{option}.yaml")
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
    return frozenset(keys)


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".")


def source_of(
    key: str, overrides: Sequence[str] = (), choices: Mapping[str, Any] | None = None, resumed: bool = False
) -> str | None:
    """Where the value of `key` (`data.imgsz`) came from: `command line`, the option that set it
    (`experiment=smoke`, `data=coco128`), `the checkpoint` (resumed run), or None for the shipped default."""
    for override in reversed(list(overrides)):
        k = _override_key(override)
        if k == key or key.startswith(f"{k}.") or k.startswith(f"{key}."):  # the key, a node above or below it
            return "command line"
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


def training_rows(cfg: Any, datamodule: Any, module: Any, trainer: Any, hydra_cfg: Any = None) -> dict[str, str]:
    """The start-up block of a training run: label -> `value   [source]`."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from omegaconf import OmegaConf

    from yolo5l.base.errors import shown_path
    from yolo5l.base.hardware import loader_workers, precision_reason

    overrides = list(hydra_cfg.overrides.task) if hydra_cfg is not None else []
    choices = dict(hydra_cfg.runtime.choices) if hydra_cfg is not None else {}
    resumed = bool(cfg.get("resume"))

    def auto(
        value: Any,
    ) -> bool:  # `auto`, or a conf default that yolo5l.base.resolvers resolves (`${auto_precision:...}`)
        return str(value) == "auto" or str(value).startswith("${auto_")

    raw_trainer = OmegaConf.to_container(cfg.trainer, resolve=False) if OmegaConf.is_config(cfg.trainer) else {}

    def row(value: str, *keys: str, why: str | None = None) -> str:
        source = why or next((s for s in (source_of(k, overrides, choices, resumed) for k in keys) if s), None)
        return f"{value}   [{source}]" if source else value

    model = module.model
    imgsz = int(cfg.data.imgsz)
    params = sum(p.numel() for p in model.parameters())
    gflops = model_gflops(model, imgsz)
    flops = f", {gflops:.{1 if gflops >= 1 else 2}f} GFLOPs at {imgsz} px" if gflops is not None else ""
    model_name = choices.get("model") or type(model).__name__
    on_cpu = isinstance(trainer.accelerator, CPUAccelerator)
    devices = int(trainer.num_devices) * int(trainer.num_nodes)
    batch = int(cfg.data.batch_size)
    workers = loader_workers(datamodule.num_workers, not on_cpu, int(trainer.num_devices))
    auto_workers = "auto: the CPU's cores go to compute" if on_cpu else "auto: its CPU cores less one"
    pipeline, cache, pipeline_why = datamodule.resolve_input(trainer.strategy.root_device)
    cache_why = "data.cache=device needs data.pipeline=device" if cache != str(cfg.data.cache) else None
    if pipeline == "device":
        where = f"on {trainer.strategy.root_device}"
    else:
        where = f"by {workers} worker{'s' * (workers != 1)}" if workers else "in the training process"
    pipeline_text = f"{pipeline}: images decoded and augmented {where}"
    spec = datamodule.spec
    data = shown_path(spec.file) if spec.file is not None else "(a mapping)"
    precision = str(trainer.precision)
    kind = "cpu" if on_cpu else type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    auto_precision = f"auto: {precision_reason(str(cfg.trainer.accelerator))}"
    per_device = f"{batch} in all, {batch // max(1, devices)} per device" if batch > 0 else "the largest that fits"
    nodes = f" ({trainer.num_nodes} nodes)" if trainer.num_nodes > 1 else ""
    rows = {
        "model": row(f"{model_name}: {_count(params)} parameters{flops}", "model"),
        "data": row(f"{data}, {len(spec.names)} classes", "data.file", "data.synthetic", "data"),
        "image size": row(str(imgsz), "data.imgsz", "data"),
        "batch": row(per_device, "data.batch_size", "data"),
        "cache": row(cache, "data.cache", "data", why=cache_why),
        "pipeline": row(pipeline_text, "data.pipeline", why=pipeline_why or None),
        "workers": row(
            f"{workers} per device", "data.num_workers", why=auto_workers if auto(datamodule.num_workers) else None
        ),
        "precision": row(
            precision, "trainer.precision", why=auto_precision if auto(raw_trainer.get("precision")) else None
        ),
        "devices": row(f"{devices} {kind}{nodes}", "trainer.devices", "trainer.accelerator", "trainer"),
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


def data_from_weights(cfg: Any, recorded: str | None, overrides: Sequence[str] | None = None) -> str | None:
    """`python -m yolo5l.val` without `data=` / `data.file=`: validate on the dataset yaml the weights record
    (`yolo5l.io.weights.save_weights(data=...)`), and say so in one line. Returns the yaml taken, or None when the
    command line chose the data, the weights record none, or the recorded file is not here (a warning line then).

    Args:
        cfg: the val config (`data.file` is set in place).
        recorded: the weights' dataset yaml (`LoadInfo.data`).
        overrides: the command line's overrides (default: the current Hydra run's).
    """
    from omegaconf import open_dict

    from yolo5l.base.console import info
    from yolo5l.base.errors import shown_path

    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    chosen = any(_override_key(o) in _DATA_CHOICES or _override_key(o).startswith("data.synthetic.") for o in overrides)
    if chosen or not recorded:
        return None
    if not os.path.isfile(recorded):
        info(f"warning: the weights were trained on {recorded}, which is not here: pass data= or data.file=")
        return None
    with open_dict(cfg):
        cfg.data.file = recorded
    info(f"data.file: {shown_path(recorded)} (the dataset the weights were trained on)")
    return recorded
