"""`BestFitness`: the run's best validation by YOLOv5's fitness (0.1 mAP@0.5 + 0.9 mAP@0.5:0.95), kept in one place.

`YOLOv5Module.best` is the one record of a run: the module updates it after each validation of `fit` and saves it in
its checkpoints (a resumed run goes on from it). The rest read it: `LastCheckpoint` writes best.pt (and best.ckpt)
when the latest validation is the best, `FitnessEarlyStopping` names the best epoch when it stops, `ValidationSummary`
prints the best row at the end, `run_fitness` returns its fitness to a sweeper, and the closing validation of best.pt
knows its epoch.

A fitness equal to the best counts as the best, as v7.0's train.py keeps best.pt (`if best_fitness == fi`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BestFitness", "ReadsBestFitness", "best_of", "checkpoint_best", "run_fitness"]


class BestFitness:
    """The best validation so far: its fitness, its epoch and its `val/*` values (None before the first)."""

    def __init__(self) -> None:
        self.fitness: float | None = None
        self.epoch: int | None = None
        self.row: dict[str, float] | None = None
        #: Whether the latest validation recorded is the best (best.pt is written after it).
        self.latest_is_best = False

    def update(self, row: dict[str, float], epoch: int) -> bool:
        """Record a validation's `val/*` values (with `val/fitness`) at `epoch`; returns whether it is the best."""
        fitness = float(row["val/fitness"])
        self.latest_is_best = self.fitness is None or fitness >= self.fitness
        if self.latest_is_best:
            self.fitness, self.epoch, self.row = fitness, int(epoch), dict(row)
        return self.latest_is_best

    def state_dict(self) -> dict[str, Any]:
        return {"fitness": self.fitness, "epoch": self.epoch, "row": self.row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fitness, self.epoch, self.row = state.get("fitness"), state.get("epoch"), state.get("row")
        self.latest_is_best = False


def best_of(pl_module: Any) -> BestFitness | None:
    """The record of a LightningModule that keeps one (`YOLOv5Module.best`), else None."""
    best = getattr(pl_module, "best", None)
    return best if isinstance(best, BestFitness) else None


def checkpoint_best(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The `BestFitness` state a training checkpoint holds: `yolo5l_best`, or for a checkpoint written before the
    module kept the record, `LastCheckpoint`'s best fitness and epoch ({} when neither is there)."""
    if checkpoint.get("yolo5l_best"):
        return checkpoint["yolo5l_best"]
    for key, state in checkpoint.get("callbacks", {}).items():
        if key.startswith("LastCheckpoint") and state.get("best_fitness") is not None:
            return {"fitness": state["best_fitness"], "epoch": state.get("best_epoch")}
    return {}


class ReadsBestFitness:
    """For a Lightning callback that reads the run's record (put it before the callback's Lightning base class):
    `setup` finds the record on the module (`best_of`), `best_epoch` is its epoch (None before the first validation,
    or when the module keeps no record)."""

    _record: BestFitness | None = None

    @property
    def best_epoch(self) -> int | None:
        """The epoch of the best validation (best.pt's)."""
        return self._record.epoch if self._record is not None else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        self.read_record(pl_module)

    def read_record(self, pl_module: Any) -> None:
        """Read the run's record from `pl_module` from now on."""
        self._record = best_of(pl_module)


def run_fitness(trainer: Any) -> float | None:
    """YOLOv5's fitness of the run, what a sweeper maximises: its best validation (the module's record) if it keeps
    one, else the last `val/fitness` logged; None without a validation."""
    record = best_of(trainer.lightning_module)
    if record is not None and record.fitness is not None:
        return record.fitness
    value = trainer.callback_metrics.get("val/fitness")
    return float(value) if value is not None else None
