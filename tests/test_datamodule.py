"""YOLODataModule: batch format, samplers and DDP shards, caching per rank, worker seeding, close_mosaic."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from yolo5l.data.datamodule import ShardSampler, ValShardSampler, YOLODataModule, seed_worker
from yolo5l.data.dataset import collate_fn
from yolo5l.data.layout import DatasetError

IMGSZ = 128


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "synthetic"
    return {"root": str(root), "num_train": 24, "num_val": 10, "seed": 0, "min_side": 100, "max_side": 160}


def make_dm(synthetic, **kw) -> YOLODataModule:
    args = {"synthetic": synthetic, "imgsz": IMGSZ, "batch_size": 4, "num_workers": 0, "cache": "none"}
    args.update(kw)
    return YOLODataModule(**args)


def test_names_before_setup_and_batch_format(synthetic):
    dm = make_dm(synthetic)
    assert dm.num_classes == 4
    assert dm.names == ["rectangle", "ellipse", "triangle", "cross"]
    dm.prepare_data()
    dm.setup("fit")
    images, targets, paths, shapes = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8
    assert images.shape == (4, 3, IMGSZ, IMGSZ)
    assert targets.dtype == torch.float32
    assert targets.shape[1] == 6
    assert len(paths) == 4
    assert shapes == (None,) * 4  # mosaics
    idx = targets[:, 0]
    assert (idx == idx.round()).all()
    assert idx.min() >= 0
    assert idx.max() <= 3
    assert (idx[1:] >= idx[:-1]).all()
    assert ((targets[:, 2:] >= 0) & (targets[:, 2:] <= 1)).all()

    loader = dm.val_dataloader()
    assert loader.batch_size == 8  # 2 x train batch
    images, targets, paths, shapes = next(iter(loader))
    assert images.shape[0] == 8
    assert images.shape[2] % 32 == 0
    assert images.shape[3] % 32 == 0
    for (h0, w0), ((rh, rw), (pw, ph)) in shapes:
        assert 100 <= h0 <= 160
        assert 100 <= w0 <= 160
        # long side resized to IMGSZ, never enlarged further by the letterbox
        assert max(h0 * rh, w0 * rw) == pytest.approx(IMGSZ, abs=1)
        assert pw >= 0
        assert ph >= 0


def test_collate_writes_image_index():
    items = [
        (torch.zeros(3, 8, 8, dtype=torch.uint8), torch.ones(2, 6), "a.jpg", None),
        (torch.ones(3, 8, 8, dtype=torch.uint8), torch.zeros(0, 6), "b.jpg", None),
        (torch.ones(3, 8, 8, dtype=torch.uint8), torch.full((1, 6), 2.0), "c.jpg", ((8, 8), ((1.0, 1.0), (0.0, 0.0)))),
    ]
    images, targets, paths, shapes = collate_fn(items)
    assert images.shape == (3, 3, 8, 8)
    assert targets[:, 0].tolist() == [0, 0, 2]
    assert targets[:, 1:].tolist() == [[1] * 5, [1] * 5, [2] * 5]
    assert paths == ("a.jpg", "b.jpg", "c.jpg")
    assert shapes[2] == ((8, 8), ((1.0, 1.0), (0.0, 0.0)))


def test_shard_sampler_fixed_disjoint_shards_shuffled_per_epoch():
    n, world = 10, 3
    samplers = [ShardSampler(n, r, world, seed=7) for r in range(world)]
    shards = [set(s.indices.tolist()) for s in samplers]
    assert all(len(s) == 4 for s in samplers)  # ceil(10 / 3): equal length on every rank
    assert set().union(*shards) == set(range(n))
    counts = np.bincount(np.concatenate([s.indices for s in samplers]), minlength=n)
    assert sorted(counts.tolist()) == [1] * 8 + [2] * 2  # 12 slots: 2 padding repeats, no other overlap
    s = samplers[1]
    e0 = [i for i, *_ in s]
    assert e0 == [i for i, *_ in s]  # same epoch, same order
    orders = set()
    for epoch in range(6):
        s.set_epoch(epoch)
        order = [i for i, *_ in s]
        assert set(order) == shards[1]  # the shard never changes
        orders.add(tuple(order))
    assert len(orders) > 1  # but is reshuffled
    # one rank: everything, each once
    assert sorted(i for i, *_ in ShardSampler(n, 0, 1)) == list(range(n))


def test_shard_sampler_mosaic_flag():
    s = ShardSampler(5, mosaic_off_from=3)
    s.set_epoch(2)
    assert all(m for _, m, _ in s)
    s.set_epoch(3)
    assert not any(m for _, m, _ in s)


def test_val_shard_sampler_contiguous_whole_batches_no_duplicates():
    n, bs, world = 23, 4, 3  # 6 batches: 2 per rank
    parts = [ValShardSampler(n, bs, r, world).indices.tolist() for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))  # contiguous, in order, no duplicates
    for p in parts:
        assert p[0] % bs == 0
    assert [len(p) for p in parts] == [8, 8, 7]
    # more ranks than batches: some ranks get nothing, still no duplicates
    parts = [ValShardSampler(5, 4, r, 3).indices.tolist() for r in range(3)]
    assert [i for p in parts for i in p] == list(range(5))


def test_ddp_rank_caches_only_its_shard(synthetic, monkeypatch):
    dm = make_dm(synthetic, cache="ram")
    monkeypatch.setattr(dm, "_dist", lambda: (1, 2))
    dm.setup("fit")
    ds, sampler = dm.train_dataset, dm.train_sampler
    assert len(sampler) == 12
    cached = {i for i, a in enumerate(ds.cache.ram) if a is not None}
    assert cached == set(sampler.indices.tolist())
    assert set(ds.indices.tolist()) == cached  # mosaic partners come from the shard
    vcached = {i for i, a in enumerate(dm.val_dataset.cache.ram) if a is not None}
    assert vcached == set(dm.val_sampler.indices.tolist())
    # 10 val images, total val batch 8 = 4 a rank: 3 batches, rank 1 gets the last two
    assert vcached == set(range(4, 10))


def test_on_after_batch_transfer_float_and_channels_last():
    dm = YOLODataModule(synthetic={}, channels_last=True)
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).repeat(2, 3, 4, 1)  # (2, 3, 4, 3)
    out, *_ = dm.on_after_batch_transfer((images, torch.zeros(0, 6), ("a", "b"), (None, None)), 0)
    assert out.dtype == torch.float32
    assert out[0, 0, 0].tolist() == pytest.approx([0.0, 0.2, 1.0])
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_seed_worker_resets_affinity_and_seeds():
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs sched_setaffinity and 2 cores")
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        seed_worker(0)
        assert os.sched_getaffinity(0) == before | os.sched_getaffinity(0)
        assert len(os.sched_getaffinity(0)) > 1
    finally:
        os.sched_setaffinity(0, before)
    seed_worker(0)
    a = np.random.rand()
    seed_worker(0)
    assert np.random.rand() == a


class _SignalHandlers(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGUSR1)]


def test_seed_worker_leaves_the_schedulers_signals_to_the_main_process():
    """A worker ignores SIGTERM/SIGUSR1 (the main process handles them: PreemptionCheckpoint); the main process,
    where a notebook may call seed_worker, keeps its handlers: SIG_IGN there would outlive the call and pass to every
    process it starts."""
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
    seed_worker(0)
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == before
    loader = torch.utils.data.DataLoader(_SignalHandlers(), num_workers=1, worker_init_fn=seed_worker, batch_size=None)
    assert next(iter(loader)) == [str(signal.SIG_IGN)] * 2


def test_worker_seeding_reproducible(synthetic):
    def first_batch(seed):
        dm = make_dm(synthetic, num_workers=2, persistent_workers=False, seed=seed)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))

    a, b, c = first_batch(0), first_batch(0), first_batch(1)
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2] == b[2]
    assert not torch.equal(a[0], c[0])


class _Recorder(LightningModule):
    """Records, per epoch, whether the batches were mosaics and what reached the step."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, bool, torch.dtype, int]] = []

    def training_step(self, batch, batch_idx):
        images, _, _, shapes = batch
        self.seen.append((self.current_epoch, all(s is None for s in shapes), images.dtype, os.getpid()))
        return (self.w * images.mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_fit_close_mosaic_reaches_persistent_workers(synthetic, tmp_path):
    dm = make_dm(synthetic, num_workers=2, persistent_workers=True, close_mosaic=1)
    model = _Recorder()
    trainer = Trainer(
        max_epochs=3, limit_train_batches=2, limit_val_batches=0, accelerator="cpu", devices=1,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    assert loader.num_workers == 2
    assert loader.persistent_workers
    assert not loader.pin_memory  # CPU trainer
    assert dm.train_sampler.epoch == 2  # Lightning called set_epoch on our sampler
    by_epoch = {e: [m for ep, m, _, _ in model.seen if ep == e] for e in range(3)}
    assert by_epoch[0] == [True, True]
    assert by_epoch[1] == [True, True]
    assert by_epoch[2] == [False, False]  # last epoch: letterboxed, no mosaic
    assert all(dt == torch.float32 for _, _, dt, _ in model.seen)  # on_after_batch_transfer ran


def test_sample_augmentation_is_pure_function_of_key(synthetic):
    """(index, mosaic, (seed, epoch, rank)) fixes every random draw: the process's global RNG state plays no part."""
    dm = make_dm(synthetic, hyp={"mixup": 0.5, "copy_paste": 0.5, "degrees": 5.0, "flipud": 0.5})
    dm.setup("fit")
    ds = dm.train_dataset
    outs = []
    for s in (0, 1):
        np.random.seed(s)
        random.seed(s)
        ds.albumentations.reseed(s)
        outs.append(ds[(3, True, (0, 1, 0))])
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    other_epoch = ds[(3, True, (0, 2, 0))]
    assert not torch.equal(outs[0][0], other_epoch[0])


def test_batches_do_not_depend_on_num_workers(synthetic):
    """With augmentation on (mosaic, perspective, HSV, flips, albumentations): the same batches for 0 or 2 workers,
    in every epoch, persistent workers included."""

    def batches(num_workers: int) -> list:
        dm = make_dm(synthetic, num_workers=num_workers, persistent_workers=num_workers > 0, seed=3)
        dm.setup("fit")
        loader = dm.train_dataloader()
        out = []
        for epoch in (0, 1):
            dm.train_sampler.set_epoch(epoch)
            it = iter(loader)
            out += [next(it), next(it)]
        return out

    a, b = batches(0), batches(2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x[0], y[0])
        assert torch.equal(x[1], y[1])
        assert x[2] == y[2]
    assert not torch.equal(a[0][0], a[2][0])  # epochs differ


def test_resumed_fit_starts_with_its_epoch_in_workers(synthetic):
    """Lightning builds the train iterator before it calls set_epoch on the first epoch of a fit, and workers prefetch
    at once: the loader must already carry the epoch the (resumed) fit loop starts at."""
    from types import SimpleNamespace

    def stub_trainer(processed: int) -> SimpleNamespace:
        progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
        return SimpleNamespace(
            global_rank=0, world_size=1, max_epochs=5, fit_loop=SimpleNamespace(epoch_progress=progress),
            strategy=SimpleNamespace(root_device=torch.device("cpu")),
        )  # fmt: skip

    resumed = make_dm(synthetic, num_workers=2, persistent_workers=True)
    resumed.trainer = stub_trainer(2)
    resumed.setup("fit")
    got = next(iter(resumed.train_dataloader()))
    ref = make_dm(synthetic)
    ref.setup("fit")
    ref.train_sampler.set_epoch(2)
    want = next(iter(ref.train_dataloader()))
    assert resumed.train_sampler.epoch == 2
    assert got[2] == want[2]
    assert torch.equal(got[0], want[0])


def test_val_workers_default_to_zero_on_cpu(synthetic):
    """On the CPU the validation loader runs in the main process unless asked; the training loader keeps its workers."""
    dm = make_dm(synthetic, num_workers=2, persistent_workers=False)
    dm.setup("fit")
    assert dm.train_dataloader().num_workers == 2
    assert dm.val_dataloader().num_workers == 0  # no trainer and no CUDA here: the CPU rule
    dm._uses_accelerator = lambda: True  # an accelerator run keeps num_workers for validation too
    assert dm.val_dataloader().num_workers == 2
    explicit = make_dm(synthetic, num_workers=2, persistent_workers=False, val_num_workers=1)
    explicit.setup("validate")
    assert explicit.val_dataloader().num_workers == 1


def test_auto_workers_zero_on_cpu_and_per_device_share_on_an_accelerator(synthetic, monkeypatch):
    dm = make_dm(synthetic, num_workers="auto")
    dm.setup("fit")
    assert dm.train_workers() == 0  # CPU: the main thread loads
    assert dm.train_dataloader().num_workers == 0
    dm._uses_accelerator = lambda: True
    monkeypatch.setattr("yolo5l.base.hardware.owned_cores", lambda: 12)
    assert dm.train_workers() == 11  # every core but the training process's (no cap at YOLOv5's 8)
    dm.trainer = SimpleNamespace(num_devices=4)  # 12 cores shared by 4 local devices
    assert dm.train_workers() == 2
    assert dm._val_workers() == 2
    with pytest.raises(ValueError, match="num_workers"):
        make_dm(synthetic, num_workers="many")
    with pytest.raises(ValueError, match="num_workers"):
        make_dm(synthetic, num_workers=-1)


def test_collate_stacks_hwc_items_into_a_channels_last_batch(synthetic):
    dm = make_dm(synthetic)
    dm.setup("fit")
    items = [dm.train_dataset[i] for i in range(3)]
    images, targets, _, _ = collate_fn(items)
    assert images.shape == (3, 3, IMGSZ, IMGSZ)
    assert images.is_contiguous(memory_format=torch.channels_last)  # no transposing copy on the way
    assert torch.equal(images, torch.stack([im.contiguous() for im, *_ in items]))  # same pixels as a plain stack
    assert torch.equal(targets[:, 0].unique(), torch.arange(3, dtype=targets.dtype))
    for channels_last in (True, False):  # either memory format comes out of on_after_batch_transfer, same values
        dm.channels_last = channels_last
        out = dm.on_after_batch_transfer((images, targets, (), ()), 0)[0]
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert out.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(out, images.float() / 255)


def test_labels_are_scanned_once_per_split(synthetic, monkeypatch):
    import yolo5l.data.datamodule as dm_module

    calls = []
    real = dm_module.scan_labels
    monkeypatch.setattr(dm_module, "scan_labels", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    dm = make_dm(synthetic)
    dm.prepare_data()
    dm.setup("fit")
    dm.setup("validate")
    assert sorted(calls) == ["train", "val"]
    assert len(dm.train_dataset) > 0
    assert len(dm.val_dataset) > 0


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_validation_set_gives_every_rank_a_batch_and_counts_each_image_once(synthetic, monkeypatch, world):
    # 10 validation images, total validation batch 32: the per-rank batch shrinks to the rank's share of the images,
    # so no rank's loader is empty (Lightning refuses a zero-length loader on one rank) and no image is evaluated
    # twice (no padding, so the mAP counts each image once).
    shards = []
    for rank in range(world):
        dm = make_dm(synthetic, val_batch_size=32)
        monkeypatch.setattr(dm, "_dist", lambda rank=rank: (rank, world))
        dm.setup("validate")
        assert len(dm.val_dataloader()) >= 1
        shards.append(dm.val_sampler.indices.tolist())
    assert sorted(i for shard in shards for i in shard) == list(range(10))


def test_the_default_validation_batch_follows_a_searched_batch(synthetic):
    """`data.batch_size=-1`: the search sets the batch after the data module is made; the validation batch, unless
    typed, is twice the batch found (not twice -1)."""
    dm = make_dm(synthetic, batch_size=-1)
    dm.batch_size = 8  # what train.py's batch search writes
    assert dm.rank_val_batch_size(1000) == 16
    assert make_dm(synthetic, batch_size=-1, val_batch_size=6).rank_val_batch_size(1000) == 6


def test_validation_alone_scans_only_its_split(synthetic):
    """`python -m yolo5l.val task=test` validates one split: the training split's labels are not scanned (its corrupt
    images are not reported by a validation that never reads them); a fit scans both."""
    dm = make_dm(synthetic)
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="validate"), strategy=None)
    dm.prepare_data()
    assert set(dm._indices) == {"val"}
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), strategy=None)
    dm.prepare_data()
    assert set(dm._indices) == {"train", "val"}


