"""Tracking and search: loggers as config (MLflow against a local file store, W&B and Comet offline), the composed
config as parameters, images and run files as artifacts; a missing extra, an unknown logger or logger=clearml as one
line, an unreachable server or a Comet experiment that cannot start as one warning; hparams_search=evolve's space
(YOLOv5's meta ranges), its search-key check, the fitness ranking and best_hyp.yaml, and a real 4-trial Optuna search
(slow)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from omegaconf import OmegaConf, open_dict

from yolo5l.base.errors import UserError
from yolo5l.callbacks.sweep import append_row, read_summary, render_markdown
from yolo5l.config import check_group_choices, check_search_space, compose_config

pytestmark = pytest.mark.heavy  # the trackers and the search end to end: make test-ci (CI) runs them

ROOT = Path(__file__).resolve().parents[1]

#: ultralytics/yolov5 v7.0 train.py `meta`: (lower, upper) of each hyperparameter --evolve searches.
YOLOV5_META = {
    "lr0": (1e-5, 1e-1), "lrf": (0.01, 1.0), "momentum": (0.6, 0.98), "weight_decay": (0.0, 0.001),
    "warmup_epochs": (0.0, 5.0), "warmup_momentum": (0.0, 0.95), "warmup_bias_lr": (0.0, 0.2), "box": (0.02, 0.2),
    "cls": (0.2, 4.0), "cls_pw": (0.5, 2.0), "obj": (0.2, 4.0), "obj_pw": (0.5, 2.0), "anchor_t": (2.0, 8.0),
    "hsv_h": (0.0, 0.1), "hsv_s": (0.0, 0.9), "hsv_v": (0.0, 0.9), "degrees": (0.0, 45.0), "translate": (0.0, 0.9),
    "scale": (0.0, 0.9), "shear": (0.0, 10.0), "perspective": (0.0, 0.001), "flipud": (0.0, 1.0), "fliplr": (0.0, 1.0),
    "mosaic": (0.0, 1.0), "mixup": (0.0, 1.0), "copy_paste": (0.0, 1.0),
}  # fmt: skip

#: A run of a few seconds: the smoke experiment, 2 training batches and 1 validation batch an epoch.
TINY = [
    "experiment=smoke", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.batch_plotter.num_batches=1",
]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _train(args: list[str], cwd: Path, timeout: int = 600, prelude: str = "pass") -> subprocess.CompletedProcess:
    """`python -m yolo5l.train *args` in `cwd` (a `prelude` runs first in the same process)."""
    code = f"import sys; {prelude}; sys.argv = ['yolo5l-train', *sys.argv[1:]]; from yolo5l.train import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _fit(overrides: list[str], tmp_path: Path):
    """Compose, build and fit in this process; returns (cfg, trainer, the run folder)."""
    from yolo5l.train import build

    out = tmp_path / "run"
    cfg = compose_config([*TINY, f"data.synthetic.root={tmp_path / 'syn'}", *overrides], output_dir=out)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    return cfg, trainer, out


def _compose_hydra(overrides: list[str]):
    """The train config with its `hydra` node, as a multirun's callbacks see it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="yolo5l.conf"):
        return compose("train", overrides=overrides, return_hydra_config=True)


# ---- loggers as config ----------------------------------------------------------------------------------------------
def test_unknown_logger_is_one_line_listing_the_choices():
    message = r"^unknown logger 'foo': choose one of clearml, comet, csv, mlflow, none, tensorboard, wandb$"
    for arg in ("logger=foo", "logger=[tensorboard,foo]"):
        with pytest.raises(UserError, match=message):
            check_group_choices([arg])
    check_group_choices(["logger=[tensorboard,mlflow,wandb,comet]"])


