"""One summary table per multirun sweep: a row per job, sorted by training throughput, or by fitness in a search.

`python -m yolo5l.train -m data.batch_size=8,16 data.num_workers=0,2` adds a `SweepSummary` to every job; when a
job's fit ends it appends its row to `<sweep dir>/summary.csv` (under a file lock, rewritten atomically, so jobs
finishing together, as with a parallel launcher, never lose rows) and re-renders `<sweep dir>/summary.md`; once the
job has reported, its row's time becomes its `Training done in` figure (`record_training_time`). When the sweep ends,
`SweepEnd` (a Hydra callback, conf/train.yaml) prints the table.
A sweeper that optimises what the jobs return (`hparams_search=evolve`: Optuna) gets the trials ranked by YOLOv5's
fitness, the best first, and each finished trial's row in `<sweep dir>/evolve.csv` (YOLOv5's layout:
`yolo5l.tracking.evolve`).
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from yolo5l.base.files import atomic_write, file_lock
from yolo5l.eval.best_fitness import best_of, run_fitness

COLUMNS = (
    "job", "overrides", "images_per_sec", "data_wait", "map_50", "map", "wall_s", "status", "output_dir", "fitness",
)  # fmt: skip
#: How summary.md orders the jobs: by training throughput (a sweep of settings) or by fitness (a search).
RANKINGS = ("throughput", "fitness")
#: The columns of a sweep's table ranked by throughput; the time is the job's `Training done in` figure.
THROUGHPUT_HEADER = (
    "job", "overrides", "images/s", "data wait", "mAP@0.5", "mAP@0.5:0.95", "training time (s)", "status",
)  # fmt: skip


def sweeper_ranking(hydra_config: Any = None) -> str:
    """`fitness` when this multirun's sweeper optimises the jobs' return value (any but Hydra's basic sweeper),
    else `throughput`. `hydra_config`: the `hydra` node of the sweep's config; None: the running job's."""
    from hydra.core.hydra_config import HydraConfig

    if hydra_config is None and not HydraConfig.initialized():
        return "throughput"
    hc = HydraConfig.get() if hydra_config is None else hydra_config
    target = str(OmegaConf.select(hc, "sweeper._target_", default="") or "")
    return "fitness" if target and not target.endswith(".BasicSweeper") else "throughput"


class SweepSummary(Callback):
    """Append this job's result to the sweep's summary table when fitting ends (rank 0 only).

    Throughput comes from the ThroughputMonitor's `train/images_per_sec` (the whole job's, all ranks) and
    `train/data_wait` (median over the values logged, so the first, slow steps don't dominate), accuracy from the last
    `val/map_50` and `val/map`, fitness from the best validation (`yolo5l.eval.best_fitness.run_fitness`: what the job
    returns to a sweeper). The time (`wall_s`) is the job's training time as its `Training done in` line says it, set
    by `record_training_time` when the job reports; until then, and for a job that failed, the time from the start of
    fit (this callback's `on_fit_start`, after the ranks and the data are set up) to its end or failure.

    Args:
        sweep_dir: The sweep folder (`hydra.sweep.dir`).
        job: The job's number in the sweep.
        overrides: The job's command-line overrides (`hydra.overrides.task`).
        output_dir: The job's own folder.
        rank_by: `throughput` or `fitness` (see `RANKINGS`); None: from the sweeper (`sweeper_ranking`).
    """

    def __init__(
        self,
        sweep_dir: str | os.PathLike,
        job: int,
        overrides: Sequence[str],
        output_dir: str = "",
        rank_by: str | None = None,
    ) -> None:
        super().__init__()
        self.sweep_dir = Path(sweep_dir)
        self.job = job
        self.overrides = list(overrides)
        self.output_dir = output_dir
        self.rank_by = rank_by or sweeper_ranking()
        self._t0: float | None = None

    @classmethod
    def of_this_job(cls) -> list[SweepSummary]:
        """`[SweepSummary(...)]` for the job of a Hydra multirun that runs now, else `[]`."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get() if HydraConfig.initialized() else None
        if hc is None or hc.mode != RunMode.MULTIRUN:
            return []
        return [cls(hc.sweep.dir, int(hc.job.num), list(hc.overrides.task), hc.runtime.output_dir)]

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, status="finished")

    @override
    @rank_zero_only
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.write(trainer, status=f"failed: {type(exception).__name__}")

    def write(self, trainer: pl.Trainer, status: str) -> dict[str, Any]:
        """Collect this job's row from the trainer's logged metrics and append it to the table."""
        wall = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        fitness = run_fitness(trainer)
        history = _metric_history(trainer)
        row = {
            "job": self.job,
            "overrides": " ".join(self.overrides),
            "images_per_sec": _median(history.get("train/images_per_sec")),
            "data_wait": _median(history.get("train/data_wait")),
            "map_50": _last(history.get("val/map_50")),
            "map": _last(history.get("val/map")),
            "wall_s": wall,
            "status": status,
            "output_dir": self.output_dir,
            "fitness": float("nan") if fitness is None else fitness,
        }
        append_row(self.sweep_dir, row, rank_by=self.rank_by)
        if self.rank_by == "fitness" and status == "finished":
            from yolo5l.tracking.evolve import append_generation

            append_generation(self.sweep_dir, best_validation(trainer), self._hyp())
        return row

    def _hyp(self) -> dict[str, Any]:
        # The job's hyp as its run folder records it (what best_hyp.yaml is made from).
        job_config = Path(self.output_dir) / ".hydra" / "config.yaml"
        hyp = OmegaConf.load(job_config).get("hyp") if job_config.is_file() else None
        return OmegaConf.to_container(hyp, resolve=True) if hyp is not None else {}  # type: ignore[return-value]


def best_validation(trainer: pl.Trainer) -> dict[str, float]:
    """The `val/*` values of the run's best validation (the one whose fitness the job returns): the module's record
    with that epoch's validation losses from the per-epoch CSV logger; the latest values when either is missing."""
    from yolo5l.tracking.loggers import EpochCSVLogger

    latest = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and v.numel() == 1}
    record = best_of(trainer.lightning_module)
    if record is None or record.row is None or record.epoch is None:
        return latest
    epoch_row = next((lg.rows.get(record.epoch, {}) for lg in trainer.loggers if isinstance(lg, EpochCSVLogger)), {})
    return latest | {k: float(v) for k, v in epoch_row.items() if k.startswith("val/")} | record.row


