"""The device input path's main-process side: make a planned batch's images on the device, one batch ahead.

- :class:`DeviceInput` turns a :class:`~yolo5l.data.plan.PlanBatch` into the (B, 3, H, W) uint8 images the host
  path would have sent (channels_last memory), with :mod:`yolo5l.data.render`'s ops: the batch's JPEG tiles decoded
  in chunks of at most ``decode_bytes`` and resized, the layers warped, mixed, HSV-jittered and flipped, and the
  host-made samples put in their places.
- :class:`DeviceInputLoader` is a ``DataLoader`` whose iterator does that for batch k + 1 on a side CUDA stream
  before it hands out batch k, so the device work of the next batch overlaps the current training step instead
  of queueing in front of it; the main stream waits for a batch's images only where it uses them. On the CPU it
  makes each batch when it hands it out.
- :class:`DeviceCache` (``data.cache=device``) keeps every image of the rank's shard decoded and resized in device
  memory, when it fits beside ``reserve`` bytes for training, so the workers send only indices.

Device memory the path holds, bounded whatever the dataset's photos: the batch made ahead and the one in use
(B x H x W x 3 bytes each: 79 MB at batch 64, 640 px), the batch's resized tiles (~3.6 images of up to H x W x 3 a
sample: ~0.2 GB there), and while decoding one chunk of at most ``decode_bytes`` (256 MiB) of decoded pixels, twice
(the decoder's images and their packed copy): ~0.9 GB in all at batch 64, 640 px. The torch ops of the CPU path add
~``40 * max_pixels`` bytes (~0.3 GB) of temporaries; the Triton kernels (CUDA) none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from yolo5l.data import render
from yolo5l.data.cache import HEADROOM, _load_resized
from yolo5l.data.jpeg_header import read_jpeg_header
from yolo5l.data.plan import PlanBatch

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_DECODE_BYTES", "DeviceCache", "DeviceInput", "DeviceInputLoader", "plan_on_device"]

DEFAULT_DECODE_BYTES = 256 << 20  # decoded JPEG pixels held at once while a batch's tiles are resized
_JPEG, _PIXELS, _CACHE = 0, 1, 2
_GB = 1e9


def _decode_resize(
    data: Sequence[Tensor],
    stored: Sequence[tuple[int, int, int]],
    out: Tensor,
    out_info: Sequence[tuple[int, int, int]],
    device: torch.device,
    decode_bytes: int,
    max_pixels: int,
    backend: str = "auto",
) -> None:
    """Decode JPEGs (``stored``: their (h, w, orientation)) in chunks of at most ``decode_bytes`` of pixels, and
    resize each into ``out`` at its ``out_info`` row (offset, h, w). Host numbers in, no device read-back."""
    start = 0
    while start < len(data):
        stop, total = start, 0
        while stop < len(data) and (stop == start or total + 3 * stored[stop][0] * stored[stop][1] <= decode_bytes):
            total += 3 * stored[stop][0] * stored[stop][1]
            stop += 1
        decoded = render.decode_jpegs(data[start:stop], device)
        for im, (h, w, _) in zip(decoded, stored[start:stop], strict=True):
            if tuple(im.shape) != (3, h, w):
                raise RuntimeError(f"a JPEG decoded to {tuple(im.shape)}, its header says (3, {h}, {w})")
        sizes = [im.numel() for im in decoded]
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        src_info = torch.tensor(
            [[o, h, w, orient] for o, (h, w, orient) in zip(offsets, stored[start:stop], strict=True)],
            dtype=torch.int64,
        ).to(device, non_blocking=True)
        flat = torch.cat([im.reshape(-1) for im in decoded])
        del decoded
        rows = out_info[start:stop]
        dst = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        render.resize_tiles(flat, src_info, out, dst, max_pixels, sizes=[(h, w) for _, h, w in rows], backend=backend)
        start = stop


class DeviceCache:
    """Every image of a dataset's shard decoded, resized to long side ``imgsz`` (as the host's cache does) and kept
    in one uint8 buffer on ``device``; image ``i`` is ``buffer[offsets[i]:]``, (h, w, 3) interleaved.

    Args:
        dataset: the training ``YOLODataset`` (its files, scan shapes and resized sizes).
        device: where the cache lives.
        reserve: device bytes left free for training beside the cache (CUDA); on the CPU, RAM with ``HEADROOM``.
    """

    def __init__(self, dataset: Any, device: torch.device | str, reserve: int = 16 << 30) -> None:
        self.ds, self.device, self.reserve = dataset, torch.device(device), int(reserve)
        self.buffer: Tensor | None = None
        self.offsets: Tensor | None = None
        self.message = ""

    def fits(self, need: int) -> tuple[bool, str]:
        """Whether ``need`` bytes fit, and the free memory in words."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            kept = f"{free / _GB:.1f} GB free on {self.device}, {self.reserve / _GB:.0f} GB kept for training"
            return need + self.reserve <= free, kept
        avail = psutil.virtual_memory().available
        return need * HEADROOM <= avail, f"{avail / _GB:.1f} GB of RAM available"

    def fill(self, indices: Sequence[int], decode_bytes: int = DEFAULT_DECODE_BYTES) -> bool:
        """Decode and resize the images at ``indices`` into the cache; False (and ``message`` says why) when they do
        not fit. JPEGs a GPU decodes are decoded on the device, in chunks; the others on the host."""
        indices = [int(i) for i in indices]
        need = self.ds.cache.nbytes(indices)
        ok, free = self.fits(need)
        n = len(indices)
        if not ok:
            self.message = f"device cache does not fit: {n} images need {need / _GB:.2f} GB, {free}"
            return False
        hw = [self.ds.cache.resized_hw(i) for i in indices]
        sizes = [3 * h * w for h, w in hw]
        starts = np.cumsum([0, *sizes[:-1]])
        offsets = torch.full((len(self.ds),), -1, dtype=torch.int64)
        offsets[indices] = torch.as_tensor(starts, dtype=torch.int64)
        self.buffer = torch.empty(int(sum(sizes)), dtype=torch.uint8, device=self.device)
        self.offsets = offsets.to(self.device)
        files = self.ds.im_files

        def read(i: int) -> bytes:
            with open(files[i], "rb") as f:
                return f.read()

        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            for s in range(0, n, 256):
                chunk = indices[s : s + 256]
                jpeg, stored, rows = [], [], []
                for k, (i, data) in enumerate(zip(chunk, pool.map(read, chunk), strict=True)):
                    header = read_jpeg_header(data)
                    h, w = hw[s + k]
                    shape = tuple(int(v) for v in self.ds.shapes[i])
                    if (
                        header is not None
                        and header.gpu_decodable
                        and render.orient_hw(header.height, header.width, header.orientation) == shape
                    ):
                        jpeg.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                        stored.append((header.height, header.width, header.orientation))
                        rows.append([int(starts[s + k]), h, w])
                    else:  # the host's decode (PNG, greyscale, CMYK, progressive ...), resized as v7.0
                        img = _load_resized(files[i], self.ds.imgsz, True, reduced=False)
                        o = int(starts[s + k])
                        self.buffer[o : o + img.size] = torch.from_numpy(img.reshape(-1)).to(self.device)
                if jpeg:
                    max_pixels = render.DEFAULT_MAX_PIXELS
                    _decode_resize(jpeg, stored, self.buffer, rows, self.device, decode_bytes, max_pixels)
        self.message = f"cached {n} images ({need / _GB:.2f} GB) in {self.device} memory ({free})"
        return True


