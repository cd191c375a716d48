"""DDP on the CPU (gloo, 2 processes) through the real entry point: Lightning re-launches `python -m yolo5l.train`
under Hydra with hydra.run.dir pointing at our run folder. Heavy: CI's `make test-ci` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from yolo5l.tracking.loggers import read_metrics_csv


@pytest.mark.heavy
def test_ddp_two_cpu_processes(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "yolo5l.train",
            "experiment=smoke",
            f"hydra.run.dir={run}",
            f"data.synthetic.root={tmp_path / 'synthetic'}",
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "data.batch_size=8",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Training done") == 1  # rank 0 reports, rank 1 stays quiet
    assert (run / "train_ddp_process_1.log").is_file()  # the re-launched rank used our run folder
    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] > 0
    assert len(read_metrics_csv(run / "metrics.csv")) == 1


def test_multirun_with_ddp_is_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "yolo5l.train",
            "-m",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "seed=1,2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "trainer.strategy=ddp_spawn" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "sweep").exists()  # a refused sweep leaves no folder (Hydra's multirun.yaml alone)


@pytest.mark.parametrize(
    ("env", "zero"),
    [({}, True), ({"RANK": "1"}, False), ({"LOCAL_RANK": "0", "SLURM_PROCID": "3"}, True),
     ({"SLURM_PROCID": "2"}, False), ({"JSM_NAMESPACE_RANK": "0"}, True), ({"RANK": "0", "NODE_RANK": "1"}, False)],
)  # fmt: skip
def test_rank_zero_is_lightnings_whether_or_not_lightning_is_imported(monkeypatch, env, zero):
    """Before Lightning is imported (a command's mistake or `--help`), the variables give the answer Lightning's
    `_get_rank` gives, in its order; NODE_RANK > 0 is no rank 0 either way."""
    import lightning.fabric.utilities.rank_zero  # noqa: F401 - imported in this session anyway

    from yolo5l.base.console import RANK_ENV, is_rank_zero

    for key in (*RANK_ENV, "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert is_rank_zero() is zero
    monkeypatch.delitem(sys.modules, "lightning.fabric.utilities.rank_zero")
    assert is_rank_zero() is zero


# --------------------------------------------------------------------------------------------------------------
# What each rank did, recorded by tests/_ddp_probe.py in a 2-process gloo run, and a single-process oracle.

_TESTS = os.path.dirname(os.path.abspath(__file__))
# 15: one wrap-around pad; a total validation batch of 8 is 4 a rank: 16 / (2 ranks x 4) even shards
_NUM_TRAIN, _NUM_VAL, _IMGSZ, _VAL_BATCH = 15, 16, 64, 8
# An untrained yolov5n scores below YOLOv5's 0.001 everywhere (mAP 0 would compare nothing): keep every candidate
# (252 per 64 px image, under max_det) so some random boxes hit and the mAP is a non-trivial number.
_CONF = 1e-9


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _data_overrides(root) -> list[str]:
    return [
        f"data.synthetic.root={root}",
        f"data.synthetic.num_train={_NUM_TRAIN}",
        f"data.synthetic.num_val={_NUM_VAL}",
        f"data.imgsz={_IMGSZ}",
    ]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """2 ranks x 2 epochs, 2 images per rank per micro-batch, nbs=128 so warmup accumulates (no_sync micro-batches)."""
    tmp = tmp_path_factory.mktemp("ddp_probe")
    run, probe = tmp / "run", tmp / "probe"
    r = subprocess.run(
        [
            sys.executable, "-m", "yolo5l.train", "experiment=smoke", "logger=csv", f"hydra.run.dir={run}",
            *_data_overrides(tmp / "synthetic"),
            "data.batch_size=4", f"data.val_batch_size={_VAL_BATCH}", "data.cache=ram",
            "trainer.devices=2", "trainer.strategy=ddp", "trainer.max_epochs=2",
            "trainer.limit_train_batches=null", "trainer.limit_val_batches=null", "module.nbs=128",
            f"module.conf_thres={_CONF}",
            "+callbacks.probe._target_=_ddp_probe.Probe", f"+callbacks.probe.out={probe}",
        ],
        capture_output=True, text=True, timeout=900, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(probe / f"rank{i}.pt", weights_only=True) for i in range(2)]
    return {"tmp": tmp, "run": run, "ranks": ranks}


@pytest.mark.heavy
def test_ddp_train_shards_and_ram_cache(ddp_run):
    r0, r1 = ddp_run["ranks"]
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    assert r0["train_files"] == r1["train_files"]
    assert len(r0["train_files"]) == _NUM_TRAIN
    s0, s1 = set(r0["train_shard"]), set(r1["train_shard"])
    # ceil(15 / 2) = 8 per rank: the permutation wraps around once, so exactly one image is on both ranks.
    assert len(r0["train_shard"]) == len(r1["train_shard"]) == 8
    assert s0 | s1 == set(range(_NUM_TRAIN))
    assert len(s0 & s1) == 2 * 8 - _NUM_TRAIN
    for rec, shard in ((r0, s0), (r1, s1)):
        assert len(rec["train_sampler"]) == 2  # two epochs
        for epoch in rec["train_sampler"]:
            assert sorted(epoch) == sorted(rec["train_shard"])  # the fixed shard, every epoch
        assert rec["train_sampler"][0] != rec["train_sampler"][1]  # reshuffled within the shard
        # The batches carried exactly the sampled images, in the sampler's order.
        for idx, paths in zip(rec["train_sampler"], rec["train_paths"], strict=True):
            assert paths == [rec["train_files"][i] for i in idx]
        # RAM cache: this rank's shard and nothing else (mosaic partners are drawn from the shard too).
        assert rec["train_cache_mode"] == "ram"
        assert set(rec["train_cached"]) == shard


@pytest.mark.heavy
def test_ddp_validation_shards_cover_once(ddp_run):
    r0, r1 = ddp_run["ranks"]
    files = r0["val_files"]
    assert files == r1["val_files"]
    assert len(files) == _NUM_VAL
    assert len(r0["val_paths"]) == len(r1["val_paths"]) == 2  # validated after each epoch
    for v0, v1 in zip(r0["val_paths"], r1["val_paths"], strict=True):
        assert set(v0).isdisjoint(v1)
        assert sorted(v0 + v1) == sorted(files)  # every val image exactly once over the ranks
        assert v0 + v1 == files  # contiguous runs of the aspect-sorted order: rect batch shapes stay valid
    for rec in (r0, r1):
        assert rec["val_cache_mode"] == "ram"
        assert set(rec["val_cached"]) == set(rec["val_shard"])
        assert len(rec["val_shard"]) == _NUM_VAL // 2


@pytest.mark.heavy
def test_ddp_weights_and_metrics_identical_on_ranks(ddp_run):
    r0, r1 = ddp_run["ranks"]
    assert r0["global_step"] == r1["global_step"] > 0
    assert r0["ema_updates"] == r1["ema_updates"] == r0["global_step"]
    # EMA (parameters and BN buffers) bit-identical on both ranks: each rank validates with its own copy.
    assert r0["ema_state"].keys() == r1["ema_state"].keys()
    diff = {k: (r0["ema_state"][k].double() - r1["ema_state"][k].double()).abs().max().item() for k in r0["ema_state"]}
    assert not any(diff.values()), {k: v for k, v in diff.items() if v}
    # Raw parameters identical: the ranks saw different images, so only all-reduced gradients keep them together.
    # (Raw BN running statistics are not: DDP broadcasts rank 0's at the start of each forward, and each rank's
    # last forward updated its own; hence EMACallback broadcasts rank 0's EMA buffers before using them.)
    assert r0["raw_state"].keys() == r1["raw_state"].keys()
    params = [k for k in r0["raw_state"] if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(params) == len(r0["raw_state"]) - 3 * sum(k.endswith("running_mean") for k in r0["raw_state"])
    for k in params:
        assert torch.equal(r0["raw_state"][k], r1["raw_state"][k]), k
    # The synced metrics are the same on both ranks after every validation.
    assert len(r0["val_metrics"]) == 2
    for m0, m1 in zip(r0["val_metrics"], r1["val_metrics"], strict=True):
        assert {"val/map", "val/map_50", "val/precision", "val/recall", "val/fitness"} <= m0.keys()
        assert m0 == m1


@pytest.mark.heavy
def test_ddp_no_sync_on_accumulation_micro_batches(ddp_run):
    for rec in ddp_run["ranks"]:
        sync = rec["sync"]
        assert len(sync) == 2 * 4  # 2 epochs x 4 micro-batches of 2 images
        # DDP all-reduces exactly on the micro-batches that end with an optimizer step.
        assert [grad_sync for grad_sync, _ in sync] == [step for _, step in sync]
        assert not all(grad_sync for grad_sync, _ in sync)  # some micro-batches only accumulated, unsynced
        assert rec["global_step"] == sum(step for _, step in sync)
    assert ddp_run["ranks"][0]["sync"] == ddp_run["ranks"][1]["sync"]


@pytest.mark.heavy
def test_ddp_accumulation_counts_the_total_batch(ddp_run):
    # nbs=128, total batch 4 (2 ranks x 2): warmup accumulation round(1 + (128 / 4 - 1) ni / 100) with at least 100
    # warmup iterations -> 1, 1, 2, 2, 2, 3, 3, 3 for ni 0..7 -> optimizer steps at ni 0, 1, 3, 6.
    # (A module that believes the total batch is 8 steps at ni 0, 1, 2, 3, 5, 7.)
    for rec in ddp_run["ranks"]:
        assert [step for _, step in rec["sync"]] == [True, True, False, True, False, False, True, False]


@pytest.mark.heavy
def test_ddp_checkpoints_written_by_rank_zero_only(ddp_run):
    r0, r1 = ddp_run["ranks"]
    assert r1["ckpt_writes"] == []
    assert r0["ckpt_writes"].count("weights.pt") == 1
    assert r0["ckpt_writes"].count("last.ckpt") == 2  # one per epoch
    files = sorted(p.name for p in (ddp_run["run"] / "checkpoints").iterdir())
    assert files == ["best.pt", "last.ckpt", "weights.pt"]  # no temporary files left behind
    ckpt = torch.load(ddp_run["run"] / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    for k, v in r0["ema_state"].items():
        assert torch.equal(ckpt["state_dict"][k], v), k  # last.ckpt holds the EMA of the end of training
    for k, v in r0["raw_state"].items():
        if "num_batches_tracked" not in k:
            assert torch.equal(ckpt["current_model_state"][k], v), k


@pytest.mark.heavy
def test_ddp_val_metrics_match_single_process_val(ddp_run):
    """The synced DDP mAP equals `python -m yolo5l.val` on one process over the same val set, same weights."""
    tmp, run = ddp_run["tmp"], ddp_run["run"]
    ddp_metrics = ddp_run["ranks"][0]["val_metrics"][-1]
    # weights.pt is half precision; validate the full-precision EMA of last.ckpt (what DDP validated) instead.
    half = torch.load(run / "checkpoints/weights.pt", map_location="cpu", weights_only=True)
    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    full = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert full.keys() == half["state_dict"].keys()
    weights = tmp / "ema_fp32.pt"
    torch.save({**half, "state_dict": full}, weights)
    out = tmp / "val"
    r = subprocess.run(
        [
            sys.executable, "-m", "yolo5l.val", f"weights={weights}", f"hydra.run.dir={out}",
            *_data_overrides(tmp / "synthetic"), f"data.val_batch_size={_VAL_BATCH // 2}", "data.num_workers=0",
            "data.cache=none", "trainer.accelerator=cpu", "trainer.precision=32", f"module.conf_thres={_CONF}",
        ],
        capture_output=True, text=True, timeout=600, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    single = json.loads((out / "metrics.json").read_text())
    keys = ["val/map", "val/map_50", "val/fitness"]
    # Equal shards (8 images per rank): the mean of the ranks' mean losses is the mean over the whole set.
    keys += ["val/loss_box", "val/loss_obj", "val/loss_cls"]
    assert ddp_metrics["val/map_50"] > 0  # detections matched: the comparison below is not 0 == 0
    for k in keys:
        assert single[k] == pytest.approx(ddp_metrics[k], rel=1e-5, abs=1e-6), (k, single[k], ddp_metrics[k])
    # torchmetrics' mAP gathers the ranks' images interleaved (r0 img0, r1 img0, ...), so COCOeval meets tied scores
    # in another order than one process does; precision/recall at the best-F1 confidence move by ~1e-5 (measured
    # 1.43e-5 at these settings with conf 1e-9, where ties abound).
    for k in ("val/precision", "val/recall"):
        assert single[k] == pytest.approx(ddp_metrics[k], abs=1e-4), (k, single[k], ddp_metrics[k])
