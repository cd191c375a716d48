"""``YOLODataModule``: datasets, sharded samplers and dataloaders that keep the accelerator fed.

- Each rank reads (and caches) a fixed shard of the training images and reshuffles it every epoch
  (:class:`~yolo5l.data.samplers.ShardSampler`), so the RAM cache is 1/world of the dataset per rank; validation
  ranks get contiguous runs of whole rectangular batches (:class:`~yolo5l.data.samplers.ValShardSampler`).
- close_mosaic and the augmentation's random key travel with the sampled indices
  ``(index, mosaic_allowed, (seed, epoch, rank))``: the sampler runs in the main process and knows the epoch, so
  persistent workers (which hold their own dataset copies) follow it, and every sample's augmentation is a pure
  function of (seed, epoch, rank, index): the same for any ``num_workers`` and after a resume in a new process.
- Images travel as uint8 and become float in [0, 1] on the device (``on_after_batch_transfer``), where training
  batches are also grouped by four (``quad``) and resized (``multi_scale``): :mod:`yolo5l.data.batch_transforms`.
- ``pipeline``: where training pixels are made: by the workers (``host``), or on the device from the bytes and
  draws the workers send (``device``, :mod:`yolo5l.data.plan`, :mod:`yolo5l.data.device_input`).
- v7.0 ``train.py``'s data options: ``single_cls``, ``rect``, ``image_weights`` (:mod:`yolo5l.data.image_weights`),
  ``multi_scale``, ``quad``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Sampler, get_worker_info

from yolo5l.base.hardware import loader_workers
from yolo5l.base.image_size import check_image_size
from yolo5l.data.batch_transforms import TrainBatchTransform
from yolo5l.data.cache import CACHE_MODES
from yolo5l.data.dataset import YOLODataset, collate_fn
from yolo5l.data.dataset_yaml import ALL_SPLITS, DatasetSpec, load_dataset_file
from yolo5l.data.device_input import DeviceCache, DeviceInput, DeviceInputLoader, plan_on_device
from yolo5l.data.image_weights import ImageWeights
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.plan import PIPELINES, choose_input, collate_plans, input_notes
from yolo5l.data.samplers import ShardSampler, ValShardSampler, rect_shard
from yolo5l.data.synthetic import ensure_synthetic

__all__ = ["ShardSampler", "ValShardSampler", "YOLODataModule", "seed_worker"]


# --------------------------------------------------------------------------------------------- workers
def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: reseed ``random``, ``np.random`` and albumentations from torch's worker seed,
    restore the CPU affinity to every core, and keep OpenCV single-threaded.

    ``torch.initial_seed()`` in a worker is the loader's base seed (drawn from its generator) + worker id, so a
    seeded generator makes the augmentations reproducible. Some imports collapse the inherited affinity to one
    or two cores (PyTorch issue #101850), which would leave a worker's threads sharing them; resetting it lets
    each worker run on every core the process may use.
    """
    info = get_worker_info()
    if info is not None:
        # A SIGTERM/SIGUSR1/SIGINT sent to the whole process group (SLURM, Kubernetes, Ctrl-C) is the main process's
        # (PreemptionCheckpoint); workers end with their parent. Never in the main process: SIG_IGN survives exec.
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)):
            if sig is not None:
                signal.signal(sig, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
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
        num_workers: DataLoader worker processes per rank, or "auto" (``yolo5l.base.hardware.loader_workers``: on an
            accelerator the CPU cores per local device less one; on the CPU 0, since there the compute threads use
            every core and worker processes would preempt them mid-operation).
        cache: Image cache: "none", "ram", "disk", or "device" (:class:`~yolo5l.data.device_input.DeviceCache`:
            "none" when it does not fit, "ram" with the host pipeline; validation caches in RAM then).
        cache_dir: Disk cache folder (default beside the images, or a user cache dir if that is read-only).
        reduced_decode: Decode the training images' JPEGs at least twice ``imgsz`` at 1/2, 1/4 or 1/8 scale
            (libjpeg's DCT scaling) before resizing them: ~2x faster on camera-sized photos; False decodes in full.
        val_reduced_decode: The same for the validation images. Default False: decoded in full and shrunk with
            INTER_AREA, as v7.0's val.py, whose mAP the reduced decode moves (by up to ~0.007 at 128 px).
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
        single_cls: Train (and validate) every class as class 0, named "item" unless the dataset has one class
            (v7.0 ``--single-cls``).
        rect: Rectangular training batches (v7.0 ``--rect``): images sorted by aspect ratio, each batch letterboxed
            to its own shape (no padding beyond the stride), in order, without mosaic.
        image_weights: Draw each epoch's images by weight (v7.0 ``--image-weights``): rare classes and classes with
            a low mAP at the last validation are drawn more often (:mod:`yolo5l.data.image_weights`).
        multi_scale: Resize each training batch to a size drawn in [0.5, 1.5] x ``imgsz`` (v7.0 ``--multi-scale``).
        quad: Group each training batch's images by four into images of twice the size (v7.0 ``--quad``).
        val_split: The split validation reads: "val", or "test" / "train" (`python -m yolo5l.val task=test`).
        pipeline: "auto", "host" or "device": where training samples' pixels are made (see the module docstring);
            "auto" is "device" on CUDA (and "host" with ``rect``, whose samples the host makes).
        device_cache_reserve_gb: With ``cache="device"``, GPU memory (GB) left free for training beside the cache.
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
        val_reduced_decode: bool = False,
        persistent_workers: bool = True,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
        hyp: Mapping[str, Any] | None = None,
        close_mosaic: int = 0,
        val_batch_size: int | None = None,
        val_num_workers: int | None = None,
        seed: int = 0,
        channels_last: bool = False,
        single_cls: bool = False,
        rect: bool = False,
        image_weights: bool = False,
        multi_scale: bool = False,
        quad: bool = False,
        val_split: str = "val",
        pipeline: str = "auto",
        device_cache_reserve_gb: float = 16.0,
    ) -> None:
        super().__init__()
        if val_split not in ALL_SPLITS:
            raise ValueError(f"val_split must be one of {ALL_SPLITS}, got {val_split!r}")
        self.val_split = val_split
        if cache not in CACHE_MODES:
            raise ValueError(f"data.cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
        if pipeline not in PIPELINES:
            raise ValueError(f"data.pipeline must be one of {', '.join(PIPELINES)}, got {pipeline!r}")
        check_image_size(imgsz)
        if rect and image_weights:
            raise ValueError("data.rect and data.image_weights exclude each other (v7.0 drops rect then)")
        self.file = file
        self.synthetic = dict(synthetic) if synthetic is not None else {}
        self.imgsz = int(imgsz)
        self.stride = 32  # the model's largest stride (the entry points set it: 64 for P6); rectangular batches use it
        self.batch_size = int(batch_size)
        if num_workers != "auto" and not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"data.num_workers must be a count >= 0 or 'auto', got {num_workers!r}")
        self.num_workers: int | str = num_workers
        self.cache, self.pipeline, self.cache_dir = cache, pipeline, cache_dir
        self.device_cache_reserve = int(float(device_cache_reserve_gb) * 2**30)
        self.device_cache: DeviceCache | None = None
        self.input_pipeline, self.cache_used, self.input_reason, self.cache_reason = "host", cache, "", ""  # setup
        self.reduced_decode, self.val_reduced_decode = bool(reduced_decode), bool(val_reduced_decode)
        self.persistent_workers, self.pin_memory, self.prefetch_factor = persistent_workers, pin_memory, prefetch_factor
        self.hyp = dict(hyp) if hyp is not None else None
        self.close_mosaic = int(close_mosaic)
        self.val_batch_size = int(val_batch_size) if val_batch_size else None  # None: 2 x batch_size, once searched
        self.val_num_workers = None if val_num_workers is None else int(val_num_workers)
        self.seed = int(seed)
        self.channels_last = channels_last
        self.single_cls, self.rect, self.image_weights = bool(single_cls), bool(rect), bool(image_weights)
        self.batch_transform = TrainBatchTransform(self.imgsz, quad=quad, multi_scale=multi_scale, seed=self.seed)
        self._image_weights: ImageWeights | None = None
        self._maps_seen: object = None  # the module's last class_maps array taken (see _take_class_maps)
        self._grid: int | None = None  # multi_scale's grid: the model's largest stride, at least 32
        self._spec: DatasetSpec | None = None
        self._indices: dict[str, Any] = {}  # split -> label index: scanned once per process
        self.train_dataset: YOLODataset | None = None
        self.val_dataset: YOLODataset | None = None
        self.train_sampler: ShardSampler | None = None
        self.val_sampler: ValShardSampler | None = None
        self._train_resume: tuple[int, int] | None = None  # (epoch, batches done) from a checkpoint, see state_dict
        self.printed: set[str] = set()  # the summary lines setup printed, by key: each once; "*" silences all

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
        """Class names (``single_cls``: v7.0's ``["item"]``, or the dataset's one name)."""
        names = list(self.spec.names)
        return ["item"] if self.single_cls and len(names) != 1 else names

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return 1 if self.single_cls else self.spec.num_classes

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
        if self.printed.isdisjoint((key, "*")) and self._dist()[0] == 0:
            self.printed.add(key)
            print(line, flush=True)

    # ----------------------------------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Generate the synthetic dataset if needed and build the label caches (local rank 0): the training split's
        only when fitting (a validation of the test split says nothing of the training images)."""
        if getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", "fit") == "fit":
            self._scan("train")
        self._scan(self.val_split)

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets of ``stage`` and fill this rank's image cache."""
        rank, world = self._dist()
        if stage in (None, "fit") and self.train_dataset is None:
            index = self._scan("train").require_labels("train")  # v7.0 refuses to train on no label file at all
            self._resolve_input()
            host_cache = "none" if self.cache_used == "device" else self.cache_used  # workers send device indices
            ds = YOLODataset(
                index, self.imgsz, augment=True, hyp=self.hyp, rect=self.rect, batch_size=self.rank_batch_size,
                cache=host_cache, cache_dir=self.cache_dir, reduced_decode=self.reduced_decode, pad=0.0,
                prefix="train: ", single_cls=self.single_cls, stride=self.stride,
            )  # fmt: skip
            # rect: whole batches of the aspect-sorted images, in order (v7.0 turns the shuffle off for --rect)
            order = rect_shard(len(ds), self.rank_batch_size, rank, world) if self.rect else None
            self.train_sampler = ShardSampler(
                len(ds), rank, world, seed=self.seed, shuffle=not self.rect, indices=order
            )
            if self.image_weights:
                self._image_weights = ImageWeights(ds.labels, self.num_classes)
                self.train_sampler.set_image_weights(self._epoch_image_weights)
            ds.set_indices(self.train_sampler.indices)
            cache_line = self._fill_train_cache(ds)
            self.train_dataset = ds
            shard = f", rank shard {len(self.train_sampler)}/{len(ds)}" if world > 1 else ""
            self._print("train", f"{index.report.summary('train')}{shard}; {cache_line.removeprefix(ds.prefix)}")
        if stage in (None, "fit", "validate") and self.val_dataset is None:
            index = self._scan(self.val_split)
            val_batch = self.rank_val_batch_size(len(index.im_files))
            ds = YOLODataset(
                index, self.imgsz, augment=False, hyp=self.hyp, batch_size=val_batch,
                cache="ram" if self.cache == "device" else self.cache,
                cache_dir=self.cache_dir, reduced_decode=self.val_reduced_decode, prefix=f"{self.val_split}: ",
                single_cls=self.single_cls, stride=self.stride,
            )  # fmt: skip
            self.val_sampler = ValShardSampler(len(ds), val_batch, rank, world)
            ds.set_indices(self.val_sampler.indices)
            cache_line = ds.fill_cache()
            self.val_dataset = ds
            shard = f", rank shard {len(self.val_sampler)}/{len(ds)}" if world > 1 else ""
            self._print("val", f"{index.report.summary(self.val_split)}{shard}; {cache_line.removeprefix(ds.prefix)}")

    # ----------------------------------------------------------------------------------------- input pipeline
    def train_device(self) -> torch.device:
        """The device training runs on (its rank's), as far as it is known yet."""
        strategy = getattr(getattr(self, "trainer", None), "strategy", None)
        if strategy is not None:
            return strategy.root_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def resolve_input(self, device: torch.device) -> tuple[str, str, str]:
        """``(pipeline, cache, why)``: the training pipeline and cache a run on ``device`` uses, and why the pipeline
        is what it is ("" when set as typed; `choose_input`). The device cache may still fall back when it does not
        fit."""
        return choose_input(self.pipeline, self.cache, self.rect, device)

    def _resolve_input(self) -> None:
        device = self.train_device()
        self.input_pipeline, self.cache_used, self.input_reason = self.resolve_input(device)
        for key, line in input_notes(self.cache, self.input_pipeline, self.cache_used, device):
            self._print(key, line)

    def _fill_train_cache(self, ds: YOLODataset) -> str:
        """Fill the training images' cache and, for the device pipeline, set what the workers send; the summary.
        `cache_used` is then the cache in use: "none" when the images did not fit, and `cache_reason` says why."""
        asked = self.cache_used
        if self.input_pipeline == "host":
            line, self.cache_used = ds.fill_cache(), ds.cache.mode  # the mode once filled: "none" if it did not fit
        else:
            planned = plan_on_device(ds, asked, self.train_device(), self.device_cache_reserve)
            line, self.device_cache, self.cache_used = planned
        if self.cache_used == "none" != asked:
            self.cache_reason = line.removeprefix(ds.prefix).split("; ")[0]  # the summary line says why
        return line

    def device_wait_seconds(self) -> float:
        """Seconds the training step waited on the device for the device pipeline's images since the last call."""
        wait = getattr(getattr(getattr(self, "trainer", None), "train_dataloader", None), "device_wait_seconds", None)
        return wait() if callable(wait) else 0.0

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The training position inside the epoch (Lightning keeps it in every checkpoint), so that a run resumed
        from a mid-epoch checkpoint (a preempted run's `last.ckpt`) trains on the rest of that epoch's batches only.

        Returns:
            ``{"train_epoch", "train_batches_done"}``: the sampler's epoch and the batches of it whose training step
            ran (all of them at an epoch end, where the next epoch starts whole); empty outside fit. With
            ``image_weights`` also ``"image_weights_maps"``: the per-class mAPs the next epoch draws with.
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None or self.train_sampler is None or getattr(trainer, "fit_loop", None) is None:
            return {}
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # counted before on_train_batch_end
        state: dict[str, Any] = {"train_epoch": int(self.train_sampler.epoch), "train_batches_done": int(done)}
        if self._image_weights is not None:
            self._take_class_maps()
            state.update(self._image_weights.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the position `state_dict` saved; the training loader applies it to the sampler (Lightning restores the
        datamodule after `setup` and before it asks for the loader)."""
        if "train_epoch" in state_dict:
            self._train_resume = (int(state_dict["train_epoch"]), int(state_dict.get("train_batches_done", 0)))
        if self._image_weights is not None:
            self._image_weights.load_state_dict(state_dict)

    # ----------------------------------------------------------------------------------------- image weights
    def _take_class_maps(self) -> None:
        """Take the per-class mAPs of the module's latest validation in fit (`YOLOv5Module.class_maps`), if newer."""
        maps = getattr(getattr(getattr(self, "trainer", None), "lightning_module", None), "class_maps", None)
        if maps is not None and maps is not self._maps_seen and self._image_weights is not None:
            self._maps_seen = maps
            self._image_weights.update_maps(maps)

    def _epoch_image_weights(self) -> np.ndarray:
        """Every training image's weight for the epoch starting now (the sampler asks when its iterator is made)."""
        assert self._image_weights is not None
        self._take_class_maps()
        return self._image_weights()

    # ----------------------------------------------------------------------------------------- loaders
    @property
    def rank_batch_size(self) -> int:
        """The training batch one rank loads: ``batch_size / world_size`` (the config checks it divides)."""
        return max(1, self.batch_size // self._dist()[1])

    def rank_val_batch_size(self, num_images: int) -> int:
        """The validation batch one rank loads: its share of ``val_batch_size``, at most its share of the images
        (a larger batch would leave a rank of a small validation set without any batch)."""
        world = self._dist()[1]
        return max(1, min((self.val_batch_size or 2 * self.batch_size) // world, num_images // world))

    def _uses_accelerator(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return torch.cuda.is_available() if trainer is None else trainer.strategy.root_device.type != "cpu"

    def train_workers(self) -> int:
        """The training loader's worker count (``num_workers`` resolved, see the class docstring)."""
        local_devices = max(1, int(getattr(getattr(self, "trainer", None), "num_devices", 1) or 1))
        return loader_workers(self.num_workers, self._uses_accelerator(), local_devices)

    def _val_workers(self) -> int:
        if self.val_num_workers is not None:
            return self.val_num_workers
        return self.train_workers() if self._uses_accelerator() else 0

    def _loader(
        self, dataset: YOLODataset, sampler: Sampler, batch_size: int, rank: int, workers: int, device: bool = False
    ) -> DataLoader:
        extra: dict[str, Any] = {}
        if workers > 0:
            extra = {
                "persistent_workers": self.persistent_workers,
                "prefetch_factor": self.prefetch_factor,
                "worker_init_fn": seed_worker,
            }
        if device:
            extra["device_input"] = DeviceInput(self.train_device(), self.device_cache)
        return (DeviceInputLoader if device else DataLoader)(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            collate_fn=collate_plans if device else collate_fn,
            pin_memory=bool(self.pin_memory and self._uses_accelerator()),
            generator=torch.Generator().manual_seed(self.seed + rank),
            drop_last=False,
            **extra,
        )

    def _mosaic_off_from(self) -> int | None:
        if self.close_mosaic <= 0:
            return None
        max_epochs = getattr(getattr(self, "trainer", None), "max_epochs", None)
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
        device = self.train_dataset.tile_reader is not None
        return self._loader(
            self.train_dataset, self.train_sampler, self.rank_batch_size, rank, self.train_workers(), device
        )

    def val_dataloader(self) -> DataLoader:
        """Validation loader: rectangular batches, this rank's contiguous run of them."""
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        assert self.val_sampler is not None
        return self._loader(
            self.val_dataset, self.val_sampler, self.val_dataset.batch_size, self._dist()[0], self._val_workers()
        )

    def _training_batch(self) -> tuple[int, int] | None:
        """(epoch, batch index) of the training batch being moved to the device, None for any other batch."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or not trainer.training or not self.batch_transform.active:
            return None
        # Lightning moves the batch before it counts it ready: its index is the loop's batch_idx + 1, which a resumed
        # loop restores (so the draws keyed by it repeat the interrupted run's).
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx + 1

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Training batches with ``quad``: targets, paths and shapes of the grouped images (on the host)."""
        at = self._training_batch()
        return batch if at is None else self.batch_transform.before_transfer(batch, *at, self._dist()[0])

    def _grid_size(self) -> int:
        if self._grid is None:
            stride = getattr(getattr(getattr(self.trainer, "lightning_module", None), "model", None), "stride", None)
            # once per run: a read of the model's (nl,) stride buffer, which may sit on the device
            self._grid = max(int(stride.max()), 32) if isinstance(stride, torch.Tensor) else 32
        return self._grid

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 (B, 3, H, W) -> float32 in [0, 1] on the device (optionally channels_last); training batches grouped
        by four (``quad``) and resized (``multi_scale``) there."""
        images, targets, paths, shapes = batch
        at = self._training_batch()
        if at is None:
            images = images.float().div_(255)  # keeps the batch's memory format (channels_last from collate_fn)
        else:
            images = self.batch_transform.after_transfer(images, *at, self._grid_size())
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        images = images.contiguous(memory_format=memory_format)  # a no-op when it already is
        return images, targets, paths, shapes
