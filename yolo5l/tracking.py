"""Experiment tracking and hyperparameter search, on Lightning's own loggers and Hydra's Optuna sweeper.

- `instantiate_entries` builds `train.build`'s callbacks and loggers (`logger=mlflow`, `logger=[tensorboard,wandb]`).
  A tracker whose optional extra is not installed is a one-line `UserError` naming the extra; one whose server cannot
  be reached is one warning line naming it, and training goes on with the other loggers and the run folder. Every
  logger gets the composed config as flattened parameters (`model.width`).
- `log_image` sends BatchPlotter's drawn batches to MLflow and W&B (TensorBoard gets them from the plotter itself).
- `finish_run`, at the end of `train`: the run's best `val/fitness` (what a sweeper maximises) and, on rank 0,
  weights.pt, metrics.csv and per_class.csv as artifacts of the MLflow and W&B runs.
- `SearchCallback`, a Hydra callback of `hparams_search=...`: refuses a search key that is not a hyperparameter before
  any trial runs, and writes the best trial's full hyp as `<sweep dir>/best_hyp.yaml` when the sweep ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from yolo5l.errors import UserError

__all__ = [
    "EXTRAS",
    "SearchCallback",
    "finish_run",
    "flat_config",
    "instantiate_entries",
    "log_image",
    "run_fitness",
    "write_best_hyp",
]

#: Logger class -> (module it needs, the yolo5l extra that installs it).
EXTRAS = {"MLFlowLogger": ("mlflow", "mlflow"), "WandbLogger": ("wandb", "wandb")}
#: Seconds a remote MLflow server gets to answer the start-up probe (MLflow's own retries take minutes).
PROBE_TIMEOUT_S = 10.0
#: Tables of the run folder that go to the trackers at the end when they exist, besides weights.pt and metrics.csv.
RUN_TABLES = ("per_class.csv",)


def _warn(message: str) -> None:
    from yolo5l._cli import info

    info(f"warning: {message}")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- building the loggers -------------------------------------------------------------------------------------------
def instantiate_entries(node: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group keyed by name (`callbacks`, `logger`).

    Trackers (MLflow, W&B) are checked first: a missing extra raises, an unreachable server drops the tracker with a
    warning (on rank 0, the only rank that talks to it). When the group holds loggers, each gets the root config's
    flattened values as hyperparameters.

    Raises:
        UserError: A tracker's extra is not installed.
    """
    from lightning.pytorch.loggers import Logger

    from yolo5l._cli import is_rank_zero

    built: list[Any] = []
    for name, entry in (node or {}).items():
        if not (OmegaConf.is_dict(entry) and "_target_" in entry):
            continue
        kind = str(entry._target_).rsplit(".", 1)[-1]
        if kind in EXTRAS and not _installed(EXTRAS[kind][0]):
            extra = EXTRAS[kind][1]
            raise UserError(f'logger={name} needs the {extra} extra: pip install -e ".[{extra}]"')
        if kind == "MLFlowLogger" and is_rank_zero():
            uri = _mlflow_uri(entry)
            problem = _probe_mlflow(uri)
            if problem is not None:
                _warn(f"logger={name}: MLflow tracking URI {uri} cannot be reached ({problem}); going on without it")
                continue
        extra = _mlflow_artifacts(entry, node) if kind == "MLFlowLogger" else {}
        obj = instantiate(entry, _convert_="all", **extra)
        if kind == "WandbLogger" and is_rank_zero():
            problem = _start_wandb(obj)
            if problem is not None:
                host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
                _warn(f"logger={name}: the W&B run at {host} cannot start ({problem}); going on without it")
                continue
        built.append(obj)
    loggers = [obj for obj in built if isinstance(obj, Logger)]
    if loggers and node is not None:
        params = flat_config(node._get_root())  # the whole run's config, not just the `logger` node
        for lg in loggers:
            lg.log_hyperparams(params)
    return built


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as one level of dotted keys (`{"model.width": 0.25, ...}`), interpolations resolved where they can
    be; lists stay values."""
    try:
        tree = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an interpolation that only resolves inside a Hydra run: keep it as written
        tree = OmegaConf.to_container(cfg, resolve=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            flat[prefix] = value

    walk("", tree)
    return flat


#: MLflow stores in a database: their runs' artifacts go to ./mlruns of the current folder unless told otherwise.
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _mlflow_artifacts(entry: DictConfig, node: DictConfig | None) -> dict[str, str]:
    """`artifact_location` for a new experiment in a database store when the config leaves it null: the runs
    folder's `mlruns/` (`<paths.runs_dir>/mlruns`), not MLflow's `./mlruns` in whatever folder the command ran in.
    A server (http:, databricks) and a file store keep their own places."""
    if entry.get("artifact_location") is not None:
        return {}
    scheme = _mlflow_uri(entry).split(":", 1)[0].split("+", 1)[0].lower()
    runs_dir = OmegaConf.select(node._get_root(), "paths.runs_dir", default=None) if node is not None else None
    if scheme not in _DATABASE_SCHEMES or runs_dir is None:
        return {}
    return {"artifact_location": (Path(str(runs_dir)).absolute() / "mlruns").as_uri()}


def _mlflow_uri(entry: DictConfig) -> str:
    # MLFlowLogger's own fallbacks, in its order: the argument, MLFLOW_TRACKING_URI, file:<save_dir>.
    uri = entry.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    return str(uri) if uri else f"file:{entry.get('save_dir', './mlruns')}"


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _probe_mlflow(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the tracking store at `uri` answers a one-experiment search, else why not (one line).

    A local store (file:, sqlite:, a path) answers or fails at once, though a new SQLite store takes seconds to set
    up. A server gets `timeout` seconds and no retries: MLflow's default retries take minutes to give up.
    """
    from mlflow.tracking import MlflowClient

    if uri.split(":", 1)[0].lower() in ("file", "sqlite", "") or ":" not in uri:
        try:
            MlflowClient(uri).search_experiments(max_results=1)
        except Exception as e:
            return _first_line(e)
        return None
    result: list[str | None] = []

    def probe() -> None:
        try:
            MlflowClient(uri).search_experiments(max_results=1)
            result.append(None)
        except Exception as e:
            result.append(_first_line(e))

    with _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout)))):
        thread = threading.Thread(target=probe, name="mlflow-probe", daemon=True)
        thread.start()
        thread.join(timeout + 1)
    return result[0] if result else f"no answer in {timeout:.0f} s"


