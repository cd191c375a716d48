"""The hyperparameter search of `hparams_search=...` (Hydra's Optuna sweeper): `SearchCallback`, a Hydra callback
(`hydra.callbacks` of conf/hparams_search/*.yaml), refuses a search key that is not a hyperparameter before any trial
runs, and when the sweep ends writes the best trial's full hyp as `<sweep dir>/best_hyp.yaml` (`write_best_hyp`) and
YOLOv5's `evolve.png` (fitness against each searched hyperparameter: `yolo5l.tracking.evolve.plot_evolve`).

Each trial's rows come from `yolo5l.callbacks.sweep.SweepSummary` (the sweep's summary.csv and evolve.csv).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from yolo5l.base.console import fail, print_outputs
from yolo5l.base.errors import UserError, shown_path
from yolo5l.base.files import atomic_write
from yolo5l.callbacks.sweep import read_summary
from yolo5l.tracking.evolve import plot_evolve

__all__ = ["SearchCallback", "write_best_hyp"]


def _finite(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def write_best_hyp(sweep_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """Write the best trial's full hyp (from its job's `.hydra/config.yaml`) as `<sweep_dir>/best_hyp.yaml`.

    The best trial is the summary.csv row with the highest fitness (what each trial returned to the sweeper).

    Returns:
        (the file, the summary row of the best trial), or None when no trial finished with a fitness.
    """
    sweep_dir = Path(sweep_dir)
    table = sweep_dir / "summary.csv"
    rows = [r for r in read_summary(table) if _finite(r.get("fitness")) is not None] if table.is_file() else []
    if not rows:
        return None
    best = max(rows, key=lambda r: _finite(r["fitness"]))  # type: ignore[arg-type,return-value]
    job_config = Path(best["output_dir"]) / ".hydra" / "config.yaml"
    hyp = OmegaConf.load(job_config).hyp
    header = (
        f"# The best trial of the search in {sweep_dir}: job {best['job']}, val/fitness {float(best['fitness']):.6g}\n"
        f"# (its best validation). Train with it: python -m yolo5l.train hyp={sweep_dir / 'best_hyp.yaml'}\n"
    )
    path = atomic_write(sweep_dir / "best_hyp.yaml", header + OmegaConf.to_yaml(hyp, resolve=True))
    return path, best


class SearchCallback(Callback):
    """Hydra callback of the `hparams_search` configs (`hydra.callbacks`): before the sweep, a search key that is not a
    hyperparameter is one line and exit code 2 (each trial would fail on it); after it, `best_hyp.yaml` and
    `evolve.png`.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from yolo5l.config import check_search_space

        # Optuna imports alembic, which logs each of its plugins at INFO: seven lines before every search.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        try:
            check_search_space(config)
        except UserError as e:
            fail(str(e))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        written = write_best_hyp(sweep_dir)
        if written is None:
            return
        path, best = written
        with open(sweep_dir / "summary.md", "a") as f:
            f.write(f"\nThe best trial's hyperparameters (job {best['job']}): `{path.name}`, a conf/hyp file.\n")
        evolve_csv = sweep_dir / "evolve.csv"
        searched = [str(k).removeprefix("hyp.") for k in OmegaConf.select(config, "hydra.sweeper.params") or {}]
        plotted = plot_evolve(evolve_csv, searched) if evolve_csv.is_file() else None
        print_outputs(
            f"Search done: best job {best['job']}, val/fitness {float(best['fitness']):.4f}. Outputs:",
            {
                "table": shown_path(sweep_dir / "summary.md"),
                "best hyp": shown_path(path),
                "evolve.csv": shown_path(evolve_csv) if evolve_csv.is_file() else None,
                "evolve.png": shown_path(plotted[0]) if plotted else None,
            },
        )
