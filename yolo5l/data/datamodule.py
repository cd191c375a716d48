"""``YOLODataModule``: datasets, sharded samplers and dataloaders that keep the accelerator fed.

- Each rank reads (and caches) a fixed shard of the training images and reshuffles it every epoch
  (:class:`ShardSampler`, YOLOv5 PR #10383's scheme), so the RAM cache is 1/world of the dataset per rank.
  Lightning 2.6 calls ``set_epoch`` on any ``dataloader.sampler`` that has one (``_set_sampler_epoch`` in the
  fit loop, before the epoch's ``iter``), so the epoch reaches the sampler without extra hooks; the Trainer
  must run with ``use_distributed_sampler=False`` so Lightning keeps these samplers.
- Validation ranks get contiguous runs of whole rectangular batches (:class:`ValShardSampler`): no image
  is read twice, and the metric syncs across ranks.
- close_mosaic and the augmentation's random key travel with the sampled indices
  ``(index, mosaic_allowed, (seed, epoch, rank))``: the sampler runs in the main process and knows the epoch, so
  persistent workers (which hold their own dataset copies) follow it, and every sample's augmentation is a pure
  function of (seed, epoch, rank, index): the same for any ``num_workers`` and after a resume in a new process.
- Images travel as uint8 and become float in [0, 1] on the device (``on_after_batch_transfer``).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler, get_worker_info

from yolo5l.data.dataset import YOLODataset, collate_fn
from yolo5l.data.dataset_yaml import DatasetSpec, load_dataset_file
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.synthetic import ensure_synthetic
from yolo5l.hardware import loader_workers


# --------------------------------------------------------------------------------------------- samplers
class ShardSampler(Sampler[tuple[int, bool, tuple[int, int, int]]]):
    """Training sampler: a fixed shard of the indices per rank, shuffled within the shard every epoch.

    The dataset is permuted once with ``seed`` and padded (wrapping around) to a multiple of ``world_size`` so
    all ranks run the same number of batches; rank r takes every world_size-th element from r. Each epoch
    the shard is shuffled with ``(seed, epoch, rank)``. Items are ``(index, mosaic_allowed, (seed, epoch, rank))``
    where ``mosaic_allowed`` is False from epoch ``mosaic_off_from`` on (close_mosaic) and the last element is the
    key from which the dataset seeds the sample's augmentation (with the index appended).

    Args:
        num_samples: Dataset length.
        rank: This process's rank.
        world_size: Number of ranks.
        seed: Seed of the shard split and of the per-epoch shuffles.
        shuffle: Shuffle within the shard each epoch.
        mosaic_off_from: First epoch without mosaic; None keeps mosaic on.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        mosaic_off_from: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if num_samples < 1:
            raise ValueError("ShardSampler needs at least one sample")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.mosaic_off_from = mosaic_off_from
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, items of it already trained): see resume_at
        if world_size == 1:
            self.indices = np.arange(num_samples)
        else:
            perm = np.random.default_rng(seed).permutation(num_samples)
            total = math.ceil(num_samples / world_size) * world_size
            perm = np.resize(perm, total)  # wraps around: a few images repeat so every rank has equal length
            self.indices = np.sort(perm[rank::world_size])

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning's fit loop before each epoch."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None  # the resumed epoch is over (or the checkpoint was an epoch end's)

    def resume_at(self, epoch: int, items_done: int) -> None:
        """Leave out the first `items_done` items of epoch `epoch`, which a run resumed from a mid-epoch checkpoint
        has already trained on: the rest of that epoch comes in the same order with the same augmentation keys as in
        the interrupted run, and nothing twice. Later epochs are whole. `len()` is unchanged, so Lightning's count
        of the epoch's batches (which continues from the checkpoint) stays the same.
        """
        self._resume = (int(epoch), max(0, int(items_done)))

    @property
    def mosaic(self) -> bool:
        """Whether this epoch may use mosaic."""
        return self.mosaic_off_from is None or self.epoch < self.mosaic_off_from

    def __iter__(self) -> Iterator[tuple[int, bool, tuple[int, int, int]]]:
        order = self.indices
        key = (self.seed, self.epoch, self.rank)
        if self.shuffle:
            order = order[np.random.default_rng(key).permutation(len(order))]
        if self._resume is not None and self._resume[0] == self.epoch:
            order = order[self._resume[1] :]
        mosaic = self.mosaic
        return iter([(int(i), mosaic, key) for i in order])

    def __len__(self) -> int:
        return len(self.indices)