def _start_wandb(logger: Any) -> str | None:
    """Start the W&B run now (None), or say why it cannot start (one line).

    Lightning's WandbLogger adopts a run left open in the process; in a sweep that is the previous trial's (one that
    failed before `finish_run` closed it), so it is closed first.
    """
    import wandb
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if wandb.run is not None and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        wandb.finish(exit_code=1)
    try:
        _ = logger.experiment
    except Exception as e:
        return _first_line(e)
    return None


# ---- during and after training --------------------------------------------------------------------------------------
def _kind(logger: Any) -> str | None:
    name = type(logger).__name__
    return name if name in EXTRAS else None


def _jpeg(rgb: Any, path: Path, quality: int = 90) -> Path:
    import cv2

    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding of {path.name} failed")
    path.write_bytes(buf.tobytes())
    return path


def log_image(logger: Any, tag: str, rgb: Any, step: int) -> bool:
    """Log an (H, W, 3) uint8 RGB image to an MLflow (artifact `<tag>.jpg`) or W&B (media `<tag>`) logger as JPEG.

    Returns:
        False when `logger` is neither (nothing logged).
    """
    kind = _kind(logger)
    if kind is None:
        return False
    folder, _, name = tag.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:
        path = _jpeg(rgb, Path(tmp) / f"{name}.jpg")
        if kind == "MLFlowLogger":
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder or None)
        else:
            logger.log_image(key=tag, images=[str(path)], step=step)  # W&B copies the file when it is logged
    return True


