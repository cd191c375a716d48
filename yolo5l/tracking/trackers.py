"""Experiment tracking on Lightning's own loggers (the hyperparameter search is `yolo5l.search`).

- `instantiate_entries` builds `train.build`'s callbacks and loggers (`logger=mlflow`, `logger=[tensorboard,comet]`).
  A tracker whose optional extra is not installed is a one-line `UserError` naming the extra; one whose server cannot
  be reached is one warning line naming it, and training goes on with the other loggers and the run folder. Every
  logger gets the composed config as flattened parameters (`model.width`). A logger option that yolo5l does not
  build (`logger=clearml`: its config's `unavailable` line says why and what instead) is a one-line `UserError`.
- `add_jpeg`, `log_image`: the drawn batches of BatchPlotter and ValidationPlots as JPEG to TensorBoard, MLflow, W&B
  and Comet.
- `finish_run`, at the end of `train`: the run's best `val/fitness` (what a sweeper maximises) and, on rank 0,
  weights.pt, metrics.csv and per_class.csv as artifacts of the MLflow and W&B runs and assets of the Comet
  experiment (weights.pt as a Comet model); the W&B run and the Comet experiment are then closed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from yolo5l.base.console import warn
from yolo5l.base.errors import UserError
from yolo5l.base.run_files import checkpoint_dir
from yolo5l.eval.best_fitness import run_fitness
from yolo5l.infer.annotate import encode_jpeg

__all__ = [
    "EXTRAS",
    "add_jpeg",
    "finish_run",
    "flat_config",
    "instantiate_entries",
    "log_image",
]

#: Logger class -> (module it needs, the yolo5l extra that installs it).
EXTRAS = {"MLFlowLogger": ("mlflow", "mlflow"), "WandbLogger": ("wandb", "wandb"), "CometLogger": ("comet_ml", "comet")}
#: Seconds a remote MLflow server gets to answer the start-up probe (MLflow's own retries take minutes).
PROBE_TIMEOUT_S = 10.0
#: Tables of the run folder that go to the trackers at the end when they exist, besides weights.pt and metrics.csv.
RUN_TABLES = ("per_class.csv",)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- building the loggers -------------------------------------------------------------------------------------------
def instantiate_entries(node: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group keyed by name (`callbacks`, `logger`).

    Trackers (MLflow, W&B, Comet) are checked first: a missing extra raises, an unreachable server drops the tracker
    with a warning (on rank 0, the only rank that talks to it). When the group holds loggers, each gets the root
    config's flattened values as hyperparameters.

    Raises:
        UserError: A tracker's extra is not installed; an entry that says why it is `unavailable`; Comet with
            `online: false`.
    """
    from lightning.pytorch.loggers import Logger

    from yolo5l.base.console import is_rank_zero

    built: list[Any] = []
    for name, entry in (node or {}).items():
        if OmegaConf.is_dict(entry) and "unavailable" in entry:
            raise UserError(f"logger={name} is not available: {entry.unavailable}")
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
                warn(f"logger={name}: MLflow tracking URI {uri} cannot be reached ({problem}); going on without it")
                continue
        if kind == "CometLogger" and entry.get("online") is False:
            # Lightning 2.6 then disables the experiment: nothing is logged (Lightning-AI/pytorch-lightning#21617)
            raise UserError(
                f"logger.{name}.online=false makes Lightning's CometLogger log nothing; for an offline experiment set "
                "COMET_START_ONLINE=false instead"
            )
        extra = _mlflow_artifacts(entry, node) if kind == "MLFlowLogger" else {}
        if kind == "CometLogger":
            _comet_environment()
        try:
            obj = instantiate(entry, _convert_="all", **extra)
        except Exception as e:
            if kind != "CometLogger" or not is_rank_zero():
                raise
            # CometLogger starts the experiment in its constructor, on rank 0 (no API key: a ValueError)
            cause = e.__cause__ or e  # Hydra's InstantiationException wraps the constructor's error
            warn(f"logger={name}: the Comet experiment cannot start ({_first_line(cause)}); going on without it")
            continue
        if kind == "WandbLogger" and is_rank_zero():
            problem = _start_wandb(obj)
            if problem is not None:
                host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
                warn(f"logger={name}: the W&B run at {host} cannot start ({problem}); going on without it")
                continue
        built.append(obj)
    loggers = [obj for obj in built if isinstance(obj, Logger)]
    if loggers and node is not None:
        params = flat_config(node._get_root())  # the whole run's config, not just the `logger` node
        for lg in loggers:
            lg.log_hyperparams(params)
    return built


