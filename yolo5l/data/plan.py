"""The worker half of the device input path: a training sample's draws and labels, and what its pixels are made of.

:func:`plan_item` runs a training sample's augmentation exactly as ``YOLODataset._item`` does (every draw from the
sample's generator, in the same order, and all the box arithmetic, so the labels are the host path's to the bit)
but makes no pixels: it records what the device needs to make them (:class:`SamplePlan`): per layer (a mosaic, or
the letterboxed image; two with mixup) the images of its 4 canvas quadrants and where they lie, the canvas-to-output
matrix, then mixup's ratio, the HSV gains and the flips. The images travel as their files' bytes (no
cache; JPEGs a GPU decodes), as the part of the resized image the output reads (a RAM or disk cache, and the
images a GPU does not decode: PNG, greyscale, CMYK, progressive JPEG), or as an index into the device cache.

A sample that CLAHE touches (~1% with v7.0's p; the other albumentations transforms are made on the device), or
that copy-paste edits, or one of rectangular training, is made on the host instead, by replaying its generator from
the start: its pixels travel.
:func:`collate_plans` packs a batch into one :class:`PlanBatch` of flat tensors (in shared memory in a worker);
:mod:`yolo5l.data.render` and :mod:`yolo5l.data.device_input` make the images.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import cv2
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import get_worker_info

from yolo5l.data import augment as aug
from yolo5l.data import mosaic as mos
from yolo5l.data.box_format import xywhn_to_xyxy, xyxy_to_xywhn
from yolo5l.data.jpeg_header import read_jpeg_header
from yolo5l.data.letterbox import letterbox_layout
from yolo5l.data.render import orient_hw

__all__ = ["PIPELINES", "PlanBatch", "SamplePlan", "cache_fallback", "choose_input", "collate_plans", "input_notes",
           "plan_item"]  # fmt: skip

PIPELINES = ("auto", "host", "device")  # data.pipeline: where training samples' pixels are made


def choose_input(pipeline: str, cache: str, rect: bool, device: torch.device) -> tuple[str, str, str]:
    """``(pipeline, cache, why)``: the training pipeline and cache a run on ``device`` uses for ``data.pipeline``,
    ``data.cache`` and ``data.rect``, and why the pipeline is what it is ("" when as typed): ``auto`` is ``device``
    on CUDA, ``rect`` needs the host, and without the device pipeline ``data.cache=device`` caches in RAM."""
    if rect and pipeline != "host":
        chosen, why = "host", "rect: the host makes rectangular batches"
    elif pipeline == "auto":
        chosen, why = ("device", "auto: CUDA") if device.type == "cuda" else ("host", "auto: not CUDA")
    else:
        chosen, why = pipeline, ""
    return chosen, "ram" if cache == "device" and chosen == "host" else cache, why


def cache_fallback(device: torch.device) -> str:
    """Why ``data.cache=device`` caches in RAM on ``device`` (`choose_input`)."""
    if device.type != "cuda":
        return f"data.cache=device keeps images in GPU memory, and this run trains on {device.type} (no CUDA)"
    return "data.cache=device needs data.pipeline=device"


def input_notes(cache: str, pipeline_used: str, cache_used: str, device: torch.device) -> list[tuple[str, str]]:
    """The (key, line) notes of the start-up for what `choose_input` chose: a device cache that caches in RAM,
    and the device pipeline on a device other than CUDA (typed: ``auto`` picks the host there)."""
    notes = []
    if cache == "device" != cache_used:
        notes.append(("cache", f"train: {cache_fallback(device)}: caching in RAM instead"))
    if pipeline_used == "device" and device.type != "cuda":
        line = (f"warning: data.pipeline=device on {device.type}: the GPU input path's ops run there, slower than the "
                "host path (data.pipeline=auto picks the host without CUDA)")  # fmt: skip
        notes.append(("pipeline", line))
    return notes
TILE_SOURCES = ("bytes", "pixels", "cache")  # how a dataset's tiles travel (see the module docstring)
_JPEG, _PIXELS, _CACHE = 0, 1, 2  # tile kinds in PlanBatch.tiles
_BORDER_READ = 2  # canvas pixels read around the output's preimage (bilinear neighbours and rounding)
TILE_COLUMNS = ("kind", "src", "nbytes", "h", "w", "origin_y", "origin_x", "stored_h", "stored_w", "orientation")
SLOT_COLUMNS = ("tile", "x1", "y1", "x2", "y2", "dx", "dy")  # dx, dy: x1b - x1a, y1b - y1a (canvas -> image)


@dataclass
class Tile:
    """One image a layer reads: ``kind`` (0 bytes of a JPEG, 1 pixels, 2 the device cache), its image index, and
    what travels: the file's bytes with its stored size and orientation, or the (h, w, 3) part of the resized
    image that starts at (origin_y, origin_x)."""

    kind: int
    index: int
    hw: tuple[int, int]  # the resized image's (h, w)
    data: np.ndarray | None = None  # bytes (1-D uint8) or pixels (h, w, 3) uint8
    origin: tuple[int, int] = (0, 0)
    stored: tuple[int, int, int] = (0, 0, 1)  # a JPEG's stored (h, w) and EXIF orientation


@dataclass
class Layer:
    """A canvas warped into the output: its 4 quadrants' tiles (None: 114) and rectangles, the canvas-to-output
    matrix ``M`` and the point ``split`` where the quadrants meet."""

    tiles: list[Tile | None]
    rects: list[tuple[int, int, int, int, int, int]]  # x1, y1, x2, y2 on the canvas; dx, dy into the image
    M: np.ndarray
    split: tuple[int, int]


@dataclass
class SamplePlan:
    """A training sample as the device makes it: labels (n, 6) as the host path's, and either ``layers`` (+ mixup
    ratio, HSV tables, flips) or the ``host`` pixels (H, W, 3) uint8."""

    labels: Tensor
    path: str
    shapes: Any
    size: tuple[int, int]
    layers: list[Layer] = field(default_factory=list)
    mix: float = -1.0
    gains: np.ndarray | None = None  # HSV gains (3,) float64, or None: no HSV draw
    albu: tuple[int, int, int] = (0, 0, 0)  # albumentations' blur and median kernels and grey (0: not fired)
    flip_ud: bool = False
    flip_lr: bool = False
    host: np.ndarray | None = None


# --------------------------------------------------------------------------------------------- tiles
def _read(path: str) -> bytes:
    """A file's bytes: one open, one sized read (no buffered reader)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
        while len(data) < size:  # a read may return less than asked (network file systems)
            more = os.read(fd, size - len(data))
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


