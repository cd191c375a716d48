"""What ran is what the run folder says: the precision after the AMP check, the batch a search found, the cache after
its fallback and the model a weights file built are in `.hydra/config.yaml`, the checkpoint's config (what `resume=`
reads) and the start-up block, each with where it came from (yolo5l/run_info.py, yolo5l/callbacks/effective_config.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from yolo5l.callbacks.throughput import _advice
from yolo5l.config import compose_config
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.models.weights import save_weights
from yolo5l.models.yolo import YOLOv5
from yolo5l.run_info import training_rows
from yolo5l.train import build

ROOT = Path(__file__).resolve().parents[1]
#: Set up the data and stop: the start-up block and the config are written as fitting starts, before any batch.
NO_BATCHES = ["trainer.max_epochs=1", "trainer.limit_train_batches=0", "trainer.limit_val_batches=0", "plots=false",
              "logger.tensorboard.log_graph=false"]  # fmt: skip


def _block(out: str) -> dict[str, str]:
    """The start-up block's rows as printed: label -> `value   [source]`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Training in "))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        label, _, value = line.strip().partition(":")
        rows[label] = value.strip()
    return rows


def _fit(tmp_path: Path, overrides: list[str]):
    """Compose in `tmp_path/run` (with Hydra's `.hydra/` folder, as a command line has it), build and fit without
    batches; returns (the saved config, the data module)."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = compose_config([*overrides, *NO_BATCHES], output_dir=run)
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    return OmegaConf.load(run / ".hydra" / "config.yaml"), datamodule


def _smoke(tmp_path: Path) -> list[str]:
    return ["experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.imgsz=64"]


def test_precision_forced_to_32_true_by_a_failed_amp_check_is_what_the_run_says(tmp_path, monkeypatch, capsys):
    import yolo5l.training.amp_check

    monkeypatch.setattr(yolo5l.training.amp_check, "check_amp", lambda *a, **k: ("32-true", "AMP check: stand-in"))
    saved, _ = _fit(tmp_path, [*_smoke(tmp_path), "trainer.precision=bf16-mixed"])
    assert saved.trainer.precision == "32-true"
    assert saved.sources.trainer.precision == "fallback: the AMP check failed for bf16-mixed on this GPU"
    rows = _block(capsys.readouterr().out)
    assert rows["precision"] == "32-true   [fallback: the AMP check failed for bf16-mixed on this GPU]"


def test_a_cache_that_does_not_fit_is_none_with_its_reason(tmp_path, monkeypatch, capsys):
    import yolo5l.data.cache

    monkeypatch.setattr(yolo5l.data.cache, "HEADROOM", 1e12)  # no machine has the memory asked for
    saved, datamodule = _fit(tmp_path, [*_smoke(tmp_path), "data.cache=ram"])
    reason = "RAM cache disabled: 32 images need "
    assert saved.data.cache == "none"
    assert saved.sources.data.cache.startswith(f"fallback: {reason}")
    assert "available" in saved.sources.data.cache
    assert _block(capsys.readouterr().out)["cache"].startswith(f"none   [fallback: {reason}")
    assert (datamodule.cache_used, datamodule.cache) == ("none", "ram")
    assert f"cache decoded images (data.cache=ram: {reason}" in _advice(datamodule)  # not "the cache is on"


@pytest.fixture
def own_data(tmp_path) -> tuple[Path, Path]:
    """A dataset yaml of one's own and a yolov5n-sized weights file trained on it."""
    yaml = ensure_synthetic(tmp_path / "mine", num_train=8, num_val=4, seed=1)
    weights = save_weights(
        YOLOv5(num_classes=4, depth=0.33, width=0.25), tmp_path / "best.pt", ["a", "b", "c", "d"], imgsz=64, data=yaml
    )
    return yaml, weights