def _comet_environment() -> None:
    """Before the first `import comet_ml` (CometLogger's constructor), unless the environment says otherwise:

    - Comet's auto-logging is off (COMET_DISABLE_AUTO_LOGGING=1). Lightning sets it too, but only after its
      availability check has imported comet_ml, whose import then patches TensorBoard's SummaryWriter: every scalar
      would reach the experiment twice, once from Lightning and once from the TensorBoard logger.
    - Comet's reports of its own errors to its Sentry project are off (COMET_ERROR_TRACKING_ENABLE=false): they are
      not the run's data, and where Sentry cannot be reached (an offline run) each try was three warning lines.
    """
    os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
    os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")


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


def add_jpeg(experiment: Any, tag: str, rgb: Any, step: int, quality: int = 90) -> None:
    """Write an (H, W, 3) uint8 RGB image to a TensorBoard `SummaryWriter` as JPEG.

    `SummaryWriter.add_image` encodes PNG, whose lossless compression of a mosaic of photos costs far more than JPEG,
    and a run pays it for every plotted batch at its start (docs/benchmarks.md has the figures). TensorBoard shows
    any encoded image; this writes the summary `add_image` would, through the same file writer, with JPEG bytes (a
    writer without one gets `add_image`).
    """
    file_writer = getattr(experiment, "_get_file_writer", None)
    if file_writer is None:
        experiment.add_image(tag, rgb, step, dataformats="HWC")
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(
        height=rgb.shape[0], width=rgb.shape[1], colorspace=3, encoded_image_string=encode_jpeg(rgb, quality)
    )
    file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


def log_image(logger: Any, tag: str, rgb: Any, step: int) -> bool:
    """Log an (H, W, 3) uint8 RGB image to an MLflow (artifact `<tag>.jpg`), W&B (media `<tag>`) or Comet (image
    `<tag>.jpg`) logger as JPEG.

    Returns:
        False when `logger` is none of them (nothing logged).
    """
    kind = _kind(logger)
    if kind is None:
        return False
    folder, _, name = tag.rpartition("/")
    if kind == "CometLogger":  # Comet copies a file-like image when it is logged
        logger.experiment.log_image(io.BytesIO(encode_jpeg(rgb)), name=f"{tag}.jpg", image_format="jpeg", step=step)
        return True
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.jpg"
        path.write_bytes(encode_jpeg(rgb))
        if kind == "MLFlowLogger":
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder or None)
        else:
            logger.log_image(key=tag, images=[str(path)], step=step)  # W&B copies the file when it is logged
    return True


def run_files(trainer: Any, output_dir: Path) -> list[tuple[Path, str]]:
    """The files of a finished run that go to the trackers, those that exist: (path, artifact folder).

    The weights are LastCheckpoint's `checkpoints/weights.pt` (`<run>/weights.pt` when no checkpoint callback ran),
    logged under the folder they are in; the tables go to the artifact root.
    """
    folders = [d for d in (checkpoint_dir(trainer), output_dir) if d is not None]
    weights = next((d / "weights.pt" for d in folders if (d / "weights.pt").is_file()), None)
    found = [] if weights is None else [(weights, "" if weights.parent == output_dir else weights.parent.name)]
    csv = next((Path(lg.path) for lg in trainer.loggers if hasattr(lg, "history")), output_dir / "metrics.csv")
    tables = [csv, *(output_dir / name for name in RUN_TABLES)]
    return found + [(path, "") for path in tables if path.is_file()]


def finish_run(trainer: Any, output_dir: str | os.PathLike) -> dict[str, float]:
    """End of `train`: the run's best fitness as `{"val/best_fitness": x}` ({} without a validation), and on global
    rank 0 the run's files (`run_files`) as artifacts of its MLflow and W&B runs and assets of its Comet experiment;
    the W&B run and the Comet experiment are then closed (an offline Comet experiment writes its archive then).

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
                warn(f"{kind}: the run's files were not logged ({_first_line(e)}); they are in {output_dir}")
    return {} if fitness is None else {"val/best_fitness": fitness}


def _log_files(logger: Any, kind: str, files: Sequence[tuple[Path, str]]) -> None:
    if kind == "MLFlowLogger":
        for path, folder in files:
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder or None)
        return
    if kind == "CometLogger":
        experiment = logger.experiment
        for path, folder in files:
            name = f"{folder}/{path.name}" if folder else path.name
            if path.suffix == ".pt":  # the weights: a model of the experiment (Comet's Models tab)
                experiment.log_model("yolo5l", str(path), file_name=name)
            else:
                experiment.log_asset(str(path), file_name=name)
        experiment.end()  # a sweep's next trial starts its own experiment
        return
    import wandb

    run = logger.experiment
    if files:
        artifact = wandb.Artifact(f"run-{run.id}-files", type="run-files")
        for path, folder in files:
            artifact.add_file(str(path), name=f"{folder}/{path.name}" if folder else path.name)
        run.log_artifact(artifact)
    run.finish()  # a sweep's next trial starts its own run