class TileReader:
    """Turns (image index, the part of it the output reads) into a :class:`Tile`, for a dataset whose tiles travel
    as ``source`` (one of :data:`TILE_SOURCES`). JPEG headers are parsed from the bytes once per worker."""

    def __init__(self, ds: Any, source: str) -> None:
        if source not in TILE_SOURCES:
            raise ValueError(f"tile source must be one of {TILE_SOURCES}, got {source!r}")
        self.ds, self.source = ds, source
        self._gpu_decodable: dict[int, tuple[int, int, int] | None] = {}  # index -> stored (h, w, orientation)

    def __call__(self, i: int, part: tuple[int, int, int, int]) -> Tile:
        """Image ``i``'s tile; ``part`` = (x1, y1, x2, y2) of the resized image that is read (pixels only)."""
        hw = self.ds.cache.resized_hw(i)
        if self.source == "cache":
            return Tile(_CACHE, i, hw)
        if self.source == "bytes" and self._gpu_decodable.get(i, ()) is not None:
            data = _read(self.ds.im_files[i])
            if i not in self._gpu_decodable:
                header = read_jpeg_header(data)
                ok = header is not None and header.gpu_decodable
                stored = (header.height, header.width, header.orientation) if ok else None
                # the label scan's size is the one the labels and the layout assume; a decoder that disagrees
                # (an orientation in XMP only) gets the host's decode, which resizes to it
                if stored is not None and orient_hw(*stored) != tuple(int(v) for v in self.ds.shapes[i]):
                    stored = None
                self._gpu_decodable[i] = stored
            if self._gpu_decodable[i] is not None:
                return Tile(_JPEG, i, hw, np.frombuffer(data, np.uint8), stored=self._gpu_decodable[i])
        x1, y1, x2, y2 = part
        img = self.ds._tile(i, y2)  # the resized image (possibly its top rows only), as the host path reads it
        return Tile(_PIXELS, i, hw, np.ascontiguousarray(img[y1:y2, x1:x2]), origin=(y1, x1))