def plan_on_device(ds: Any, cache: str, device: torch.device, reserve: int) -> tuple[str, DeviceCache | None, str]:
    """Set a training dataset up for the device pipeline with ``data.cache=cache``: fill its cache (the host's, or
    a :class:`DeviceCache` on ``device``, which falls back to no cache when it does not fit, as the host's does) and
    say what its workers send. Returns the summary line, the device cache (or None) and the cache in use."""
    if cache == "device":
        device_cache = DeviceCache(ds, device, reserve)
        if device_cache.fill(ds.indices):
            ds.plan_on_device("cache")
            return device_cache.message, device_cache, "device"
        ds.plan_on_device("bytes")
        return f"{device_cache.message}; no image cache (data.cache=ram or disk hold it on the host)", None, "none"
    ds.plan_on_device("bytes" if cache == "none" else "pixels")
    line = ds.fill_cache()
    return line, None, ds.cache.mode  # "none" when the host's cache did not fit


class DeviceInput:
    """Makes the images of a :class:`~yolo5l.data.plan.PlanBatch` on ``device`` (see the module docstring).

    Args:
        device: where the images are made.
        cache: the device cache, for batches whose tiles are cache indices.
        decode_bytes: decoded JPEG pixels held at once.
        max_pixels: output pixels per chunk of the torch ops.
        backend: ``yolo5l.data.render``'s: the Triton kernels on CUDA ("auto"), or the torch ops.
    """

    def __init__(
        self,
        device: torch.device | str,
        cache: DeviceCache | None = None,
        decode_bytes: int = DEFAULT_DECODE_BYTES,
        max_pixels: int = render.DEFAULT_MAX_PIXELS,
        backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        self.cache = cache
        self.decode_bytes, self.max_pixels, self.backend = int(decode_bytes), int(max_pixels), backend

    def _tile_buffer(self, plan: PlanBatch, dev: PlanBatch) -> tuple[Tensor, Tensor]:
        """The flat buffer every tile of the batch is read from, and each tile's offset in it."""
        tiles = plan.tiles  # host copy: which tile is what decides the work, without device reads
        kinds = tiles[:, 0]
        if bool((kinds == _CACHE).any()):
            if self.cache is None or self.cache.buffer is None or bool((kinds != _CACHE).any()):
                raise RuntimeError("a batch of device-cache tiles needs the filled DeviceCache (and only such tiles)")
            return self.cache.buffer, self.cache.offsets[dev.tiles[:, 1]]
        jpeg_rows = (kinds == _JPEG).nonzero().flatten().tolist()  # host tensor: no device sync
        hw = tiles[jpeg_rows][:, 3:5]
        sizes = (3 * hw[:, 0] * hw[:, 1]).tolist()
        starts = np.cumsum([0, *sizes]).tolist()
        resized = torch.empty(int(starts[-1]), dtype=torch.uint8, device=self.device)
        if jpeg_rows:
            spans = tiles[jpeg_rows][:, 1:3].tolist()
            data = [plan.jpeg[o : o + n] for o, n in spans]
            stored = [tuple(r) for r in tiles[jpeg_rows][:, 7:10].tolist()]
            out_info = [(o, h, w) for o, (h, w) in zip(starts[:-1], hw.tolist(), strict=True)]
            _decode_resize(
                data, stored, resized, out_info, self.device, self.decode_bytes, self.max_pixels, self.backend
            )
        offsets = tiles[:, 1].clone()
        offsets[jpeg_rows] = torch.tensor(starts[:-1], dtype=torch.int64)
        offsets[kinds == _PIXELS] += int(starts[-1])
        return torch.cat((resized, dev.pixels)), offsets.to(self.device, non_blocking=True)

    def __call__(self, plan: PlanBatch) -> Tensor:
        """The batch's (B, 3, H, W) uint8 images on the device, channels_last."""
        dev = plan.to(self.device, non_blocking=True)
        height, width = plan.size
        out = torch.empty((len(plan), height, width, 3), dtype=torch.uint8, device=self.device)
        layers = plan.layers.tolist()  # host copies: which sample is what decides the work, without device reads
        if any(layers):
            flat, offsets = self._tile_buffer(plan, dev)
            tile = dev.slots[..., 0]  # (B, 2, 4): a quadrant's tile, -1 for none
            t = tile.clamp(min=0)
            cw, oy, ox = dev.tiles[t, 4], dev.tiles[t, 5], dev.tiles[t, 6]
            base = offsets[t] + ((dev.slots[..., 6] - oy) * cw + (dev.slots[..., 5] - ox)) * 3
            bounds = torch.where((tile < 0)[..., None], 0, dev.slots[..., 1:5])  # an empty quadrant reads as fill
            table = torch.cat((base[..., None], cw[..., None], bounds, torch.zeros_like(cw)[..., None]), -1)
            perspective = bool((plan.inv[:, :, 2, :2] != 0).any())  # a host tensor
            luts = render.hsv_tables(dev.gains)
            render.compose(
                flat, table, dev.inv, dev.split, dev.flip, layers, dev.mix, plan.hsv.tolist(), luts, out,
                perspective, self.max_pixels, self.backend, [tuple(a) for a in plan.albu.tolist()],
            )  # fmt: skip
        if len(plan.host_pos):
            out[plan.host_pos.to(self.device)] = dev.host
        return out.permute(0, 3, 1, 2)


class _Ahead:
    """A batch in the making: its images, the rest of it, and the side stream's event that marks it made."""

    __slots__ = ("batch", "event")

    def __init__(self, batch: tuple, event: Any) -> None:
        self.batch, self.event = batch, event


class DeviceInputLoader(DataLoader):
    """A ``DataLoader`` of planned batches whose iterator yields ``(images on the device, targets, paths,
    shapes)``, making batch k + 1's images before it hands out batch k (see the module docstring).

    Args:
        device_input: the :class:`DeviceInput` that makes the images.
        *args, **kwargs: ``DataLoader``'s (``collate_fn`` is :func:`~yolo5l.data.plan.collate_plans`).
    """

    def __init__(self, *args: Any, device_input: DeviceInput, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device_input = device_input
        cuda = device_input.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_input.device) if cuda else None
        self._waits: list[tuple[Any, Any]] = []  # (main stream reached the batch, its images made): CUDA events

    def __iter__(self) -> Iterator[tuple]:
        return self._ahead(super().__iter__())

    def _make(self, host_batch: tuple) -> _Ahead:
        plan, *rest = host_batch
        if self.stream is None:
            return _Ahead((self.device_input(plan), *rest), None)
        with torch.cuda.stream(self.stream):
            images = self.device_input(plan)
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
        images.record_stream(torch.cuda.current_stream(self.device_input.device))  # freed only after the step used it
        return _Ahead((images, *rest), event)

    def _ahead(self, batches: Iterator[tuple]) -> Iterator[tuple]:
        try:
            current = self._make(next(batches))
        except StopIteration:
            return
        for host_batch in batches:
            following = self._make(host_batch)  # queued on the side stream before this step's kernels
            yield self._hand_over(current)
            current = following
        yield self._hand_over(current)

    def _hand_over(self, ahead: _Ahead) -> tuple:
        if ahead.event is not None:
            main = torch.cuda.current_stream(self.device_input.device)
            reached = torch.cuda.Event(enable_timing=True)
            reached.record(main)
            main.wait_event(ahead.event)  # a wait on the device: the host goes on
            self._waits.append((reached, ahead.event))
        return ahead.batch

    def device_wait_seconds(self) -> float:
        """Seconds the main stream waited for the side stream's images since the last call (CUDA; 0 elsewhere).
        Reads events: call it after a synchronisation (the epoch's end)."""
        waits, self._waits = self._waits, []
        return sum(max(0.0, reached.elapsed_time(made)) for reached, made in waits) / 1e3
