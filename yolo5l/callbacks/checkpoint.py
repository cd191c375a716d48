"""`LastCheckpoint` (last.ckpt every N epochs, optional best.ckpt by fitness, the stripped `weights.pt` at the end
of fit), `AtomicCheckpointIO`, and finding the checkpoint a run resumes from (`find_resume_checkpoint`).

Reference: ultralytics/yolov5 v7.0 `train.py` (last.pt / best.pt by fitness) and `utils/general.py::strip_optimizer`
(EMA weights in half precision, no optimizer). Lightning trap: `save_top_k=0, save_last=True` writes last.ckpt only
when training ends (Lightning 2.6, PR #21244), hence `filename="last", save_top_k=1, monitor=None`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from yolo5l.base.errors import UserError, shown_path
from yolo5l.eval.best_fitness import ReadsBestFitness
from yolo5l.models.weights import atomic_save, save_weights
from yolo5l.training.divergence import first_non_finite

__all__ = [
    "CONFIG_KEY", "AtomicCheckpointIO", "CheckpointWriteError", "LastCheckpoint", "RunConfig", "checkpoint_position",
    "stop_on_write_error", "write_error_message",
]  # fmt: skip

CONFIG_KEY = "yolo5l_config"


class CheckpointWriteError(UserError, OSError):
    """A checkpoint or weights file could not be written (full disk, quota, file-size limit, read-only folder).

    The previous file is whole (every write is atomic). A `UserError`, so the entry points print its one line and
    exit with code 2; an `OSError` too, for callers that catch those.
    """


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints to a temporary file in the same folder, fsync, then `os.replace` onto the target.

    An interrupted write (crash, full disk, kill) leaves the previous file intact; `os.replace` is atomic on POSIX
    and Windows within one filesystem. Remote paths (fsspec URLs) fall back to Lightning's plain write. A failed
    write raises `CheckpointWriteError`, whose message names the folder and the space the file needs (inside
    `deferred_errors` it is held back instead: see `stop_on_write_error`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._deferred: list[CheckpointWriteError] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        bad = _non_finite(checkpoint)
        if bad:
            # A diverged run must not replace the last good checkpoint (YOLOv5Module skips non-finite steps, but the
            # raw weights' BatchNorm statistics may already hold NaN from the forward pass that produced them).
            rank_zero_warn(f"not writing {path}: {bad} holds non-finite values; the previous checkpoint is kept")
            return
        if "://" in str(path) and not str(path).startswith("file://"):
            super().save_checkpoint(checkpoint, path)
            return
        self._write(checkpoint, path)

    def _write(self, checkpoint: dict[str, Any], path: Any) -> None:
        try:
            atomic_save(checkpoint, path)
        except CheckpointWriteError:
            raise
        except OSError as e:
            error = CheckpointWriteError(write_error_message(path, e, _nbytes(checkpoint)))
            if self._deferred is None:
                raise error from None
            self._deferred.append(error)

    @contextlib.contextmanager
    def deferred_errors(self) -> Iterator[list[CheckpointWriteError]]:
        """Hold back the write errors of the block in the list it gives, for a caller that must raise them on every
        DDP rank at once (`trainer.save_checkpoint` writes on rank 0 and then waits for all ranks in a barrier)."""
        outer, self._deferred = self._deferred, []
        try:
            yield self._deferred
        finally:
            self._deferred = outer

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Checkpoints travel between people and clusters: never run pickled code, whatever the caller asked for.
        return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=True)


class LastCheckpoint(ReadsBestFitness, ModelCheckpoint):
    """`last.ckpt` every `every_n_epochs` epochs (and at the end), `best.pt` (the stripped weights of the best
    validation by `val/fitness`, as YOLOv5 keeps best.pt: the module's record `YOLOv5Module.best` says which one;
    a module without one gets no best.pt), `best.ckpt` too if asked, and the stripped `weights.pt` at
    the end of fit, all in `dirpath` (default: the logger's `checkpoints/` folder).

    Resume with `trainer.fit(module, datamodule, ckpt_path=".../last.ckpt")`.

    Args:
        every_n_epochs: epochs between writes of last.ckpt.
        save_best: also keep `best.ckpt`, the full training checkpoint with the highest `val/fitness` so far
            (best.pt, its weights, is always kept).
        dirpath: output folder.
        weights_name: file name of the stripped weights written at the end of fit (None: do not write).
        save_period: also keep `epoch<N>.ckpt`, the training checkpoint at the end of epoch N (0-based), for every
            N divisible by it (YOLOv5's `--save-period`; < 1: none). Each resumes (`resume=`) and loads (`weights=`)
            as last.ckpt does.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        save_best: bool = False,
        dirpath: str | os.PathLike | None = None,
        weights_name: str | None = "weights.pt",
        save_period: int = -1,
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
        self.weights_name = weights_name
        self.save_period = int(save_period)

    #: Set by the command that resumes the run (`yolo5l.train`): the folder holds this run's own checkpoints, so
    #: Lightning's warning that it is not empty is left out.
    resuming: bool = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            if self.resuming:
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    @property
    def best_fitness(self) -> float | None:
        """The fitness of best.pt (the module's record, `YOLOv5Module.best`)."""
        return self._record.fitness if self._record is not None else None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or trainer.state.fn != "fit" or self._record is None:
            return
        if self._record.latest_is_best:  # the module recorded this validation (identical on all ranks)
            with stop_on_write_error(trainer, os.path.join(self.dirpath, "best.pt"), _weights_nbytes(pl_module)):
                self._write_best_weights(trainer, pl_module)
            if self.save_best:
                with stop_on_write_error(trainer):
                    trainer.save_checkpoint(os.path.join(self.dirpath, "best.ckpt"))  # on every rank: a collective

    @rank_zero_only
    def _write_best_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The weights as trainer.save_checkpoint would write them (callbacks' on_save_checkpoint applied: the EMA
        # weights with EMACallback), dumped in memory.
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=True)["state_dict"]
        weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        path = os.path.join(self.dirpath, "best.pt")
        try:
            save_weights(
                pl_module.model,
                path,
                pl_module.names,
                imgsz=_imgsz(trainer),
                data=_data_file(trainer),
                state_dict=weights,
            )
        except ValueError as e:  # non-finite weights: the previous best.pt stays
            rank_zero_warn(str(e))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # last.ckpt, every `every_n_epochs`
        epoch = trainer.current_epoch
        final = epoch + 1 >= (trainer.max_epochs or 0) > 0 or trainer.should_stop
        if final and not self._should_skip_saving_checkpoint(trainer) and not self.saved_at_step(trainer.global_step):
            # the run's end is a resume point too (extend it with trainer.max_epochs), whatever every_n_epochs is
            self._save_none_monitor_checkpoint(trainer, self._monitor_candidates(trainer))
        periodic = self.save_period > 0 and epoch % self.save_period == 0
        if periodic and trainer.state.fn == "fit" and not (trainer.fast_dev_run or trainer.sanity_checking):
            # v7.0 train.py: `if opt.save_period > 0 and epoch % opt.save_period == 0: torch.save(ckpt, w /
            # f'epoch{epoch}.pt')`. A checkpoint of its own (on every rank: a collective), written atomically.
            with stop_on_write_error(trainer):
                path = os.path.join(self.dirpath, f"epoch{epoch}{self.FILE_EXTENSION}")
                trainer.save_checkpoint(path, weights_only=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.weights_name:
            path = os.path.join(self.dirpath, self.weights_name)
            with stop_on_write_error(trainer, path, _weights_nbytes(pl_module)):
                self._write_weights(trainer, pl_module)

    @rank_zero_only
    def _write_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fs = get_filesystem(self.dirpath)
        fs.makedirs(self.dirpath, exist_ok=True)
        path = os.path.join(self.dirpath, self.weights_name)
        try:
            save_weights(pl_module.model, path, pl_module.names, imgsz=_imgsz(trainer), data=_data_file(trainer))
        except ValueError as e:  # non-finite weights: nothing is written rather than a broken file
            rank_zero_warn(str(e))

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        with stop_on_write_error(trainer):  # last.ckpt: a failed write stops the run (see stop_on_write_error)
            super()._save_checkpoint(trainer, filepath)

    @property
    def last_path(self) -> str:
        """The `last.ckpt` this callback writes."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def saved_at_step(self, global_step: int) -> bool:
        """Whether this callback's last write was at `global_step` (PreemptionCheckpoint asks at an epoch end)."""
        return self._last_global_step_saved == global_step


def _non_finite(checkpoint: dict[str, Any]) -> str | None:
    """The name of the first tensor of a checkpoint's weights (EMA and raw) or optimizer state with a NaN or inf,
    else None (one host sync per device: at save time only)."""
    named = [
        (f"{part}[{name!r}]", t)
        for part in ("state_dict", "current_model_state")
        for name, t in (checkpoint.get(part) or {}).items()
        if isinstance(t, torch.Tensor)
    ]
    for i, opt in enumerate(checkpoint.get("optimizer_states") or []):
        for index, state in (opt.get("state") or {}).items():
            named += [
                (f"optimizer_states[{i}][{index}][{k!r}]", t) for k, t in state.items() if isinstance(t, torch.Tensor)
            ]
    return first_non_finite(named)


# ---- failed writes ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def stop_on_write_error(trainer: pl.Trainer, path: Any = None, nbytes: int | None = None) -> Iterator[None]:
    """Run one checkpoint write (a `trainer.save_checkpoint`, or a weights file that rank 0 writes to `path`) so
    that if it fails, every rank raises the same `CheckpointWriteError` after it: raised on rank 0 alone, the error
    would leave the other ranks waiting in the barrier that ends `trainer.save_checkpoint`, or in the next step's
    collectives. One broadcast per block under DDP, none on one process; a block holds one collective at most.

    A failed write stops the run rather than letting it go on with a warning. The previous file is whole and a
    resume continues exactly, so stopping loses at most the steps since that file was written; a run that went on
    would train for hours or days on weights that exist only in memory (a crash, a preemption, or the same full
    disk at the end, when weights.pt cannot be written either, loses all of it), and a warning in the log of a
    multi-day run is easily missed, whereas a stopped job is seen.

    Args:
        trainer: the Trainer (its strategy writes and broadcasts).
        path: the file a weights write in the block goes to, for the message (checkpoint writes name theirs).
        nbytes: about how many bytes that file needs.
    """
    io = getattr(trainer.strategy, "checkpoint_io", None)
    held = io.deferred_errors() if isinstance(io, AtomicCheckpointIO) else contextlib.nullcontext([])
    message = ""
    with held as errors:
        try:
            yield
        except CheckpointWriteError as e:
            message = str(e)
        except OSError as e:
            if path is None:
                raise
            message = write_error_message(path, e, nbytes)
    message = message or (str(errors[0]) if errors else "")
    if getattr(trainer, "world_size", 1) > 1:
        message = trainer.strategy.broadcast(message, src=0)  # rank 0 wrote: its outcome is everyone's
    if message:
        raise CheckpointWriteError(message)


# errno -> (why, what to do before resuming)
_WHY = {
    errno.ENOSPC: ("the disk is full", "make room"),
    errno.EDQUOT: ("the disk quota is used up", "make room"),
    errno.EFBIG: ("the file is larger than the filesystem or this process's file-size limit (ulimit -f) allows",
                  "lift the limit"),
    errno.EROFS: ("the folder is on a read-only filesystem", "make it writable"),
    errno.EACCES: ("no permission to write there", "make it writable"),
    errno.EPERM: ("no permission to write there", "make it writable"),
}  # fmt: skip


def write_error_message(path: Any, error: OSError, nbytes: int | None) -> str:
    """One line for a failed write of `path`: the folder, why, the space the file needs and what is free there,
    whether the previous file is still there (whole: writes are atomic), and for a training checkpoint how to
    resume from it."""
    path = Path(path)
    folder = path.parent
    why, fix = _WHY.get(error.errno or 0, (error.strerror or str(error), "fix that"))
    try:
        free = f"{_size(shutil.disk_usage(folder).free)} free there"
    except OSError:
        free = "free space unknown"
    need = f"it needs about {_size(nbytes)}, " if nbytes else ""
    line = f"could not write {path.name} in {shown_path(folder)} ({why}: {need}{free}); "
    if not path.is_file():
        return line + f"no earlier {path.name} was written there"
    line += f"the previous {path.name} there is whole"
    if path.suffix == ".ckpt":
        line += f": {fix}, then resume with python -m yolo5l.train resume={shown_path(path)}"
    return line


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a checkpoint (nested dicts, lists, tuples): about its size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _weights_nbytes(pl_module: pl.LightningModule) -> int:
    """About the size of a weights file of `pl_module.model` (floating tensors stored in half precision)."""
    model = getattr(pl_module, "model", pl_module)
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in model.state_dict().values())


def _imgsz(trainer: pl.Trainer) -> int | None:
    imgsz = getattr(getattr(trainer, "datamodule", None), "imgsz", None)
    return imgsz if isinstance(imgsz, int) else None


def _data_file(trainer: pl.Trainer) -> str | None:
    """The dataset yaml the run trains on (recorded in its weights.pt: val defaults to it)."""
    spec = getattr(getattr(trainer, "datamodule", None), "spec", None)
    file = getattr(spec, "file", None)
    return str(file) if file is not None else None


class RunConfig(Callback):
    """Keep the run's composed config in every checkpoint (`checkpoint["yolo5l_config"]`), so that `resume=`
    rebuilds the same run without the original command line.

    Args:
        config: the run's config itself, read at each save (what the run settled after it was built is in it:
            `yolo5l.run_info.settle`), or plain containers; interpolations are kept.
    """

    def __init__(self, config: DictConfig | dict[str, Any]) -> None:
        self.config = config

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        config = self.config
        checkpoint[CONFIG_KEY] = OmegaConf.to_container(config) if isinstance(config, DictConfig) else config


def checkpoint_position(ckpt: dict[str, Any]) -> tuple[int, int]:
    """Where a training checkpoint stands: (epochs completed, batches of the next epoch already trained).

    Lightning counts an epoch as processed just before its `on_train_epoch_end`, where `LastCheckpoint` saves, so the
    fit loop's `epoch_progress.current.processed` is the number of completed epochs for an epoch-end checkpoint and
    for a mid-epoch one alike (`PreemptionCheckpoint`'s, whose "epoch" is the epoch still running). A checkpoint
    without loop state was written at an epoch end: "epoch" is the epoch just completed (0-based).
    """
    loop = (ckpt.get("loops") or {}).get("fit_loop") or {}
    try:
        epochs = int(loop["epoch_progress"]["current"]["processed"])
        batches = int(loop["epoch_loop.batch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return int(ckpt["epoch"]) + 1, 0
    return epochs, batches if epochs == int(ckpt["epoch"]) else 0