def _layer(
    tiles: Sequence[int | None],
    layout: Sequence[mos.Placement],
    M: np.ndarray,
    split: tuple[int, int],
    out_hw: tuple[int, int],
    read: Callable[[int, tuple[int, int, int, int]], Tile],
) -> Layer:
    """A layer of 4 quadrants (an image or None each) placed by ``layout``; images the output never reads are not
    loaded (as the host's direct warp), pixel tiles carry only the part of the image it reads."""
    height, width = out_hw
    if M[2, 0] or M[2, 1]:  # a homography's preimage of the output is not its corners' box: read whole rectangles
        inv = cv2.invert(M, flags=cv2.DECOMP_LU)[1]
        vx1 = vy1 = -(2**30)
        vx2 = vy2 = 2**30
    else:
        inv = np.vstack([cv2.invertAffineTransform(M[:2]), [0, 0, 1]])
        vx1, vy1, vx2, vy2 = aug.affine_bounds(inv[:2].tolist(), 0, 0, width, height)
        vx1, vy1, vx2, vy2 = vx1 - _BORDER_READ, vy1 - _BORDER_READ, vx2 + _BORDER_READ, vy2 + _BORDER_READ
    out_tiles: list[Tile | None] = []
    rects = []
    for i, ((x1a, y1a, x2a, y2a), (x1b, y1b, _, _)) in zip(tiles, layout, strict=True):
        ax1, ay1, ax2, ay2 = max(x1a, vx1), max(y1a, vy1), min(x2a, vx2), min(y2a, vy2)
        if i is None or ax2 <= ax1 or ay2 <= ay1:
            out_tiles.append(None)
            rects.append((0, 0, 0, 0, 0, 0))
            continue
        dx, dy = x1b - x1a, y1b - y1a
        out_tiles.append(read(i, (ax1 + dx, ay1 + dy, ax2 + dx, ay2 + dy)))
        rects.append((x1a, y1a, x2a, y2a, dx, dy))
    return Layer(out_tiles, rects, inv, split)


def _mosaic_layer(
    ds: Any, index: int, rng: np.random.Generator, partners: Sequence[int] | None, read: Callable
) -> tuple[Layer, np.ndarray]:
    """``YOLODataset.load_mosaic``'s draws and labels, its pixels planned: (layer, (n, 5) xyxy labels)."""
    s, h = ds.imgsz, ds.hyp
    xc, yc = (int(rng.uniform(-b, 2 * s + b)) for b in ds.mosaic_border)
    others = rng.choice(ds.indices, size=3) if partners is None else partners
    idx = [index, *(int(i) for i in others)]
    idx = [idx[i] for i in rng.permutation(4)]
    shapes = [ds.cache.resized_hw(i) for i in idx]
    layout = mos.mosaic4_layout(shapes, s, (xc, yc))
    lab4 = mos.mosaic4_labels([ds.labels[i] for i in idx], shapes, layout, s)
    border = ds.mosaic_border
    M, sc = aug.perspective_matrix(
        (2 * s, 2 * s), border, h["degrees"], h["translate"], h["scale"], h["shear"], h["perspective"], rng
    )
    height, width = 2 * s + 2 * border[0], 2 * s + 2 * border[1]
    labels = aug.warp_boxes(lab4, M, sc, width, height, perspective=bool(h["perspective"]))
    return _layer(idx, layout, M, (xc, yc), (height, width), read), labels