def record_training_time(trainer: pl.Trainer, seconds: float) -> None:
    """Make `seconds`, the job's training time as its `Training done in` line says it (from the call of `trainer.fit`
    to its return: with the launch of the ranks and the set-up of the data, which `SweepSummary`'s hooks do not see),
    the time of the job's row in the sweep summary. Called by the process that called `trainer.fit` (under ddp_spawn
    not the one that wrote the row); nothing without a `SweepSummary` or its row."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, SweepSummary):
            update_row(callback.sweep_dir, callback.job, {"wall_s": float(seconds)}, rank_by=callback.rank_by)


def _metric_history(trainer: pl.Trainer) -> dict[str, list[float]]:
    # Prefer the per-epoch CSV logger's full history (it also sees values callbacks log straight to the
    # loggers); fall back to the trainer's latest values.
    from yolo5l.tracking.loggers import EpochCSVLogger

    history: dict[str, list[float]] = {}
    for key, value in trainer.callback_metrics.items():
        history[key] = [float(value)]
    for logger in trainer.loggers:
        if isinstance(logger, EpochCSVLogger):
            history.update({k: list(v) for k, v in logger.history.items()})
    return history


def _median(values: Sequence[float] | None) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _last(values: Sequence[float] | None) -> float:
    return float(values[-1]) if values else float("nan")


def append_row(sweep_dir: str | os.PathLike, row: Mapping[str, Any], rank_by: str = "throughput") -> None:
    """Append `row` to `<sweep_dir>/summary.csv` and re-render `summary.md` (jobs ordered by `rank_by`), holding
    the summary's lock."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    csv_path = sweep_dir / "summary.csv"
    with file_lock(sweep_dir / ".summary.lock", "the sweep summary"):  # removed by its holder: jobs and tables only
        rows = read_summary(csv_path) if csv_path.exists() else []
        rows = [r for r in rows if str(r["job"]) != str(row["job"])]  # a re-run job replaces its row
        rows.append({k: row.get(k, "") for k in COLUMNS})
        _rewrite(sweep_dir, rows, rank_by)


