"""``YOLODataset``: a torch Dataset over a :class:`~yolo5l.data.label_scan.LabelIndex`, and the batch collate.

Train mode (``augment=True``): mosaic (+ mixup, copy-paste) and random perspective, or, when the mosaic is
skipped or switched off, letterbox + random perspective with border 0; then albumentations, HSV and flips.
Val mode (``augment=False``): images sorted by aspect ratio, letterboxed without upscaling to the shape of
their rectangular batch.

Items are ``(image uint8 (3, H, W) RGB, labels float32 (n, 6) [0, cls, cx, cy, w, h], path, shapes)``;
``shapes`` is ``((h0, w0), ((ratio_h, ratio_w), (pad_w, pad_h)))`` for letterboxed images and None for mosaics.
An index may be an int, ``(int, mosaic_allowed)``, ``(int, mosaic_allowed, key)`` or ``(int, mosaic_allowed, key,
partners)``: the training sampler sends the third form (the fourth with image weights: the item carries its mosaics'
partners, which v7.0 draws from the weighted indices), which is how close_mosaic reaches persistent worker processes
without any shared state, and how each sample gets its own random generator, ``np.random.default_rng((*key,
index))`` with ``key = (seed, epoch, rank)``: the augmentation of a sample is then a pure function of (seed, epoch,
rank, index), the same whichever worker process draws it and whatever ran before in that process (so ``num_workers``
does not change the batches, and a run resumed in a new process replays the uninterrupted one). The shorter forms
draw a generator seed from the global ``np.random`` state (seeded per worker by the loader's worker init function).

Reference: YOLOv5 v7.0 utils/dataloaders.py LoadImagesAndLabels (behaviour).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from yolo5l.base.image_size import MAX_STRIDE, check_image_size
from yolo5l.data import augment as aug
from yolo5l.data import letterbox as lbx
from yolo5l.data import mosaic as mos
from yolo5l.data.box_format import xywhn_to_xyxy, xyxy_to_xywhn
from yolo5l.data.cache import ImageCache
from yolo5l.data.label_scan import LabelIndex
from yolo5l.data.plan import SamplePlan, TileReader, plan_item

Shapes = tuple[tuple[int, int], tuple[tuple[float, float], tuple[float, float]]]
Item = int | tuple[int, bool] | tuple[int, bool, Sequence[int]] | tuple[int, bool, Sequence[int], Sequence[int]]


def sample_rng(index: int, key: Sequence[int] | None = None) -> np.random.Generator:
    """The generator of one sample: a pure function of ``(*key, index)``, or, without a key, seeded by one draw from
    the global ``np.random`` state."""
    return np.random.default_rng(_sample_seed(index, key))


def _sample_seed(index: int, key: Sequence[int] | None) -> int | list[int]:
    if key is None:
        return np.random.randint(0, 2**31 - 1)
    return [*(int(k) for k in key), int(index)]


class YOLODataset(Dataset):
    """YOLO-format detection dataset with YOLOv5's augmentation.

    Args:
        index: The split's label index (``im_files``, ``labels``, ``shapes``).
        imgsz: Training image size / long side of validation images (multiple of ``stride``).
        augment: Train mode with augmentation; False gives validation letterboxing.
        hyp: Augmentation hyperparameters (``conf/hyp`` keys); missing keys take scratch-low values.
        rect: Rectangular batches (sorted by aspect ratio); needs ``batch_size``. Default: ``not augment``. In train
            mode (v7.0 ``--rect``) each image is letterboxed to its batch's shape and never part of a mosaic.
        batch_size: Batch size used to compute the rectangular batch shapes.
        cache: "none", "ram" or "disk" (see :class:`~yolo5l.data.cache.ImageCache`).
        cache_dir: Disk cache folder.
        reduced_decode: Decode a JPEG at least twice the target size at 1/2, 1/4 or 1/8 scale (libjpeg's DCT
            scaling) before resizing it (see :func:`~yolo5l.data.images.read_image_reduced`).
        stride: Model's maximum stride.
        pad: Rectangular batch padding in units of ``stride``.
        prefix: Message prefix, e.g. "train: ".
        single_cls: Every label becomes class 0 (v7.0 ``--single-cls``).
    """

    def __init__(
        self,
        index: LabelIndex,
        imgsz: int = 640,
        augment: bool = True,
        hyp: Mapping[str, Any] | None = None,
        rect: bool | None = None,
        batch_size: int = 16,
        cache: str = "none",
        cache_dir: str | None = None,
        reduced_decode: bool = True,
        stride: int = MAX_STRIDE,
        pad: float = lbx.RECT_PAD,
        prefix: str = "",
        single_cls: bool = False,
    ) -> None:
        self.imgsz = check_image_size(imgsz, stride, "imgsz")
        self.augment = augment
        self.hyp = aug.augment_hyp(hyp)
        self.rect = (not augment) if rect is None else rect
        self.stride = stride
        self.prefix = prefix
        im_files, labels, shapes = list(index.im_files), list(index.labels), np.asarray(index.shapes)
        self.batch_shapes: np.ndarray | None = None
        if self.rect:
            order, self.batch_shapes = lbx.rect_batch_shapes(shapes, batch_size, self.imgsz, stride, pad)
            im_files = [im_files[i] for i in order]
            labels = [labels[i] for i in order]
            shapes = shapes[order]
        self.batch_size = batch_size
        self.im_files = im_files
        self.labels = [np.asarray(lb, dtype=np.float32).reshape(-1, 5) for lb in labels]
        if single_cls:  # new arrays: the label index keeps its classes
            self.labels = [np.concatenate((np.zeros_like(lb[:, :1]), lb[:, 1:]), 1) for lb in self.labels]
        self.shapes = shapes  # (n, 2) original [h, w]
        # Indices that mosaic / mixup partners are drawn from: under DDP the rank's shard, so that a RAM cache
        # of the shard covers every image this rank reads.
        self.indices = np.arange(len(im_files))
        self.cache = ImageCache(
            im_files, shapes, self.imgsz, cache, augment, cache_dir, prefix=prefix, reduced_decode=reduced_decode
        )
        self.albumentations = aug.Albumentations() if augment else None
        self.mosaic_border = (-self.imgsz // 2, -self.imgsz // 2)
        self.tile_reader: TileReader | None = None  # set by plan_on_device: training items become SamplePlans

    def plan_on_device(self, tiles: str) -> None:
        """Make training items :class:`~yolo5l.data.plan.SamplePlan` s for the device input path, their images
        travelling as ``tiles`` ("bytes", "pixels" or "cache"; see :mod:`yolo5l.data.plan`)."""
        if not self.augment:
            raise ValueError("only training datasets (augment=True) plan their samples for the device")
        self.tile_reader = TileReader(self, tiles)

    def __len__(self) -> int:
        return len(self.im_files)

    def set_indices(self, indices: Sequence[int]) -> None:
        """Restrict mosaic/mixup partners to ``indices`` (the rank's shard)."""
        self.indices = np.asarray(indices, dtype=np.int64)

    def fill_cache(self, indices: Sequence[int] | None = None) -> str:
        """Fill the image cache for ``indices`` (default: ``self.indices``); returns its summary line."""
        return self.cache.fill(self.indices if indices is None else indices)

    def reseed(self, seed: int) -> None:
        """Reseed the albumentations generators (random / np.random are seeded by the worker init function)."""
        if self.albumentations is not None:
            self.albumentations.reseed(seed)

    # ----------------------------------------------------------------------------------------- loading
    def load_image(self, i: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        """Image ``i`` resized to long side ``imgsz``: ``(img, (h0, w0), (h, w))``. Never modify it in place."""
        img = self.cache.load(i)
        h0, w0 = (int(v) for v in self.shapes[i])
        return img, (h0, w0), img.shape[:2]

    def load_mosaic(
        self, index: int, rng: np.random.Generator, partners: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """4-image mosaic + copy-paste + random perspective (border -s/2): (s x s image, (n, 5) xyxy labels).

        Draws the centre, the 3 partners, their order, then copy-paste's and the perspective's draws. With an affine
        warp and no copy-paste (the default hyp) the images are warped straight into the output
        (:func:`~yolo5l.data.augment.mosaic4_perspective`); otherwise they are placed on the 2s x 2s canvas first,
        which copy-paste edits and a perspective warp reads whole. Both give the same labels for the same draws. The
        direct warp loads only the images the output shows (their sizes come from the label scan). ``partners``
        (3 indices) replaces the draw of the partners (image weights: the sampler draws them).
        """
        s, h = self.imgsz, self.hyp
        xc, yc = (int(rng.uniform(-b, 2 * s + b)) for b in self.mosaic_border)  # U(s/2, 3s/2)
        others = rng.choice(self.indices, size=3) if partners is None else partners
        idx = [index, *(int(i) for i in others)]
        idx = [idx[i] for i in rng.permutation(4)]
        labels = [self.labels[i] for i in idx]
        if h["copy_paste"] or h["perspective"]:
            img, lab4 = mos.mosaic4([self.load_image(i)[0] for i in idx], labels, s, (xc, yc))
            img, lab4 = mos.copy_paste_boxes(img, lab4, p=h["copy_paste"], rng=rng)
            return self._perspective(img, lab4, rng, border=self.mosaic_border)
        return mos.mosaic4_perspective(
            [functools.partial(self._tile, i) for i in idx], labels, s, (xc, yc), self.mosaic_border, h["degrees"],
            h["translate"], h["scale"], h["shear"], rng, shapes=[self.cache.resized_hw(i) for i in idx],
        )  # fmt: skip

    def _tile(self, i: int, rows: int | None = None) -> np.ndarray:
        """Image ``i`` at the size the label scan's shape gives it (``cache.resized_hw``), which the mosaic's layout
        was computed from; with ``rows``, possibly only its top rows, at least that many (the decode stops there,
        see :meth:`ImageCache.load <yolo5l.data.cache.ImageCache.load>`).

        The image and the scan's shape differ only where the decoder and the scan disagree on the orientation (an
        orientation kept in XMP only, which OpenCV ignores); the whole image is then resized to that shape, as its
        normalised labels assume."""
        h, w = self.cache.resized_hw(i)
        img = self.cache.load(i, rows)
        if img.shape[:2] == (h, w) or (rows is not None and img.shape[1] == w and min(rows, h) <= img.shape[0] < h):
            return img
        img = self.load_image(i)[0]
        return img if img.shape[:2] == (h, w) else cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)

    def _perspective(
        self, img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, border: tuple[int, int] = (0, 0)
    ) -> tuple[np.ndarray, np.ndarray]:
        """YOLOv5's random_perspective with the geometric hyperparameters of ``self.hyp``."""
        h = self.hyp
        return aug.random_perspective(
            img,
            labels,
            degrees=h["degrees"],
            translate=h["translate"],
            scale=h["scale"],
            shear=h["shear"],
            perspective=h["perspective"],
            border=border,
            rng=rng,
        )

    def _letterboxed(self, index: int) -> tuple[np.ndarray, np.ndarray, Shapes]:
        img, (h0, w0), (h, w) = self.load_image(index)
        shape = tuple(self.batch_shapes[index // self.batch_size]) if self.rect else self.imgsz
        out, (rh, rw), (pw, ph) = lbx.letterbox(img, shape, auto=False, scaleup=self.augment)
        if out is img:
            out = img.copy()  # the cached array must stay untouched by the in-place ops below
        shapes = ((h0, w0), ((h * rh / h0, w * rw / w0), (pw, ph)))
        lab = self.labels[index]
        labels = np.zeros((len(lab), 5), np.float32)
        if len(lab):
            labels[:, 0] = lab[:, 0]
            labels[:, 1:] = xywhn_to_xyxy(lab[:, 1:5], w * rw, h * rh, pw, ph)
        return out, labels, shapes

    # ----------------------------------------------------------------------------------------- item
    def __getitem__(self, item: Item) -> tuple[torch.Tensor, torch.Tensor, str, Shapes | None] | SamplePlan:
        """Sample ``item`` (an index, ``(index, mosaic_allowed)``, ``(index, mosaic_allowed, rng key)`` or
        ``(index, mosaic_allowed, rng key, 6 mosaic partners)``); its plan for the device after
        :meth:`plan_on_device`."""
        partners = None
        if isinstance(item, (int, np.integer)):
            index, mosaic_allowed, key = int(item), True, None
        else:
            index, mosaic_allowed, key = int(item[0]), bool(item[1]), (item[2] if len(item) > 2 else None)
            partners = tuple(item[3]) if len(item) > 3 else None
        if not self.augment:
            return self._item(index, mosaic_allowed, None)
        seed = _sample_seed(index, key)
        if self.tile_reader is None:
            return self._item(index, mosaic_allowed, np.random.default_rng(seed), partners)
        planned = plan_item(self, index, mosaic_allowed, np.random.default_rng(seed), partners, self.tile_reader)
        if planned is None:  # made on the host: the same draws again, from the start
            img, labels, path, shapes = self._item(index, mosaic_allowed, np.random.default_rng(seed), partners)
            hwc = img.permute(1, 2, 0).numpy()
            planned = SamplePlan(labels, path, shapes, hwc.shape[:2], host=hwc)
        return planned

    def _item(
        self,
        index: int,
        mosaic_allowed: bool,
        rng: np.random.Generator | None,
        partners: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, str, Shapes | None]:
        h = self.hyp
        # v7.0: no mosaic in rectangular training (`self.mosaic = augment and not rect`), and then no draw for it.
        if rng is not None and mosaic_allowed and not self.rect and rng.random() < h["mosaic"]:
            img, labels = self.load_mosaic(index, rng, None if partners is None else partners[:3])
            shapes = None
            if rng.random() < h["mixup"]:
                partner = int(rng.choice(self.indices))  # uniform, weighted or not (v7.0: random.randint(0, n - 1))
                more = None if partners is None else partners[3:6]
                img, labels = mos.mixup(img, labels, *self.load_mosaic(partner, rng, more), rng=rng)
        else:
            img, labels, shapes = self._letterboxed(index)
            if rng is not None:
                img, labels = self._perspective(img, labels, rng)
        nl = len(labels)
        if nl:
            labels[:, 1:5] = xyxy_to_xywhn(labels[:, 1:5], img.shape[1], img.shape[0], clip=True)
        if rng is not None:
            if self.albumentations is not None:
                img = np.ascontiguousarray(self.albumentations(img, rng=rng))
            aug.augment_hsv(img, h["hsv_h"], h["hsv_s"], h["hsv_v"], rng=rng)
            if rng.random() < h["flipud"]:
                img = aug.flip_ud(img, labels)
            if rng.random() < h["fliplr"]:
                img = aug.flip_lr(img, labels)
        out = torch.zeros((nl, 6), dtype=torch.float32)
        if nl:
            out[:, 1:] = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32))
        # (3, H, W) uint8 RGB as a view of the dense (H, W, 3) array: no transposing copy here; collate_fn stacks
        # the HWC memory into a channels_last batch, which is the memory format the model wants anyway.
        chw = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
        return chw, out, self.im_files[index], shapes


def collate_fn(
    batch: Sequence[tuple[torch.Tensor, torch.Tensor, str, Shapes | None]],
) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...], tuple[Shapes | None, ...]]:
    """Stack a list of items into ``(images uint8 (B, 3, H, W), targets (N, 6), paths, shapes)``; the images are
    in channels_last memory when the items are views of (H, W, 3) arrays, as the dataset's are.

    Column 0 of each item's labels gets the image's position in the batch. In a DataLoader worker the images and
    targets are written straight into shared memory, as ``torch.utils.data.default_collate`` does, so that the batch
    travels to the main process as it is (one in ordinary memory is copied into shared memory on the way).
    Module-level so it pickles into worker processes.
    """
    images, labels, paths, shapes = zip(*batch, strict=True)
    for i, lb in enumerate(labels):
        lb[:, 0] = i
    hwc = [im.permute(1, 2, 0) for im in images]
    dense_hwc = all(h.is_contiguous() for h in hwc)  # the dataset's items: one memcpy each, channels_last batch
    parts = hwc if dense_hwc else images
    out_images = out_targets = None
    if torch.utils.data.get_worker_info() is not None:
        # Empty outputs in shared memory (PyTorch torch/utils/data/_utils/collate.py::collate_tensor_fn does this).
        def shared(elem: torch.Tensor, *shape: int) -> torch.Tensor:
            storage = elem._typed_storage()._new_shared(torch.Size(shape).numel(), device=elem.device)
            return elem.new(storage).resize_(shape)

        out_images = shared(parts[0], len(parts), *parts[0].shape)
        out_targets = shared(labels[0], sum(len(lb) for lb in labels), *labels[0].shape[1:])
    stacked = torch.stack(parts, 0, out=out_images)
    if dense_hwc:
        stacked = stacked.permute(0, 3, 1, 2)
    return stacked, torch.cat(labels, 0, out=out_targets), tuple(paths), tuple(shapes)
