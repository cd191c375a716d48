"""Nothing let in, nothing lost: hostile checkpoints at every entry point, a diverging run that stops without
writing non-finite weights, and one owner of the validation interval."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yolo5l.base.errors import UserError
from yolo5l.callbacks import EMACallback, LastCheckpoint, ValEveryNEpochs
from yolo5l.callbacks.checkpoint import AtomicCheckpointIO
from yolo5l.models.weights import load_weights
from yolo5l.resume import read_resume_state
from yolo5l.training.module import TrainingDiverged

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


class _Planted:
    """Unpickling this runs a shell command that creates `marker`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_files(tmp_path: Path) -> dict[str, Path]:
    marker = tmp_path / "pwned"
    files = {
        # a Lightning last.ckpt, a yolo5l weights file and an ultralytics .pt, each carrying the payload
        "last.ckpt": {"epoch": 0, "global_step": 1, "state_dict": {}, "callbacks": {"x": _Planted(marker)}},
        "weights.pt": {"model_config": {"depth": 0.33, "width": 0.25}, "state_dict": {}, "names": _Planted(marker)},
        "yolov5s.pt": {"epoch": -1, "model": _Planted(marker), "ema": None},
    }
    paths = {}
    for name, payload in files.items():
        paths[name] = tmp_path / name
        torch.save(payload, paths[name])
    return {**paths, "marker": marker}


def test_every_loader_refuses_hostile_checkpoints(tmp_path):
    files = _hostile_files(tmp_path)
    for name in ("last.ckpt", "weights.pt", "yolov5s.pt"):
        with pytest.raises(UserError):
            read_resume_state(files[name])
        with pytest.raises(ValueError, match=r"refused|not a|no yolov5"):
            load_weights(files[name])
        with pytest.raises(Exception, match="Weights only load failed"):
            AtomicCheckpointIO().load_checkpoint(files[name])  # Lightning's own load in fit(ckpt_path=...)
    assert not files["marker"].exists()


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("entry", "args", "name"),
    [
        ("train", ["resume={f}"], "last.ckpt"),
        ("train", ["weights={f}"], "weights.pt"),
        ("train", ["weights={f}"], "yolov5s.pt"),
        ("val", ["weights={f}"], "last.ckpt"),
        ("predict", ["weights={f}", "source={img}"], "yolov5s.pt"),
        ("convert", ["{f}", "{out}"], "weights.pt"),
        ("export", ["weights={f}"], "last.ckpt"),
    ],
)
def test_hostile_checkpoints_never_run_at_any_entry_point(tmp_path, entry, args, name):
    import cv2
    import numpy as np

    files = _hostile_files(tmp_path)
    img = tmp_path / "a.jpg"
    cv2.imwrite(str(img), np.zeros((32, 32, 3), np.uint8))
    fill = {"f": files[name], "img": img, "out": tmp_path / "out.pt"}
    argv = [a.format(**fill) for a in args]
    if entry in ("train", "val"):
        argv += [f"hydra.run.dir={tmp_path / 'run'}", f"data.synthetic.root={tmp_path / 'syn'}"]
    elif entry in ("predict", "export"):
        argv += [f"hydra.run.dir={tmp_path / 'run'}"]
    r = subprocess.run(
        [sys.executable, "-m", f"yolo5l.{entry}", *argv, *(["experiment=smoke"] if entry == "train" else [])],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path,
    )  # fmt: skip
    assert not files["marker"].exists(), "the planted command ran"
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_a_diverging_run_stops_without_writing_non_finite_weights(tmp_path, tiny_module, tiny_data, make_trainer):
    ck = tmp_path / "ck"
    module = tiny_module(max_nonfinite_steps=3)
    ema = EMACallback(tau=2)
    trainer = make_trainer(tmp_path, [ema, LastCheckpoint(dirpath=ck)], max_epochs=3, log_every_n_steps=1)
    module.optimizer_factory = lambda groups, **kw: torch.optim.SGD(groups, lr=1e12, momentum=0.9, **kw)
    with pytest.raises(TrainingDiverged, match=r"3 optimizer steps in a row had a non-finite loss .* hyp\.lr0=") as e:
        trainer.fit(module, tiny_data(n=16, batch_size=2))
    assert e.value.code == 65  # the command line's exit status
    assert int(module._bad_streak) >= 3
    params = {f"model.{n}" for n, _ in module.model.named_parameters()}
    ema_weights = [t for n, t in ema.ema_state_dict.items() if n in params]
    assert ema_weights
    assert all(torch.isfinite(t).all() for t in ema_weights)  # skipped steps stayed out of the EMA's weights
    for path in ck.glob("*"):  # whatever was written before the divergence is finite
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        tensors = list((ckpt.get("state_dict") or {}).values()) + list((ckpt.get("current_model_state") or {}).values())
        assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point()), path


def test_the_validation_interval_has_one_owner(tmp_path, tiny_module, tiny_data, make_trainer):
    trainer = make_trainer(tmp_path, [ValEveryNEpochs(2)], max_epochs=1, check_val_every_n_epoch=10)
    with pytest.raises(UserError, match=r"callbacks\.val_interval\.n=10"):
        trainer.fit(tiny_module(), tiny_data())
