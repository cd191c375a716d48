"""Compose the training configuration outside the command line (notebooks, tests).

    >>> from yolo5l import compose_config
    >>> cfg = compose_config(["experiment=smoke"], output_dir="runs/notebook")
    >>> dm = hydra.utils.instantiate(cfg.data, hyp=cfg.hyp)

The result is what `python -m yolo5l.train experiment=smoke` would see, with `${hydra:runtime.output_dir}` (and
everything that interpolates it: loggers, checkpoints) pointing at `output_dir`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

CONFIG_MODULE = "yolo5l.conf"


def compose_config(
    overrides: Sequence[str] | None = None,
    config_name: str = "train",
    output_dir: str | os.PathLike | None = None,
) -> DictConfig:
    """Compose `conf/<config_name>.yaml` with command-line style overrides, as the entry points do.

    Hydra's `${hydra:...}` interpolations resolve afterwards because the Hydra part of the config is installed
    as the current `HydraConfig` (a plain `compose` leaves them unresolvable).

    Args:
        overrides: Overrides such as `["model=yolov5n", "trainer.max_epochs=3"]`.
        config_name: `train`, `val` or `predict`.
        output_dir: The run folder (created); default: the entry point's `hydra.run.dir` under the current folder.

    Returns:
        The composed config, without its `hydra` node.
    """
    with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE):
        cfg = compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=True)
    with open_dict(cfg):
        if output_dir is None:
            output_dir = str(cfg.hydra.run.dir)
        out = Path(output_dir).absolute()
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.job.name = config_name
    HydraConfig.instance().set_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def config_choices(group: str) -> list[str]:
    """Options of a config group (`model` -> ['yolov5l', 'yolov5m', ...]), from the shipped `yolo5l.conf`."""
    from importlib.resources import files

    folder = files(CONFIG_MODULE).joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML with interpolations resolved where they can be."""
    return OmegaConf.to_yaml(cfg, resolve=True)