def _letterbox_layer(
    ds: Any, index: int, rng: np.random.Generator, read: Callable
) -> tuple[Layer, np.ndarray, Any] | None:
    """``YOLODataset._letterboxed`` + ``_perspective``'s draws and labels; None when the letterbox would resize the
    image again (rectangular batches: the host makes those)."""
    s, h = ds.imgsz, ds.hyp
    hw = ds.cache.resized_hw(index)
    (w_new, h_new), (top, _, left, _), _, (pw, ph) = letterbox_layout(hw, s, auto=False, scaleup=True)
    if (h_new, w_new) != hw:
        return None
    h0, w0 = (int(v) for v in ds.shapes[index])
    shapes = ((h0, w0), ((hw[0] / h0, hw[1] / w0), (pw, ph)))
    lab = ds.labels[index]
    labels = np.zeros((len(lab), 5), np.float32)
    if len(lab):
        labels[:, 0] = lab[:, 0]
        labels[:, 1:] = xywhn_to_xyxy(lab[:, 1:5], hw[1], hw[0], pw, ph)  # v7.0's pad, as the host's labels
    M, sc = aug.perspective_matrix(
        (s, s), (0, 0), h["degrees"], h["translate"], h["scale"], h["shear"], h["perspective"], rng
    )
    labels = aug.warp_boxes(labels, M, sc, s, s, perspective=bool(h["perspective"]))
    # the image in quadrant 3 of a canvas split at (0, 0): every canvas pixel of the image is in that quadrant
    layout = [((0, 0, 0, 0), (0, 0, 0, 0))] * 3 + [((left, top, left + hw[1], top + hw[0]), (0, 0, hw[1], hw[0]))]
    layer = _layer([None, None, None, index], layout, M, (0, 0), (s, s), read)
    return layer, labels, shapes


def plan_item(
    ds: Any,
    index: int,
    mosaic_allowed: bool,
    rng: np.random.Generator,
    partners: Sequence[int] | None,
    read: TileReader,
) -> SamplePlan | None:
    """The training sample ``index`` of ``ds`` (a ``YOLODataset``) planned for the device, with the draws of
    ``YOLODataset._item`` from ``rng``; None when the host must make it (the caller replays the generator)."""
    h = ds.hyp
    if h["copy_paste"] or ds.rect:
        return None
    shapes = None
    if mosaic_allowed and rng.random() < h["mosaic"]:
        layer, labels = _mosaic_layer(ds, index, rng, None if partners is None else partners[:3], read)
        layers, mix = [layer], -1.0
        if rng.random() < h["mixup"]:
            partner = int(rng.choice(ds.indices))
            more = None if partners is None else partners[3:6]
            layer2, labels2 = _mosaic_layer(ds, partner, rng, more, read)
            mix = float(rng.beta(mos.MIXUP_BETA, mos.MIXUP_BETA))
            layers.append(layer2)
            labels = np.concatenate((labels, labels2), 0)
        size = (2 * ds.imgsz + 2 * ds.mosaic_border[0], 2 * ds.imgsz + 2 * ds.mosaic_border[1])
    else:
        planned = _letterbox_layer(ds, index, rng, read)
        if planned is None:
            return None
        layer, labels, shapes = planned
        layers, mix, size = [layer], -1.0, (ds.imgsz, ds.imgsz)
    nl = len(labels)
    if nl:
        labels[:, 1:5] = xyxy_to_xywhn(labels[:, 1:5], size[1], size[0], clip=True)
    albu = (0, 0, 0) if ds.albumentations is None else ds.albumentations.device_ops(rng)
    if albu is None:  # CLAHE
        return None
    gains = aug.hsv_gains(h["hsv_h"], h["hsv_s"], h["hsv_v"], rng)
    flip_ud = bool(rng.random() < h["flipud"])
    if flip_ud and nl:
        labels[:, 2] = 1 - labels[:, 2]
    flip_lr = bool(rng.random() < h["fliplr"])
    if flip_lr and nl:
        labels[:, 1] = 1 - labels[:, 1]
    out = np.zeros((nl, 6), dtype=np.float32)
    out[:, 1:] = labels
    return SamplePlan(
        torch.from_numpy(out), ds.im_files[index], shapes, size, layers, mix, gains, albu, flip_ud, flip_lr
    )