def test_weights_build_their_model_and_the_run_says_so(tmp_path, own_data, capsys):
    """`data.file=my.yaml weights=<a yolov5n best.pt>`, no model= typed: the yolov5n built, not the yolov5s default."""
    yaml, weights = own_data
    saved, _ = _fit(tmp_path, [f"data.file={yaml}", f"weights={weights}", "trainer.accelerator=cpu", "data.imgsz=64"])
    built = saved.model_built
    assert (built.name, built.depth, built.width) == ("yolov5n", 0.33, 0.25)
    assert saved.sources.model == "weights"
    model = _block(capsys.readouterr().out)["model"]
    assert model.startswith("yolov5n, depth 0.33, width 0.25: 1.77 M parameters")
    assert model.endswith("   [weights]")


def test_sources_of_a_dataset_file_without_a_typed_batch(tmp_path, own_data):
    """v7.0's defaults for a dataset file (640 px, no cache) and the yaml's own batch: not `data=synthetic`, not
    `command line` (data.file= types the file, not the batch)."""
    yaml, _ = own_data
    cfg = compose_config([f"data.file={yaml}", "trainer.accelerator=cpu"], output_dir=tmp_path / "run")
    datamodule, module, trainer = build(cfg)
    hc = HydraConfig.get()
    rows = training_rows(cfg, datamodule, module, trainer, list(hc.overrides.task), dict(hc.runtime.choices))
    assert rows["image size"] == "640   [v7.0's default for a dataset file]"
    assert rows["cache"] == "none   [v7.0's default for a dataset file]"
    assert rows["batch"] == "16 in all, 16 per device"  # the shipped default: no source shown
    assert rows["data"].endswith("mine/data.yaml, 4 classes   [command line]")
    assert OmegaConf.to_container(cfg.sources.data) == {
        "imgsz": "v7.0's default for a dataset file", "batch_size": "default",
        "cache": "v7.0's default for a dataset file",
    }  # fmt: skip


def _train(cwd: Path, *args: str, prelude: str = "pass") -> subprocess.CompletedProcess:
    """`python -m yolo5l.train *args` in `cwd` (a `prelude` runs first in the same process)."""
    code = f"import sys; {prelude}; sys.argv = ['yolo5l-train', *sys.argv[1:]]; from yolo5l.train import main; main()"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, "trainer.enable_progress_bar=false", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


#: A resumed run that searched again would fail with this line.
NO_SEARCH = (
    "import yolo5l.training.batch_search as b; "
    "b.BatchSizeSearch.__call__ = lambda *a, **k: (_ for _ in ()).throw(AssertionError('searched again'))"
)


