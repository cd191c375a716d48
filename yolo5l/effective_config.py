"""`EffectiveConfig`: once fitting has set its data up, the run's config, Hydra's `.hydra/config.yaml` and the
start-up block say what the run uses (yolo5l.run_info settles the values and draws the block).

A module of its own because it is a Lightning callback: yolo5l.run_info is imported by val, predict and export
before their config is checked, and stays free of Lightning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from yolo5l.base.errors import shown_path
from yolo5l.base.files import atomic_write
from yolo5l.run_info import print_block, settle_cache, training_rows

__all__ = ["EffectiveConfig"]


class EffectiveConfig(Callback):
    """Once fitting has set its data up, the run's config says what the run uses, and so do Hydra's
    `.hydra/config.yaml` and the start-up block.

    The training images' cache is the last value a run settles (it falls back to none when the images do not fit),
    known only after the data module's `setup`: this callback's `setup` hook runs right after it, records the cache
    (`settle_cache`), writes the config again and prints the start-up block (rank 0), once. The other settled values
    were recorded when the run was built (`settle_build`), and the batch a search found before fitting.

    Args:
        cfg: the run's config (the object `RunConfig` puts in every checkpoint, so that `resume=` reads it too).
        output_dir: the run folder (the block's title names it).
        config_file: Hydra's copy of the config (`<run>/.hydra/config.yaml`), replaced atomically when its folder
            exists; None: none is written.
        overrides: the command line's overrides (the block's sources).
        choices: Hydra's group choices (`experiment: smoke`).
    """

    def __init__(
        self,
        cfg: DictConfig,
        output_dir: str | Path,
        config_file: str | Path | None = None,
        overrides: list[str] | None = None,
        choices: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.config_file = Path(config_file) if config_file is not None else None
        self.overrides = list(overrides or [])
        self.choices = dict(choices or {})
        self._done = False

    @classmethod
    def of_run(cls, cfg: DictConfig) -> EffectiveConfig:
        """The callback of the current Hydra run (`yolo5l.compose_config` installs one too): its folder, its
        `<output_subdir>/config.yaml`, its overrides and group choices; outside one, the current folder only."""
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return cls(cfg, Path.cwd())
        hc = HydraConfig.get()
        out = Path(hc.runtime.output_dir)
        config_file = out / hc.output_subdir / "config.yaml" if hc.output_subdir else None
        return cls(cfg, out, config_file, list(hc.overrides.task), dict(hc.runtime.choices))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a batch size search fits too (Tuner.scale_batch_size adds a BatchSizeFinder): the block waits for its batch
        if stage != "fit" or self._done or any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
            return
        self._done = True
        settle_cache(self.cfg, trainer.datamodule)
        if not trainer.is_global_zero:
            return
        if self.config_file is not None and self.config_file.parent.is_dir():
            atomic_write(self.config_file, OmegaConf.to_yaml(self.cfg))
        rows = training_rows(self.cfg, trainer.datamodule, pl_module, trainer, self.overrides, self.choices)
        print_block(f"Training in {shown_path(self.output_dir)}:", rows)