# --------------------------------------------------------------------------------------------- batch
def _empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor, in shared memory inside a DataLoader worker (as ``default_collate`` allocates), so
    that the batch reaches the main process without another copy."""
    if get_worker_info() is None:
        return torch.empty(tuple(shape), dtype=dtype)
    numel = int(np.prod(shape)) if len(shape) else 1
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel)
    return torch.empty(0, dtype=dtype).set_(storage).reshape(tuple(shape))


def _pack(arrays: Sequence[np.ndarray]) -> tuple[Tensor, list[int]]:
    """Arrays' bytes in one flat uint8 tensor, and each one's offset."""
    offsets = np.cumsum([0, *(a.size for a in arrays)])
    flat = _empty((int(offsets[-1]),), torch.uint8)
    view = flat.numpy()
    for a, o in zip(arrays, offsets[:-1], strict=False):
        view[o : o + a.size] = a.reshape(-1)
    return flat, offsets[:-1].tolist()


@dataclass
class PlanBatch:
    """A batch as the workers send it to the device (see the module docstring): flat tensors and small tables.

    ``tiles`` (T, 10) int64 rows of :data:`TILE_COLUMNS`; ``slots`` (B, 2, 4, 7) int64 rows of :data:`SLOT_COLUMNS`
    per sample, layer and quadrant (tile -1: empty); ``inv`` (B, 2, 3, 3) the output-to-canvas matrices; ``split``
    (B, 2, 2); ``layers`` (B,) 0 (host pixels), 1 or 2; ``mix`` (B,) mixup's ratio; ``gains`` (B, 3) float64, the
    HSV jitter's, and ``hsv`` (B,) whether it applies; ``albu`` (B, 3) albumentations' draws (``SamplePlan.albu``);
    ``flip`` (B, 2) up-down, left-right; ``host`` (Bh, H, W, 3)
    with their ``host_pos`` (Bh,).
    """

    size: tuple[int, int]
    jpeg: Tensor
    pixels: Tensor
    tiles: Tensor
    slots: Tensor
    inv: Tensor
    split: Tensor
    layers: Tensor
    mix: Tensor
    gains: Tensor
    hsv: Tensor
    albu: Tensor
    flip: Tensor
    host: Tensor
    host_pos: Tensor

    def _map(self, fn: Callable[[Tensor], Tensor], skip: tuple[str, ...] = ()) -> PlanBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return PlanBatch(**{k: fn(v) if isinstance(v, Tensor) and k not in skip else v for k, v in values.items()})

    def pin_memory(self) -> PlanBatch:
        """Pinned copies for asynchronous copies to the device (the DataLoader's pin thread calls this); the JPEG
        bytes stay as they are (the decoder reads them on the host)."""
        return self._map(lambda t: t.pin_memory() if t.numel() else t, skip=("jpeg",))

    def to(self, device: torch.device, non_blocking: bool = False) -> PlanBatch:
        """Everything but the JPEG bytes on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking), skip=("jpeg",))

    def __len__(self) -> int:
        return len(self.layers)