class ValShardSampler(Sampler[int]):
    """Validation sampler: rank r gets a contiguous run of whole batches of the (aspect-sorted) dataset.

    Runs start on batch boundaries so the rectangular batch shapes computed over the whole dataset stay
    valid; no index is repeated across ranks (so the synced metrics count each image once). Ranks may get
    a different number of batches (one batch apart at most).

    Args:
        num_samples: Dataset length.
        batch_size: Validation batch size (the one the rect shapes were computed with).
        rank: This process's rank.
        world_size: Number of ranks.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        nb = math.ceil(num_samples / batch_size)
        b0, b1 = rank * nb // world_size, (rank + 1) * nb // world_size
        self.indices = np.arange(b0 * batch_size, min(b1 * batch_size, num_samples))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return len(self.indices)


# --------------------------------------------------------------------------------------------- workers
def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: reseed ``random``, ``np.random`` and albumentations from torch's worker seed,
    restore the CPU affinity to every core, and keep OpenCV single-threaded.

    ``torch.initial_seed()`` in a worker is the loader's base seed (drawn from its generator) + worker id, so a
    seeded generator makes the augmentations reproducible. Some imports collapse the inherited affinity to one
    or two cores (PyTorch issue #101850), which would leave a worker's threads sharing them; resetting it lets
    each worker run on every core the process may use.
    """
    # Workers are forked while the training process's signal handlers are installed; a SIGTERM/SIGUSR1 sent to the
    # whole process group (SLURM, Kubernetes) is the main process's to handle (PreemptionCheckpoint). Workers end
    # with their parent.
    for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    info = get_worker_info()
    if info is not None and hasattr(info.dataset, "reseed"):
        info.dataset.reseed(seed)
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):  # a cgroup cpuset may forbid some cores: keep what we have
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
    cv2.setNumThreads(0)