def update_row(
    sweep_dir: str | os.PathLike, job: int | str, values: Mapping[str, Any], rank_by: str = "throughput"
) -> bool:
    """Set `values` in job `job`'s row of `<sweep_dir>/summary.csv` and re-render `summary.md`, holding the summary's
    lock; False (nothing written) when the table has no row for the job."""
    sweep_dir = Path(sweep_dir)
    csv_path = sweep_dir / "summary.csv"
    if not csv_path.is_file():
        return False
    with file_lock(sweep_dir / ".summary.lock", "the sweep summary"):
        rows: list[dict[str, Any]] = list(read_summary(csv_path))
        row = next((r for r in rows if str(r["job"]) == str(job)), None)
        if row is None:
            return False
        row.update({k: v for k, v in values.items() if k in COLUMNS})
        _rewrite(sweep_dir, rows, rank_by)
    return True


def _rewrite(sweep_dir: Path, rows: Sequence[Mapping[str, Any]], rank_by: str) -> None:
    atomic_write(sweep_dir / "summary.csv", _render_csv(rows))
    atomic_write(sweep_dir / "summary.md", render_markdown(rows, rank_by))


def read_summary(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of a sweep's summary.csv."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _render_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, restval="")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _fmt(r.get(k, "")) for k in COLUMNS})
    return buf.getvalue()


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _descending(column: str) -> Any:
    def key(r: Mapping[str, Any]) -> tuple[bool, float]:
        x = _num(r.get(column))
        return (x != x, -x if x == x else 0.0)  # NaN sorts last

    return key


def render_markdown(rows: Sequence[Mapping[str, Any]], rank_by: str = "throughput") -> str:
    """The summary as a Markdown table: fastest job first, or for `rank_by="fitness"` the fittest trial first, with a
    line naming it (jobs without the value last)."""
    if rank_by not in RANKINGS:
        raise ValueError(f"rank_by={rank_by!r} is not one of {RANKINGS}")
    # Show what differs between jobs; the overrides all jobs share go above the table.
    common = _common_overrides(rows)
    lines = [f"Common overrides: `{' '.join(common)}`", ""] if common else []
    if rank_by == "fitness":
        return "\n".join(lines + _fitness_table(rows, common)) + "\n"
    lines += ["| " + " | ".join(THROUGHPUT_HEADER) + " |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for cells in _throughput_cells(rows, common):
        cells[1] = f"`{cells[1]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _common_overrides(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    tokens = [str(r.get("overrides", "")).split() for r in rows]
    return [t for t in tokens[0] if all(t in other for other in tokens[1:])] if len(rows) > 1 else []


def _throughput_cells(rows: Sequence[Mapping[str, Any]], common: Sequence[str]) -> list[list[str]]:
    """A row of `THROUGHPUT_HEADER` cells per job, the fastest first; the overrides less those all jobs share."""
    cells = []
    for r in sorted(rows, key=_descending("images_per_sec")):
        own = " ".join(t for t in str(r.get("overrides", "")).split() if t not in common)
        cells.append([
            str(r.get("job", "")), own or "(defaults)", f"{_num(r.get('images_per_sec')):.1f}",
            f"{_num(r.get('data_wait')):.1%}", f"{_num(r.get('map_50')):.4f}", f"{_num(r.get('map')):.4f}",
            f"{_num(r.get('wall_s')):.1f}", str(r.get("status", "")),
        ])  # fmt: skip
    return cells


def render_console(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The throughput table as aligned plain lines (the fastest job first), the overrides all jobs share above it."""
    common = _common_overrides(rows)
    table = [list(THROUGHPUT_HEADER), *_throughput_cells(rows, common)]
    widths = [max(len(row[i]) for row in table) for i in range(len(THROUGHPUT_HEADER))]
    left = {1, len(THROUGHPUT_HEADER) - 1}  # overrides and status; the numbers align right
    lines = [f"common overrides: {' '.join(common)}"] if common else []
    for row in table:
        cells = (c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        lines.append("  ".join(cells))
    return [line.rstrip() for line in lines]


class SweepEnd(HydraCallback):
    """Hydra callback of the train command (`hydra.callbacks.sweep_summary` in conf/train.yaml): when a multirun of
    Hydra's basic sweeper ends, print where its summary is and its table, the fastest job first (each job printed only
    the path as it finished). A search (`hparams_search`) is reported by its own callback, `yolo5l.search`."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from yolo5l.base.console import print_outputs
        from yolo5l.base.errors import shown_path

        sweep_dir = Path(str(config.hydra.sweep.dir))
        table = sweep_dir / "summary.csv"
        if sweeper_ranking(config.hydra) != "throughput" or not table.is_file():
            return
        rows = read_summary(table)
        finished = sum(r.get("status") == "finished" for r in rows)
        failed = f", {len(rows) - finished} failed" if finished < len(rows) else ""
        print_outputs(
            f"Sweep done: {len(rows)} job{'s' if len(rows) != 1 else ''}{failed}, the fastest first. Outputs:",
            {"table": shown_path(sweep_dir / "summary.md"), "CSV": shown_path(table)},
        )
        print("\n" + "\n".join("  " + line for line in render_console(rows)), flush=True)


def _fitness_table(rows: Sequence[Mapping[str, Any]], common: Sequence[str]) -> list[str]:
    ranked = sorted(rows, key=_descending("fitness"))
    lines = ["Trials ranked by fitness = 0.1 mAP@0.5 + 0.9 mAP@0.5:0.95 at each trial's best validation (what the "
             "sweeper maximises); mAP columns: the last validation.", ""]  # fmt: skip
    best = ranked[0] if ranked and _num(ranked[0].get("fitness")) == _num(ranked[0].get("fitness")) else None
    if best is not None:
        lines += [f"**Best: job {best.get('job', '')}**, fitness {_num(best.get('fitness')):.4f}", ""]
    lines += [
        "| rank | job | overrides | fitness | mAP@0.5 | mAP@0.5:0.95 | images/s | training time (s) | status |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for rank, r in enumerate(ranked, 1):
        own = " ".join(_short(t) for t in str(r.get("overrides", "")).split() if t not in common)
        lines.append(
            f"| {rank} | {r.get('job', '')} | `{own or '(defaults)'}` | {_num(r.get('fitness')):.4f} "
            f"| {_num(r.get('map_50')):.4f} | {_num(r.get('map')):.4f} | {_num(r.get('images_per_sec')):.1f} "
            f"| {_num(r.get('wall_s')):.1f} | {r.get('status', '')} |"
        )
    return lines


def _short(override: str) -> str:
    """`hyp.lr0=0.0123` for `hyp.lr0=0.012345678901`: a sampler's 17 digits make the table unreadable (the job's
    .hydra/overrides.yaml keeps them)."""
    key, sep, value = override.partition("=")
    if not sep or not any(c in value for c in ".eE"):
        return override
    try:
        return f"{key}={float(value):.4g}"
    except ValueError:
        return override