def run_fitness(trainer: Any) -> float | None:
    """YOLOv5's fitness of the run: its best validation (ValidationSummary's best row) if it has the callback, else
    the last `val/fitness` logged; None without a validation."""
    from yolo5l.callbacks.val_summary import ValidationSummary

    summary = next((cb for cb in trainer.callbacks if isinstance(cb, ValidationSummary)), None)
    if summary is not None and summary.best is not None:
        return float(summary.best["val/fitness"])
    value = trainer.callback_metrics.get("val/fitness")
    return float(value) if value is not None else None


def run_files(trainer: Any, output_dir: Path) -> list[tuple[Path, str]]:
    """The files of a finished run that go to the trackers, those that exist: (path, artifact folder).

    The weights are LastCheckpoint's `checkpoints/weights.pt` (`<run>/weights.pt` when no checkpoint callback ran),
    logged under the folder they are in; the tables go to the artifact root.
    """
    ckpt_dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    weights = next((d / "weights.pt" for d in [*ckpt_dirs, output_dir] if (d / "weights.pt").is_file()), None)
    found = [] if weights is None else [(weights, "" if weights.parent == output_dir else weights.parent.name)]
    csv = next((Path(lg.path) for lg in trainer.loggers if hasattr(lg, "history")), output_dir / "metrics.csv")
    tables = [csv, *(output_dir / name for name in RUN_TABLES)]
    return found + [(path, "") for path in tables if path.is_file()]


def finish_run(trainer: Any, output_dir: str | os.PathLike) -> dict[str, float]:
    """End of `train`: the run's best fitness as `{"val/best_fitness": x}` ({} without a validation), and on global
    rank 0 the run's files (`run_files`) as artifacts of its MLflow and W&B runs, whose W&B run is then closed.

    A tracker that fails here costs one warning line: the run folder has everything already.
    """
    fitness = run_fitness(trainer)
    if trainer.is_global_zero:
        files = run_files(trainer, Path(output_dir))
        for logger in trainer.loggers:
            kind = _kind(logger)
            if kind is None:
                continue
            try:
                _log_files(logger, kind, files)
            except Exception as e:
                _warn(f"{kind}: the run's files were not logged ({_first_line(e)}); they are in {output_dir}")
    return {} if fitness is None else {"val/best_fitness": fitness}


def _log_files(logger: Any, kind: str, files: Sequence[tuple[Path, str]]) -> None:
    if kind == "MLFlowLogger":
        for path, folder in files:
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder or None)
        return
    import wandb

    run = logger.experiment
    if files:
        artifact = wandb.Artifact(f"run-{run.id}-files", type="run-files")
        for path, folder in files:
            artifact.add_file(str(path), name=f"{folder}/{path.name}" if folder else path.name)
        run.log_artifact(artifact)
    run.finish()  # a sweep's next trial starts its own run


# ---- hyperparameter search ------------------------------------------------------------------------------------------
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
    from yolo5l.callbacks.sweep import read_summary

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
    path = sweep_dir / "best_hyp.yaml"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(header + OmegaConf.to_yaml(hyp, resolve=True))
    os.replace(tmp, path)
    return path, best


class SearchCallback(Callback):
    """Hydra callback of the `hparams_search` configs (`hydra.callbacks`): before the sweep, a search key that is not a
    hyperparameter is one line and exit code 2 (each trial would fail on it); after it, `best_hyp.yaml`.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import logging

        from yolo5l._cli import fail
        from yolo5l.config import check_search_space

        # Optuna imports alembic, which logs each of its plugins at INFO: seven lines before every search.
        logging.getLogger("alembic").setLevel(logging.WARNING)
        try:
            check_search_space(config)
        except UserError as e:
            fail(str(e))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from yolo5l._cli import print_outputs, relpath

        sweep_dir = Path(config.hydra.sweep.dir)
        written = write_best_hyp(sweep_dir)
        if written is None:
            return
        path, best = written
        with open(sweep_dir / "summary.md", "a") as f:
            f.write(f"\nThe best trial's hyperparameters (job {best['job']}): `{path.name}`, a conf/hyp file.\n")
        print_outputs(
            f"Search done: best job {best['job']}, val/fitness {float(best['fitness']):.4f}. Outputs:",
            {"table": relpath(sweep_dir / "summary.md"), "best hyp": relpath(path)},
        )