def test_training_needs_a_label_file_for_one_image_at_least_validation_does_not(synthetic, tmp_path, capsys):
    """A dataset without its labels folder: v7.0 refuses to train ("No labels found"), naming where the labels were
    looked for; backgrounds (some images without a label file) are fine, and the summary counts them. Validating an
    unlabeled split goes on, its summary saying so."""
    root = tmp_path / "mine"
    shutil.copytree(make_dm(synthetic).spec.root, root)  # generated first if need be
    labels = root / "labels"
    dm = make_dm(synthetic, file=str(root / "data.yaml"))
    shutil.rmtree(labels)
    with pytest.raises(DatasetError) as e:
        dm.setup("fit")
    assert str(e.value) == (
        f"train: no label file for any of its 24 images, and training needs labels: looked for them in "
        f"{labels / 'train'}{os.sep} (e.g. train_000000.txt for train_000000.jpg). Put one <image stem>.txt per image "
        f"there, in YOLO format (a 'class cx cy w h' line per object, normalised to [0, 1]); an image without objects "
        f"gets an empty file or none."
    )
    dm.setup("validate")
    assert "val: 10 images, 10 backgrounds (10 without a label file); " in capsys.readouterr().out

    (labels / "train").mkdir(parents=True)
    shutil.copy(Path(synthetic["root"]) / "labels" / "train" / "train_000005.txt", labels / "train")
    dm = make_dm(synthetic, file=str(root / "data.yaml"))
    dm.setup("fit")
    assert "train: 24 images, 23 backgrounds (23 without a label file); " in capsys.readouterr().out