def test_logger_options_compose_alone_and_as_lists(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cases = {
        "mlflow": ["mlflow", "tensorboard", "csv"],  # added to the default loggers, as the README says
        "wandb": ["wandb", "tensorboard", "csv"],
        "comet": ["comet", "tensorboard", "csv"],
        "[tensorboard,mlflow]": ["tensorboard", "csv", "mlflow"],  # csv once, though both include it
        "[tensorboard,mlflow,wandb]": ["tensorboard", "csv", "mlflow", "wandb"],
    }
    for arg, keys in cases.items():
        cfg = compose_config([f"logger={arg}", f"paths.runs_dir={tmp_path}"], output_dir=tmp_path / "r")
        assert list(cfg.logger) == keys
    assert cfg.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert cfg.logger.mlflow.tags.run_dir == str(tmp_path / "r")
    assert cfg.logger.wandb.save_dir == str(tmp_path / "r")
    comet = compose_config(["logger=comet"], output_dir=tmp_path / "r").logger.comet
    assert (comet.offline_directory, comet.mode) == (str(tmp_path / "r" / "comet"), "create")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert compose_config(["logger=mlflow"], output_dir=tmp_path / "r").logger.mlflow.tracking_uri == (
        "http://mlflow.example:5000"
    )


def test_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    from yolo5l.tracking import trackers

    monkeypatch.setattr(trackers, "_installed", lambda module: False)
    for name in ("mlflow", "wandb", "comet"):
        cfg = compose_config([f"logger=[csv,{name}]"], output_dir=tmp_path)
        with pytest.raises(UserError, match=rf'^logger={name} needs the {name} extra: pip install -e "\.\[{name}\]"$'):
            trackers.instantiate_entries(cfg.logger)
    # The command line: one line, exit code 2, no run folder left behind.
    r = _train(
        [*TINY, "logger=mlflow", f"paths.runs_dir={tmp_path / 'runs'}"], tmp_path,
        prelude="import yolo5l.tracking.trackers as t; t._installed = lambda module: False",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == ['error: logger=mlflow needs the mlflow extra: pip install -e ".[mlflow]"']
    assert not any((tmp_path / "runs").rglob("metrics.csv"))


CLEARML_LINE = (
    "logger=clearml is not available: Lightning ships no ClearML logger and yolo5l patches no library for ClearML's "
    "Task.init; track the run with logger=comet, logger=mlflow or logger=wandb (TensorBoard events are in the run "
    "folder)"
)


def test_clearml_and_comet_online_false_are_one_line(tmp_path, monkeypatch):
    from yolo5l.tracking import trackers

    for arg in ("logger=clearml", "logger=[tensorboard,clearml]"):
        with pytest.raises(UserError) as e:
            trackers.instantiate_entries(compose_config([arg], output_dir=tmp_path).logger)
        assert str(e.value) == CLEARML_LINE
    monkeypatch.setattr(trackers, "_installed", lambda module: True)  # refused before comet_ml is imported
    cfg = compose_config(["logger=comet", "+logger.comet.online=false"], output_dir=tmp_path)
    with pytest.raises(UserError, match=r"^logger\.comet\.online=false makes Lightning's CometLogger log nothing; "
                       r"for an offline experiment set COMET_START_ONLINE=false instead$"):  # fmt: skip
        trackers.instantiate_entries(cfg.logger)
    # The command line: one line, exit code 2, nothing trained.
    r = _train([*TINY, "logger=clearml", f"paths.runs_dir={tmp_path / 'runs'}"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"error: {CLEARML_LINE}"]
    assert not any((tmp_path / "runs").rglob("metrics.csv"))


def test_comet_offline_experiment_has_config_metrics_images_and_run_files(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    out = tmp_path / "run"
    r = _train(["logger=comet", *TINY, "trainer.max_epochs=2", f"hydra.run.dir={out}",
                f"data.synthetic.root={tmp_path / 'syn'}"], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (archive,) = (out / "comet").glob("*.zip")  # written as finish_run ends the experiment
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]

    def of(kind):
        return [m["payload"] for m in messages if m["type"] == kind]

    logged = [p.get("param") or p["params"] for p in of("parameter_msg")]  # "params": a list value
    params = {p["paramName"]: p["paramValue"] for p in logged}
    cfg = OmegaConf.load(out / ".hydra" / "config.yaml")
    assert (params["model.width"], params["hyp.lr0"], params["data.imgsz"]) == (cfg.model.width, cfg.hyp.lr0, 128)
    names = [p["metric"]["metricName"] for p in of("metric_msg")]
    assert names.count("val/map") == 2  # once a validation: not again from TensorBoard's writer (Comet auto-logging)
    assert "train/loss_box" in names
    extra = [(p["upload_type"], p.get("additional_params") or {}) for p in of("file_upload")]
    uploads = {(kind, a.get("fileName") or a.get("figName")) for kind, a in extra}
    assert {("visualization", "train/batch0.jpg"), ("model-element", "checkpoints/weights.pt"),
            ("asset", "metrics.csv"), ("asset", "per_class.csv")} <= uploads  # fmt: skip
    assert "sentry" not in r.stdout + r.stderr  # Comet's own error reports stay off (no retry lines without network)


def test_comet_that_cannot_start_is_one_warning_and_the_other_loggers_stay(tmp_path):
    pytest.importorskip("comet_ml")
    code = (
        "from yolo5l.config import compose_config; from yolo5l.tracking.trackers import instantiate_entries; "
        f"cfg = compose_config(['logger=[csv,comet]'], output_dir={str(tmp_path)!r}); "
        "print([type(lg).__name__ for lg in instantiate_entries(cfg.logger)])"
    )
    env = {k: v for k, v in _env().items() if not k.startswith("COMET_")}  # online and no API key: cannot start
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert lines[-1] == "['EpochCSVLogger', 'TensorBoardLogger']"
    (warning,) = [ln for ln in lines if ln.startswith("warning: ")]
    assert warning.startswith("warning: logger=comet: the Comet experiment cannot start (ValueError: Comet")
    assert warning.endswith("; going on without it")


def test_unreachable_tracking_uri_is_one_warning_and_the_other_loggers_stay(tmp_path, capsys):
    pytest.importorskip("mlflow")
    from yolo5l.tracking.trackers import instantiate_entries

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    cfg = compose_config(["logger=[csv,mlflow]", f"logger.mlflow.tracking_uri={uri}"], output_dir=tmp_path)
    loggers = instantiate_entries(cfg.logger)
    assert [type(lg).__name__ for lg in loggers] == ["EpochCSVLogger", "TensorBoardLogger"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "warning: logger=mlflow" in lines[0]
    assert uri in lines[0]


def test_mlflow_run_has_metrics_params_images_and_run_files(tmp_path, monkeypatch, one_thread):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from yolo5l.eval.best_fitness import run_fitness
    from yolo5l.tracking.trackers import finish_run

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    uri = f"file:{tmp_path / 'mlruns'}"
    cfg, trainer, out = _fit(["logger=mlflow", f"logger.mlflow.tracking_uri={uri}", "trainer.max_epochs=2"], tmp_path)
    (out / "per_class.csv").write_text("class,map\n0,0.5\n")  # a per-class table in the run folder goes along
    result = finish_run(trainer, out)
    assert result == {"val/best_fitness": run_fitness(trainer)}

    (logger,) = [lg for lg in trainer.loggers if type(lg).__name__ == "MLFlowLogger"]
    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["run_dir"] == str(out)
    assert len(client.get_metric_history(run.info.run_id, "val/map")) == 2  # one value per validation
    assert "train/loss_box" in run.data.metrics
    params = run.data.params
    assert params["model.width"] == str(cfg.model.width)
    assert params["hyp.lr0"] == str(cfg.hyp.lr0)
    assert params["data.imgsz"] == "128"

    def listing(path=None):
        for a in client.list_artifacts(run.info.run_id, path):
            yield from listing(a.path) if a.is_dir else [a.path]

    artifacts = set(listing())
    assert {"checkpoints/weights.pt", "metrics.csv", "per_class.csv", "train/batch0.jpg"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "checkpoints/weights.pt", str(tmp_path / "dl")))
    assert local.read_bytes() == (out / "checkpoints" / "weights.pt").read_bytes()


def test_run_files_go_to_the_trackers_from_global_rank_zero_only(tmp_path):
    from yolo5l.tracking.trackers import finish_run

    (tmp_path / "metrics.csv").write_text("epoch\n0\n")
    calls = []

    class MLFlowLogger:  # the name is what the tracking helpers look at
        run_id = "r"
        experiment = SimpleNamespace(log_artifact=lambda *a, **k: calls.append(a))

    trainer = SimpleNamespace(
        is_global_zero=False, loggers=[MLFlowLogger()], callbacks=[], checkpoint_callbacks=[], lightning_module=None,
        callback_metrics={"val/fitness": 0.25},
    )  # fmt: skip
    assert finish_run(trainer, tmp_path) == {"val/best_fitness": 0.25}
    assert calls == []
    trainer.is_global_zero = True
    finish_run(trainer, tmp_path)
    assert calls == [("r", str(tmp_path / "metrics.csv"))]


@pytest.mark.slow
def test_ddp_makes_one_mlflow_run_from_rank_zero(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    r = subprocess.run(
        [sys.executable, "-m", "yolo5l.train", *TINY, f"hydra.run.dir={tmp_path / 'run'}",
         f"data.synthetic.root={tmp_path / 'syn'}", "trainer.devices=2", "trainer.strategy=ddp", "data.batch_size=8",
         "logger=mlflow", f"logger.mlflow.tracking_uri={uri}"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("yolo5l").experiment_id])
    assert run.info.status == "FINISHED"
    assert {"checkpoints", "metrics.csv"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow
def test_wandb_offline_run_has_config_metrics_images_and_run_files(tmp_path, monkeypatch, one_thread):
    wandb = pytest.importorskip("wandb")
    from yolo5l.tracking.trackers import finish_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logged = []
    original = wandb.sdk.wandb_run.Run.log_artifact

    def spy(self, artifact, *args, **kwargs):
        logged.append(sorted(artifact.manifest.entries))
        return original(self, artifact, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log_artifact", spy)
    cfg, trainer, out = _fit(["logger=wandb", "trainer.max_epochs=1"], tmp_path)
    (logger,) = [lg for lg in trainer.loggers if type(lg).__name__ == "WandbLogger"]
    run = logger.experiment
    assert run.config["model.width"] == cfg.model.width
    assert run.config["hyp.lr0"] == cfg.hyp.lr0
    assert dict(run.summary).get("val/map") is not None
    assert list(Path(run.dir).rglob("media/images/train/batch0*.jpg"))
    finish_run(trainer, out)
    assert len(logged) == 1
    assert {"checkpoints/weights.pt", "metrics.csv"} <= set(logged[0])
    assert wandb.run is None  # closed: a sweep's next trial starts its own run


# ---- hyperparameter search ------------------------------------------------------------------------------------------
def _interval(text: str) -> tuple[float, float]:
    assert text.startswith("interval("), text
    low, high = (s.strip() for s in text[len("interval(") :].removesuffix(")").split(","))
    assert "." in low, f"{text}: an integer bound would make Optuna sample integers"
    assert "." in high, f"{text}: an integer bound would make Optuna sample integers"
    return float(low), float(high)


def test_evolve_searches_yolov5s_meta_ranges_over_existing_hyp_keys():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = _compose_hydra(["hparams_search=evolve"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper")
    assert (sweeper.direction, sweeper.sampler._target_) == ("maximize", "optuna.samplers.TPESampler")
    assert cfg.hydra.mode.name == "MULTIRUN"
    space = {k.removeprefix("hyp."): _interval(v) for k, v in sweeper.params.items()}
    assert space == YOLOV5_META
    scratch_low = yaml.safe_load((ROOT / "conf" / "hyp" / "scratch-low.yaml").read_text())
    assert set(space) <= set(scratch_low)
    check_search_space(cfg)  # the shipped space passes its own check

    cmaes = _compose_hydra(["hparams_search=evolve", "hydra/sweeper/sampler=cmaes"]).hydra.sweeper.sampler
    assert cmaes._target_ == "optuna.samplers.CmaEsSampler"
    from hydra.utils import instantiate

    assert type(instantiate(cmaes)).__name__ == "CmaEsSampler"
    joblib = _compose_hydra(["hparams_search=evolve", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"])
    assert joblib.hydra.launcher._target_.endswith("JoblibLauncher")
    assert joblib.hydra.launcher.n_jobs == 2


def test_a_search_key_that_is_not_a_hyperparameter_is_one_line(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = _compose_hydra(["hparams_search=evolve"])
    with open_dict(cfg):
        cfg.hydra.sweeper.params["hyp.lr9"] = "interval(0.0, 1.0)"  # a search yaml with a typo
    with pytest.raises(UserError, match=r"^hparams_search: hyp\.lr9 is not a hyperparameter .*: search one of .*lr0"):
        check_search_space(cfg)
    cfg = _compose_hydra(["hparams_search=evolve", "+hyp.lr9=0.5"])
    check_search_space(cfg)  # `+` adds a key on purpose: not a typo
    # The command line: refused before the first trial (by the override check, yolo5l.overrides), one line, exit 2.
    r = _train(["hparams_search=evolve", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}", "hyp.lr9=interval(0,1)"],
               tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: hyp.lr9=interval(0,1): unknown key hyp.lr9; did you mean"), lines
    assert not (tmp_path / "sweep").exists()


def _write_job(sweep: Path, job: int, lr0: float) -> str:
    out = sweep / str(job)
    (out / ".hydra").mkdir(parents=True)
    hyp = {**yaml.safe_load((ROOT / "conf" / "hyp" / "scratch-low.yaml").read_text()), "lr0": lr0}
    (out / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"hyp": hyp, "model": {"width": 0.25}}))
    return str(out)


def test_search_summary_ranks_by_fitness_and_best_hyp_is_the_best_trials(tmp_path):
    from yolo5l.search import write_best_hyp

    fitness = {0: 0.2, 1: 0.5, 2: float("nan"), 3: 0.35}  # job 2 failed before validating
    for job, fit in fitness.items():
        row = {"job": job, "overrides": f"hparams_search=evolve hyp.lr0=0.0{job}123456789", "fitness": fit,
               "map_50": 0.1, "map": 0.1, "images_per_sec": 10.0, "wall_s": 1.0, "status": "finished",
               "output_dir": _write_job(tmp_path, job, lr0=0.01 + job)}  # fmt: skip
        append_row(tmp_path, row, rank_by="fitness")
    md = (tmp_path / "summary.md").read_text()
    table = [ln.split("|") for ln in md.splitlines() if ln.startswith("| ") and "rank" not in ln]
    assert [(int(c[1]), int(c[2])) for c in table] == [(1, 1), (2, 3), (3, 0), (4, 2)]  # (rank, job), best first
    assert "**Best: job 1**, fitness 0.5000" in md
    assert "`hyp.lr0=0.01123`" in md  # shortened in the table
    assert "Common overrides: `hparams_search=evolve`" in md
    # A plain sweep keeps its throughput order.
    assert render_markdown(read_summary(tmp_path / "summary.csv")).splitlines()[2].startswith("| job | overrides |")

    path, best = write_best_hyp(tmp_path)
    assert (path, best["job"]) == (tmp_path / "best_hyp.yaml", "1")
    hyp = yaml.safe_load(path.read_text())
    assert hyp == {**yaml.safe_load((ROOT / "conf" / "hyp" / "scratch-low.yaml").read_text()), "lr0": 1.01}


@pytest.mark.slow
def test_evolve_search_ranks_trials_and_its_best_hyp_trains(tmp_path, one_thread):
    """4 Optuna trials of yolov5n (2 epochs, 2 batches of 128 px), one at a time, the study kept in SQLite: the
    summary's best is the study's best, and best_hyp.yaml is a hyp option that trains."""
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep, storage = tmp_path / "sweep", f"sqlite:///{tmp_path / 'study.db'}"
    r = _train(
        ["hparams_search=evolve", *TINY, "trainer.max_epochs=2", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=1",
         f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=tiny", f"hydra.sweep.dir={sweep}",
         f"data.synthetic.root={tmp_path / 'syn'}"],
        tmp_path, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    stored = optuna.load_study(study_name="tiny", storage=storage)  # what a later sweep continues from
    assert len(stored.trials) == 4
    assert stored.best_value == study["best_value"]
    rows = read_summary(sweep / "summary.csv")
    assert len(rows) == 4
    assert {row["status"] for row in rows} == {"finished"}
    best = max(rows, key=lambda row: float(row["fitness"]))
    assert math.isclose(float(best["fitness"]), study["best_value"], rel_tol=1e-5, abs_tol=1e-9)
    assert f"**Best: job {best['job']}**" in (sweep / "summary.md").read_text()
    job_hyp = OmegaConf.load(Path(best["output_dir"]) / ".hydra" / "config.yaml").hyp
    best_hyp = yaml.safe_load((sweep / "best_hyp.yaml").read_text())
    assert best_hyp == OmegaConf.to_container(job_hyp)
    assert set(best_hyp) == set(yaml.safe_load((ROOT / "conf" / "hyp" / "scratch-low.yaml").read_text()))
    for key, value in study["best_params"].items():
        assert math.isclose(best_hyp[key.removeprefix("hyp.")], value)
    assert str(sweep / "best_hyp.yaml") in r.stdout or "best_hyp.yaml" in r.stdout

    # best_hyp.yaml is a hyp option as it is: one epoch with it.
    (tmp_path / "conf" / "hyp").mkdir(parents=True)
    (tmp_path / "conf" / "hyp" / "best_hyp.yaml").write_text((sweep / "best_hyp.yaml").read_text())
    cfg, trainer, _ = _fit([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hyp=best_hyp"], tmp_path / "again")
    assert OmegaConf.to_container(cfg.hyp) == best_hyp
    assert trainer.current_epoch == 1