def test_a_searched_batch_is_saved_and_a_resume_reuses_it(tmp_path):
    """`python -m yolo5l.train data.batch_size=-1` searches, trains at the batch it found (its last.ckpt written),
    and saves it where a resume reads it; the resume does not search again."""
    r = _train(
        tmp_path, "experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.imgsz=64", "data.batch_size=-1",
        "tune.max_val=4", "tune.steps_per_trial=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
        "~callbacks.batch_plotter", "logger=none", "plots=false", "hydra.run.dir=runs/train/a",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch size search: using data.batch_size=4" in r.stdout
    assert _block(r.stdout)["batch"] == "4 in all, 4 per device   [batch search]"
    run = tmp_path / "runs" / "train" / "a"
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert (saved.data.batch_size, saved.sources.data.batch_size) == (4, "batch search")
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["yolo5l_config"]["data"]["batch_size"] == 4  # what resume= reads

    # The first command line again (data.batch_size=-1 asks for a search, which the run already made), extended.
    r = _train(tmp_path, "resume=true", "data.batch_size=-1", "trainer.max_epochs=2", prelude=NO_SEARCH)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch size search" not in r.stdout + r.stderr
    assert _block(r.stdout)["batch"] == "4 in all, 4 per device   [the checkpoint: batch search]"
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert (saved.data.batch_size, saved.sources.data.batch_size) == (4, "batch search")


def test_a_resume_takes_the_image_size_the_run_rounded_up_typed_again(tmp_path):
    """The run's command typed again with resume=true: `data.imgsz=100`, which the run rounded up to 128, agrees
    (any size that rounds to 128 does); a size that rounds elsewhere is refused, as is 100 for a run typed at 128."""
    from yolo5l.base.errors import UserError
    from yolo5l.resume import merge_resume_config

    saved = OmegaConf.to_container(compose_config(["experiment=smoke"], output_dir=tmp_path))

    def resumed_at(size: int, run_size: int, source: str) -> int:
        saved["data"]["imgsz"], saved["sources"] = run_size, {"data": {"imgsz": source}}
        typed = [f"data.imgsz={size}"]
        return merge_resume_config(compose_config(typed, output_dir=tmp_path), saved, typed, "last.ckpt").data.imgsz

    rounded = "command line: 100 rounded up to a multiple of 32, at least 64"
    assert [resumed_at(size, 128, rounded) for size in (100, 97, 128)] == [128] * 3
    for size in (64, 129, 160):
        with pytest.raises(UserError, match=rf"data\.imgsz={size} changes what the run .* \(data\.imgsz is 128 there"):
            resumed_at(size, 128, rounded)
    assert resumed_at(32, 64, "command line: 40 rounded up to a multiple of 32, at least 64") == 64  # the floor
    with pytest.raises(UserError, match=r"data\.imgsz is 128 there"):
        resumed_at(100, 128, "command line")  # typed 128: nothing was rounded


def test_the_first_command_line_again_resumes_at_the_size_it_rounded_up(tmp_path):
    """`data.imgsz=40` trains at 64 (v7.0's floor: twice the stride); the same command line with resume=true extends
    the run at 64, and the start-up block keeps the recorded source, not a bare `command line` for a value not typed."""
    first = (
        "experiment=smoke", f"data.synthetic.root={tmp_path / 's'}", "data.imgsz=40", "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1", "~callbacks.batch_plotter", "logger=none", "plots=false",
    )  # fmt: skip
    rounded = "64   [command line: 40 rounded up to a multiple of 32, at least 64]"
    r = _train(tmp_path, *first, "hydra.run.dir=runs/train/a")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _block(r.stdout)["image size"] == rounded
    r = _train(tmp_path, *first, "resume=true", "trainer.max_epochs=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _block(r.stdout)["image size"] == f"{rounded.split('[')[0]}[the checkpoint: {rounded.split('[')[1]}"
    assert "1 epoch (epoch 1), 2 in all" in r.stdout


def test_a_resume_takes_the_settled_values_of_the_requests_typed_again(tmp_path):
    """`data.batch_size=-1` and `trainer.precision=auto` typed again take what the run settled; another value is
    refused; a precision `auto` picked is picked again on another accelerator."""
    from yolo5l.base.errors import UserError
    from yolo5l.resume import merge_resume_config

    saved = OmegaConf.to_container(compose_config(["experiment=smoke"], output_dir=tmp_path))
    saved["data"]["batch_size"], saved["trainer"]["precision"] = 24, "16-mixed"
    saved["sources"] = {"data": {"batch_size": "batch search"}, "trainer": {"precision": "auto: CUDA"}}
    typed = ["data.batch_size=-1", "trainer.precision=auto"]
    merged = merge_resume_config(compose_config(typed, output_dir=tmp_path), saved, typed, "last.ckpt")
    assert (merged.data.batch_size, merged.trainer.precision) == (24, "16-mixed")
    now = compose_config(["data.batch_size=32"], output_dir=tmp_path)
    with pytest.raises(UserError, match=r"data\.batch_size=32 changes what the run .* \(data\.batch_size is 24 there"):
        merge_resume_config(now, saved, ["data.batch_size=32"], "last.ckpt")
    typed = ["trainer.accelerator=cpu"]
    merged = merge_resume_config(compose_config(typed, output_dir=tmp_path), saved, typed, "last.ckpt")
    assert merged.trainer.precision == "auto"  # build() resolves it for the CPU
    assert "precision" not in merged.sources.trainer