def collate_plans(
    batch: Sequence[SamplePlan],
) -> tuple[PlanBatch, Tensor, tuple[str, ...], tuple[Any, ...]]:
    """Pack planned samples into ``(PlanBatch, targets (N, 6), paths, shapes)``; targets as ``collate_fn``'s.

    JPEG tiles of the same image are sent once per batch; pixel tiles are each layer's own (each is the part of
    the image its layer reads)."""
    sizes = {p.size for p in batch}
    if len(sizes) != 1:
        raise ValueError(f"a batch's samples must share one output size, got {sorted(sizes)}")
    size = sizes.pop()
    n = len(batch)
    jpeg_data: list[np.ndarray] = []
    pixel_data: list[np.ndarray] = []
    rows: list[list[int]] = []
    jpeg_row: dict[int, int] = {}
    cache_row: dict[int, int] = {}
    slots = np.zeros((n, 2, 4, len(SLOT_COLUMNS)), np.int64)
    slots[..., 0] = -1
    inv = np.tile(np.eye(3), (n, 2, 1, 1))
    split = np.zeros((n, 2, 2), np.int64)
    for b, p in enumerate(batch):
        for k, layer in enumerate(p.layers):
            inv[b, k] = layer.M
            split[b, k] = layer.split
            for q, (tile, rect) in enumerate(zip(layer.tiles, layer.rects, strict=True)):
                if tile is None:
                    continue
                if tile.kind == _JPEG and tile.index in jpeg_row:
                    t = jpeg_row[tile.index]
                elif tile.kind == _CACHE and tile.index in cache_row:
                    t = cache_row[tile.index]
                else:
                    t = len(rows)
                    (h, w), (oy, ox), (sh, sw, orient) = tile.hw, tile.origin, tile.stored
                    if tile.kind == _JPEG:
                        jpeg_row[tile.index] = t
                        rows.append([_JPEG, len(jpeg_data), tile.data.size, h, w, 0, 0, sh, sw, orient])
                        jpeg_data.append(tile.data)
                    elif tile.kind == _CACHE:
                        cache_row[tile.index] = t
                        rows.append([_CACHE, tile.index, 0, h, w, 0, 0, 0, 0, 1])
                    else:
                        ch, cw = tile.data.shape[:2]
                        rows.append([_PIXELS, len(pixel_data), 0, ch, cw, oy, ox, 0, 0, 1])
                        pixel_data.append(tile.data)
                slots[b, k, q] = (t, *rect)
    jpeg, jpeg_off = _pack(jpeg_data)
    pixels, pixel_off = _pack(pixel_data)
    table = np.array(rows, dtype=np.int64).reshape(-1, len(TILE_COLUMNS))
    for kind, offsets in ((_JPEG, jpeg_off), (_PIXELS, pixel_off)):  # data list positions -> flat buffer offsets
        of_kind = table[:, 0] == kind
        table[of_kind, 1] = np.asarray(offsets, dtype=np.int64)[table[of_kind, 1]]
    tiles = torch.from_numpy(table)
    hosts = [b for b, p in enumerate(batch) if p.host is not None]
    host = _empty((len(hosts), *size, 3), torch.uint8)
    for j, b in enumerate(hosts):
        host[j] = torch.from_numpy(batch[b].host)
    labels = [p.labels for p in batch]
    for i, lb in enumerate(labels):
        lb[:, 0] = i
    plan = PlanBatch(
        size=size,
        jpeg=jpeg,
        pixels=pixels,
        tiles=tiles,
        slots=torch.from_numpy(slots),
        inv=torch.from_numpy(inv),
        split=torch.from_numpy(split),
        layers=torch.tensor([0 if p.host is not None else len(p.layers) for p in batch], dtype=torch.int64),
        mix=torch.tensor([p.mix for p in batch], dtype=torch.float64),
        gains=torch.from_numpy(np.array([(1.0, 1.0, 1.0) if p.gains is None else p.gains for p in batch])),
        hsv=torch.tensor([p.gains is not None for p in batch]),
        albu=torch.tensor([p.albu for p in batch], dtype=torch.int64).reshape(n, 3),
        flip=torch.tensor([[p.flip_ud, p.flip_lr] for p in batch], dtype=torch.bool).reshape(n, 2),
        host=host,
        host_pos=torch.tensor(hosts, dtype=torch.int64),
    )
    return plan, torch.cat(labels, 0), tuple(p.path for p in batch), tuple(p.shapes for p in batch)