# --------------------------------------------------------------------------------------------- datamodule
class YOLODataModule(LightningDataModule):
    """YOLO-format data (a dataset yaml, or the synthetic preset) for Lightning.

    Args:
        file: Ultralytics-style dataset yaml; None means the synthetic preset.
        synthetic: Keyword arguments of :func:`~yolo5l.data.synthetic.ensure_synthetic` (``root``, ``num_train``,
            ``num_val``, ``seed``) used when ``file`` is None.
        imgsz: Training image size (and validation long side); a multiple of 32.
        batch_size: Training batch over all devices, as YOLOv5's ``--batch-size``: each of the Trainer's
            ``world_size`` ranks loads ``batch_size / world_size`` images a step.
        num_workers: DataLoader worker processes per rank, or "auto" (``yolo5l.hardware.loader_workers``: on an
            accelerator min(8, CPU cores per local device) as YOLOv5; on the CPU 0, since there the compute threads
            use every core and worker processes would preempt them mid-operation).
        cache: Image cache: "none", "ram" or "disk".
        cache_dir: Disk cache folder (default beside the images, or a user cache dir if that is read-only).
        reduced_decode: Decode JPEGs at least twice ``imgsz`` at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling)
            before resizing them: ~2x faster on camera-sized photos; False decodes in full, as YOLOv5.
        persistent_workers: Keep workers between epochs (only when num_workers > 0).
        pin_memory: Pin host memory (only when the Trainer uses an accelerator).
        prefetch_factor: Batches prefetched per worker (only when num_workers > 0).
        hyp: The ``conf/hyp`` mapping (augmentation keys are read; defaults are scratch-low's).
        close_mosaic: Switch mosaic off for the last N epochs (needs ``trainer.max_epochs``).
        val_batch_size: Validation batch over all devices; default 2 x ``batch_size``. A rank's share is capped at
            its share of the validation images, so every rank gets at least one batch.
        val_num_workers: Validation loader workers per rank; None means the training loader's count on an
            accelerator and 0 on the CPU (an explicit ``num_workers`` on the CPU still gets 0 here: the validation
            batches are cheap, and workers forked at the first validation, after training grew the heap, compete
            with the compute and make the main process pay copy-on-write faults).
        seed: Seed of the shard split, the per-epoch shuffles and the workers' generator.
        channels_last: Return images in channels_last memory format from ``on_after_batch_transfer``.
    """

    def __init__(
        self,
        file: str | None = None,
        synthetic: Mapping[str, Any] | None = None,
        imgsz: int = 640,
        batch_size: int = 16,
        num_workers: int | str = "auto",
        cache: str = "none",
        cache_dir: str | None = None,
        reduced_decode: bool = True,
        persistent_workers: bool = True,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
        hyp: Mapping[str, Any] | None = None,
        close_mosaic: int = 0,
        val_batch_size: int | None = None,
        val_num_workers: int | None = None,
        seed: int = 0,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if cache not in ("none", "ram", "disk"):
            raise ValueError(f"data.cache must be none, ram or disk, got {cache!r}")
        if imgsz % 32:
            raise ValueError(f"data.imgsz={imgsz} must be a multiple of 32 (the model's largest stride)")
        self.file = file
        self.synthetic = dict(synthetic) if synthetic is not None else {}
        self.imgsz = int(imgsz)
        self.batch_size = int(batch_size)
        if num_workers != "auto" and not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"data.num_workers must be a count >= 0 or 'auto', got {num_workers!r}")
        self.num_workers: int | str = num_workers
        self.cache = cache
        self.cache_dir = cache_dir
        self.reduced_decode = bool(reduced_decode)
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.hyp = dict(hyp) if hyp is not None else None
        self.close_mosaic = int(close_mosaic)
        self.val_batch_size = int(val_batch_size) if val_batch_size else 2 * self.batch_size
        self.val_num_workers = None if val_num_workers is None else int(val_num_workers)
        self.seed = int(seed)
        self.channels_last = channels_last
        self._spec: DatasetSpec | None = None
        self._indices: dict[str, Any] = {}  # split -> label index: scanned once per process
        self.train_dataset: YOLODataset | None = None
        self.val_dataset: YOLODataset | None = None
        self.train_sampler: ShardSampler | None = None
        self.val_sampler: ValShardSampler | None = None
        self._train_resume: tuple[int, int] | None = None  # (epoch, batches done) from a checkpoint, see state_dict
        self._printed: set[str] = set()

    # ----------------------------------------------------------------------------------------- dataset file
    @property
    def spec(self) -> DatasetSpec:
        """The resolved dataset (generating the synthetic one first if needed)."""
        if self._spec is None:
            path = ensure_synthetic(**self.synthetic) if self.file is None else Path(self.file)
            self._spec = load_dataset_file(path)
        return self._spec

    @property
    def names(self) -> list[str]:
        """Class names."""
        return list(self.spec.names)

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return self.spec.num_classes

    def _scan(self, split: str):
        # prepare_data (local rank 0) and setup both need the index: one scan or cache check per process, which on a
        # large dataset means one pass of stat() calls over its files instead of two.
        if split not in self._indices:
            spec = self.spec
            self._indices[split] = scan_labels(spec.files(split), spec.num_classes, spec.cache_path(split), split)
        return self._indices[split]

    def _dist(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _print(self, key: str, line: str) -> None:
        if key not in self._printed and self._dist()[0] == 0:
            self._printed.add(key)
            print(line, flush=True)

    # ----------------------------------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Generate the synthetic dataset if needed and build the label caches (local rank 0)."""
        self._scan("train")
        self._scan("val")

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage`` and fill this rank's image cache."""
        rank, world = self._dist()
        if stage in (None, "fit") and self.train_dataset is None:
            index = self._scan("train")
            ds = YOLODataset(
                index, self.imgsz, augment=True, hyp=self.hyp, batch_size=self.rank_batch_size, cache=self.cache,
                cache_dir=self.cache_dir, reduced_decode=self.reduced_decode, prefix="train: ",
            )  # fmt: skip
            self.train_sampler = ShardSampler(len(ds), rank, world, seed=self.seed)
            ds.set_indices(self.train_sampler.indices)
            cache_line = ds.fill_cache()
            self.train_dataset = ds
            shard = f", rank shard {len(self.train_sampler)}/{len(ds)}" if world > 1 else ""
            self._print("train", f"{index.report.summary('train')}{shard}; {cache_line.removeprefix(ds.prefix)}")
        if stage in (None, "fit", "validate") and self.val_dataset is None:
            index = self._scan("val")
            val_batch = self.rank_val_batch_size(len(index.im_files))
            ds = YOLODataset(
                index, self.imgsz, augment=False, hyp=self.hyp, batch_size=val_batch, cache=self.cache,
                cache_dir=self.cache_dir, reduced_decode=self.reduced_decode, prefix="val: ",
            )  # fmt: skip
            self.val_sampler = ValShardSampler(len(ds), val_batch, rank, world)
            ds.set_indices(self.val_sampler.indices)
            cache_line = ds.fill_cache()
            self.val_dataset = ds
            shard = f", rank shard {len(self.val_sampler)}/{len(ds)}" if world > 1 else ""
            self._print("val", f"{index.report.summary('val')}{shard}; {cache_line.removeprefix(ds.prefix)}")

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The training position inside the epoch (Lightning keeps it in every checkpoint), so that a run resumed
        from a mid-epoch checkpoint (a preempted run's `last.ckpt`) trains on the rest of that epoch's batches only.

        Returns:
            ``{"train_epoch", "train_batches_done"}``: the sampler's epoch and the batches of it whose training step
            ran (all of them at an epoch end, where the next epoch starts whole); empty outside fit.
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None or self.train_sampler is None or getattr(trainer, "fit_loop", None) is None:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # counted before on_train_batch_end
        return {"train_epoch": int(self.train_sampler.epoch), "train_batches_done": int(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the position `state_dict` saved; the training loader applies it to the sampler (Lightning restores the
        datamodule after `setup` and before it asks for the loader)."""
        if "train_epoch" in state_dict:
            self._train_resume = (int(state_dict["train_epoch"]), int(state_dict.get("train_batches_done", 0)))

    # ----------------------------------------------------------------------------------------- loaders
    @property
    def rank_batch_size(self) -> int:
        """The training batch one rank loads: ``batch_size / world_size`` (the config checks it divides)."""
        return max(1, self.batch_size // self._dist()[1])

    def rank_val_batch_size(self, num_images: int) -> int:
        """The validation batch one rank loads: its share of ``val_batch_size``, at most its share of the images
        (a larger batch would leave a rank of a small validation set without any batch)."""
        world = self._dist()[1]
        return max(1, min(self.val_batch_size // world, num_images // world))

    def _uses_accelerator(self) -> bool:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return torch.cuda.is_available()
        return trainer.strategy.root_device.type != "cpu"

    def train_workers(self) -> int:
        """The training loader's worker count (``num_workers`` resolved, see the class docstring)."""
        trainer = getattr(self, "trainer", None)
        local_devices = max(1, int(getattr(trainer, "num_devices", 1) or 1)) if trainer is not None else 1
        return loader_workers(self.num_workers, self._uses_accelerator(), local_devices)

    def _val_workers(self) -> int:
        if self.val_num_workers is not None:
            return self.val_num_workers
        return self.train_workers() if self._uses_accelerator() else 0

    def _loader(self, dataset: YOLODataset, sampler: Sampler, batch_size: int, rank: int, workers: int) -> DataLoader:
        extra: dict[str, Any] = {}
        if workers > 0:
            extra = {
                "persistent_workers": self.persistent_workers,
                "prefetch_factor": self.prefetch_factor,
                "worker_init_fn": seed_worker,
            }
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            collate_fn=collate_fn,
            pin_memory=bool(self.pin_memory and self._uses_accelerator()),
            generator=torch.Generator().manual_seed(self.seed + rank),
            drop_last=False,
            **extra,
        )

    def _mosaic_off_from(self) -> int | None:
        if self.close_mosaic <= 0:
            return None
        trainer = getattr(self, "trainer", None)
        max_epochs = getattr(trainer, "max_epochs", None) if trainer is not None else None
        if max_epochs is None or max_epochs < 0:
            return None
        return max(0, max_epochs - self.close_mosaic)

    def train_dataloader(self) -> DataLoader:
        """Training loader: sharded, reshuffled each epoch, mosaic switched off for the last close_mosaic epochs."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        assert self.train_sampler is not None
        self.train_sampler.mosaic_off_from = self._mosaic_off_from()
        trainer = getattr(self, "trainer", None)
        if trainer is not None and getattr(trainer, "fit_loop", None) is not None:
            # Lightning 2.6's fit loop creates the loader's iterator (FitLoop.setup_data) *before* it calls set_epoch
            # for the first epoch of a fit, and worker processes prefetch from that iterator at once: a run resumed
            # at epoch N would replay epoch 0's order and augmentation keys. Set the epoch the loop is about to run.
            self.train_sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        if self._train_resume is not None:
            # A mid-epoch checkpoint: skip the batches trained before it, as this rank loaded them (the same
            # batches when resumed on as many devices; on another count, as many batches of the new shard).
            epoch, batches = self._train_resume
            self._train_resume = None
            self.train_sampler.resume_at(epoch, batches * self.rank_batch_size)
        rank = self._dist()[0]
        return self._loader(self.train_dataset, self.train_sampler, self.rank_batch_size, rank, self.train_workers())

    def val_dataloader(self) -> DataLoader:
        """Validation loader: rectangular batches, this rank's contiguous run of them."""
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        assert self.val_sampler is not None
        return self._loader(
            self.val_dataset, self.val_sampler, self.val_dataset.batch_size, self._dist()[0], self._val_workers()
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 (B, 3, H, W) -> float32 in [0, 1] on the device (optionally channels_last)."""
        images, targets, paths, shapes = batch
        images = images.float().div_(255)  # keeps the batch's memory format (channels_last from collate_fn)
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        images = images.contiguous(memory_format=memory_format)  # a no-op when it already is
        return images, targets, paths, shapes
