"""`LastCheckpoint` (last.ckpt every N epochs, optional best.ckpt by fitness), `AtomicCheckpointIO`, and the
stripped `weights.pt` written at the end of fit.

Reference: ultralytics/yolov5 v7.0 `train.py` (last.pt / best.pt by fitness) and `utils/general.py::strip_optimizer`
(EMA weights in half precision, no optimizer). Lightning trap: `save_top_k=0, save_last=True` writes last.ckpt only
when training ends (Lightning 2.6, PR #21244), hence `filename="last", save_top_k=1, monitor=None`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "LastCheckpoint", "strip_weights"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints to a temporary file in the same folder, fsync, then `os.replace` onto the target.

    An interrupted write (crash, full disk, kill) leaves the previous file intact; `os.replace` is atomic on POSIX
    and Windows within one filesystem. Remote paths (fsspec URLs) fall back to Lightning's plain write.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        if "://" in str(path) and not str(path).startswith("file://"):
            super().save_checkpoint(checkpoint, path)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def strip_weights(pl_module: pl.LightningModule, path: str | os.PathLike) -> Path:
    """Write the deployable weights file: {"model_config", "state_dict" (half), "names"}, loadable weights_only.

    The module's current weights are used; with `EMACallback` they are the EMA weights at the end of fit.
    `model_config` holds the `YOLOv5` constructor arguments (depth, width, num_classes, anchors in pixels).
    """
    model = pl_module.model
    anchors = model.anchor_pixels().detach().cpu().float()  # (3, na, 2) pixels, as yolo5l.weights writes them
    config = {
        "depth": float(model.depth),
        "width": float(model.width),
        "num_classes": int(model.num_classes),
        "anchors": anchors.reshape(len(anchors), -1).tolist(),
    }
    state = {
        k: (v.detach().half() if v.is_floating_point() else v.detach()).cpu().clone()
        for k, v in model.state_dict().items()
    }
    path = Path(path)
    ckpt = {"model_config": config, "state_dict": state, "names": [str(n) for n in pl_module.names]}
    AtomicCheckpointIO().save_checkpoint(ckpt, path)
    return path


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` every `every_n_epochs` epochs (and at the end), `best.ckpt` by `val/fitness` if asked, and the
    stripped `weights.pt` at the end of fit, all in `dirpath` (default: the logger's `checkpoints/` folder).

    Resume with `trainer.fit(module, datamodule, ckpt_path=".../last.ckpt")`.

    Args:
        every_n_epochs: epochs between writes of last.ckpt.
        save_best: also keep `best.ckpt`, the checkpoint with the highest `val/fitness` so far.
        dirpath: output folder.
        weights_name: file name of the stripped weights written at the end of fit (None: do not write).
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        save_best: bool = False,
        dirpath: str | os.PathLike | None = None,
        weights_name: str | None = "weights.pt",
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            every_n_epochs=every_n_epochs,
            enable_version_counter=False,
            save_on_train_epoch_end=True,  # after validation (it runs inside the epoch), also on epochs without it
        )
        self.save_best = save_best
        self.best_fitness: float | None = None
        self.weights_name = weights_name

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.save_best or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        fit = trainer.callback_metrics.get("val/fitness")
        if fit is None:
            return
        fit = float(fit)  # once per validation; identical on all ranks (the metric is computed after a gather)
        if self.best_fitness is None or fit >= self.best_fitness:
            self.best_fitness = fit
            trainer.save_checkpoint(os.path.join(self.dirpath, "best.ckpt"))  # on every rank: it is a collective

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.weights_name:
            self._write_weights(trainer, pl_module)

    @rank_zero_only
    def _write_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fs = get_filesystem(self.dirpath)
        fs.makedirs(self.dirpath, exist_ok=True)
        strip_weights(pl_module, os.path.join(self.dirpath, self.weights_name))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_fitness": self.best_fitness}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_fitness = state_dict.get("best_fitness")
        super().load_state_dict(state_dict)
