"""The training and validation samplers of ``YOLODataModule``: fixed shards per rank, chosen in the main process.

- :class:`ShardSampler` (training): each rank reads (and caches) a fixed shard of the images and reshuffles it every
  epoch (YOLOv5 PR #10383's scheme), so the RAM cache is 1/world of the dataset per rank. With ``data.rect`` the shard
  is whole rectangular batches in order (:func:`rect_shard`); with ``data.image_weights`` each epoch draws its images
  from the shard with replacement, by weight (:meth:`ShardSampler.set_image_weights`).
- :class:`ValShardSampler` (validation): contiguous runs of whole rectangular batches, no image twice.

Lightning 2.6 calls ``set_epoch`` on any ``dataloader.sampler`` that has one (``_set_sampler_epoch`` in the fit loop,
before the epoch's ``iter``); the Trainer must run with ``use_distributed_sampler=False`` so Lightning keeps these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

__all__ = ["MOSAIC_PARTNERS", "ShardSampler", "ValShardSampler", "rect_shard"]

#: Partners an image-weighted item carries: 3 for its mosaic and 3 for the mosaic a mixup adds (v7.0 draws both
#: mosaics' partners from the weighted indices, `LoadImagesAndLabels.load_mosaic`).
MOSAIC_PARTNERS = 6
_WEIGHTED_STREAM = 1  # appended to (seed, epoch, rank): the weighted draw's generator differs from the shuffle's


def rect_shard(num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """The indices rank ``rank`` trains on with rectangular batches: whole batches of ``batch_size`` consecutive
    (aspect-sorted) images, batch b to rank b % world_size, in order.

    Every rank gets ``ceil(nb / world_size)`` batches (a few wrap around to batch 0 on), and the one short batch (the
    dataset's last) is the last of its rank's, so a DataLoader with this ``batch_size`` never mixes two batch shapes.
    On one device this is v7.0's ``--rect`` order: 0, 1, ..., n - 1.
    """
    nb = math.ceil(num_samples / batch_size)
    slots = np.arange(rank, math.ceil(nb / world_size) * world_size, world_size) % nb
    return np.concatenate([np.arange(b * batch_size, min((b + 1) * batch_size, num_samples)) for b in slots])


class ShardSampler(Sampler[tuple[Any, ...]]):
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
        indices: This rank's indices in their order (e.g. :func:`rect_shard`'s) instead of the seeded split.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        mosaic_off_from: int | None = None,
        indices: np.ndarray | None = None,
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
        self._image_weights: Callable[[], np.ndarray] | None = None
        if indices is not None:
            self.indices = np.asarray(indices, dtype=np.int64)
        elif world_size == 1:
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

    def set_image_weights(self, weights: Callable[[], np.ndarray] | None) -> None:
        """Draw each epoch's images by weight (v7.0 ``--image-weights``): ``weights()``, asked when the epoch's
        iterator is made, gives every dataset image's weight (:class:`~yolo5l.data.image_weights.ImageWeights`).

        An epoch is then ``len(self)`` draws with replacement from this rank's shard, with probabilities proportional
        to the weights (uniform when they are all 0), from a generator keyed by (seed, epoch, rank): the same after a
        resume, given the same weights. Each item also carries :data:`MOSAIC_PARTNERS` partners drawn the same way,
        and an augmentation key with its position, so an image drawn twice is augmented twice.
        """
        self._image_weights = weights

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

    def _weighted_items(self, key: tuple[int, int, int]) -> list[tuple[Any, ...]]:
        assert self._image_weights is not None
        w = np.asarray(self._image_weights(), dtype=np.float64)[self.indices]
        total = w.sum()
        p = w / total if total > 0 else None  # a shard of background images only: uniform
        rng = np.random.default_rng((*key, _WEIGHTED_STREAM))
        draws = rng.choice(self.indices, size=(len(self.indices), 1 + MOSAIC_PARTNERS), p=p)
        mosaic = self.mosaic
        return [(int(d[0]), mosaic, (*key, pos), tuple(int(x) for x in d[1:])) for pos, d in enumerate(draws)]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        key = (self.seed, self.epoch, self.rank)
        if self._image_weights is not None:
            items = self._weighted_items(key)
        else:
            order = self.indices
            if self.shuffle:
                order = order[np.random.default_rng(key).permutation(len(order))]
            mosaic = self.mosaic
            items = [(int(i), mosaic, key) for i in order]
        if self._resume is not None and self._resume[0] == self.epoch:
            items = items[self._resume[1] :]
        return iter(items)

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
