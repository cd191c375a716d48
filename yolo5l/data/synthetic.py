"""The synthetic default dataset: filled shapes on noisy backgrounds, learnable by YOLOv5s in a few epochs.

Four classes of clearly distinct filled shapes, each in its own colour: rectangle (red), ellipse (green),
triangle (blue), cross (yellow). At least one and at most ``max_objects`` non-overlapping objects per image
(:func:`render_sample`), on smoothly varying noisy backgrounds; image sides between ``min_side`` and ``max_side``
(:func:`ensure_synthetic`; not all square, so rectangular validation batches are exercised); saved as JPEG.
Labels are the exact pixel extents of the drawn shapes (the objects never overlap).

Generation is deterministic (image i of a split depends only on (seed, split, i)), happens once (a marker
file written last records the parameters; an flock on ``.<root name>.lock`` beside the root makes concurrent callers,
such as sweep jobs or runs started together, wait for the one generating it), and is atomic: it writes into a
temporary sibling folder that is renamed into place, so concurrent processes never see half a dataset.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

from yolo5l.base.files import file_lock
from yolo5l.data.box_format import xyxy_to_xywhn
from yolo5l.data.layout import DATA_YAML, IMAGES_DIR, LABEL_SUFFIX, LABELS_DIR, format_labels

__all__ = ["COLORS", "MARKER", "NAMES", "ensure_synthetic", "render_sample"]

NAMES = ("rectangle", "ellipse", "triangle", "cross")
COLORS = ((220, 40, 40), (40, 200, 60), (40, 80, 230), (235, 215, 40))  # RGB, one per class
MARKER = ".synthetic.json"  # written last: its presence means the dataset is complete
DEFAULT_ROOT = Path("datasets") / "synthetic"  # under the current directory
DEFAULT_NUM_TRAIN, DEFAULT_NUM_VAL = 512, 128
_SPLITS = {"train": 0, "val": 1}
_FORMAT_VERSION = 1  # bump when the rendering changes, so old datasets are regenerated
_MIN_OBJECT_SIDE = 20  # pixels
_MIN_IMAGE_SIDE = 2 * _MIN_OBJECT_SIDE + 4  # twice the smallest object plus a margin
_MAX_OBJECT_FRACTION = 0.6  # of the shorter image side
_GAP = 2  # pixels kept free around every object, so that objects never touch
_TRIES_PER_OBJECT = 20  # placement attempts per wanted object (rejection sampling)
_WRITE_THREADS = 4
_NOISE = 18  # default amplitude of the uniform pixel noise, grey levels
_MAX_OBJECT_SIDE = 150  # default largest box side, pixels


def _background(rng: np.random.Generator, h: int, w: int, noise: int = _NOISE) -> np.ndarray:
    """Smoothly varying colours (a coarse random grid upsampled) plus uniform pixel noise of +-``noise``, uint8 RGB."""
    gh, gw = rng.integers(2, 6, size=2)
    coarse = rng.integers(60, 200, size=(gh, gw, 3)).astype(np.uint8)
    smooth = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
    noise = rng.integers(-noise, noise + 1, size=(h, w, 3), dtype=np.int16)
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def _draw_mask(cls: int, rng: np.random.Generator, bw: int, bh: int) -> np.ndarray:
    """A filled shape of class ``cls`` filling a (bh, bw) box, as a bool mask of the box."""
    mask = np.zeros((bh, bw), np.uint8)
    x2, y2 = bw - 1, bh - 1
    name = NAMES[cls]
    if name == "rectangle":
        mask[:] = 1
    elif name == "ellipse":
        cv2.ellipse(mask, ((x2 / 2, y2 / 2), (x2, y2), 0.0), 1, thickness=-1)
    elif name == "triangle":  # apex somewhere on the top edge
        apex = int(rng.integers(0, bw))
        cv2.fillPoly(mask, [np.array([[apex, 0], [x2, y2], [0, y2]], np.int32)], 1)
    else:  # cross: two bars a third of the box thick
        tx, ty = max(bw // 3, 3), max(bh // 3, 3)
        cx0, cy0 = (bw - tx) // 2, (bh - ty) // 2
        mask[:, cx0 : cx0 + tx] = 1
        mask[cy0 : cy0 + ty, :] = 1
    return mask.astype(bool)


def render_sample(
    rng: np.random.Generator,
    h: int,
    w: int,
    max_objects: int = 6,
    min_size: int = _MIN_OBJECT_SIDE,
    max_size: int = _MAX_OBJECT_SIDE,
    noise: int = _NOISE,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Render one image.

    Args:
        rng: Random generator (the only source of randomness).
        h: Image height.
        w: Image width.
        max_objects: At most this many objects (at least 1 is always placed).
        min_size: Smallest box side in pixels.
        max_size: Largest box side in pixels (also capped at ``_MAX_OBJECT_FRACTION`` of the shorter image side).
        noise: Amplitude of the background's uniform pixel noise in grey levels (it sets the JPEG file size: at 18 a
            12-megapixel image is ~4 MB at quality 90, at 10 ~2.5 MB, the size of a phone camera's photo).

    Returns:
        (image (h, w, 3) uint8 RGB, labels (n, 5) float32 [cls, cx, cy, w, h] normalised, masks: n bool (h, w)).
        Each label is the exact extent of its mask; masks do not overlap (objects are placed ``_GAP`` px apart).
    """
    img = _background(rng, h, w, noise)
    occupied = np.zeros((h, w), bool)
    classes, corners, masks = [], [], []
    hi = max(min_size + 1, min(max_size, int(_MAX_OBJECT_FRACTION * min(h, w))))
    n_target = int(rng.integers(1, max_objects + 1))
    for _ in range(n_target * _TRIES_PER_OBJECT):  # rejection sampling of non-overlapping boxes
        if len(classes) == n_target:
            break
        cls = int(rng.integers(len(NAMES)))
        bw, bh = (int(v) for v in rng.integers(min_size, hi + 1, size=2))
        if NAMES[cls] in ("cross", "ellipse"):  # keep them from degenerating into bars
            bh = int(np.clip(bh, bw // 2, min(bw * 2, hi)))
        x1, y1 = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
        if occupied[max(y1 - _GAP, 0) : y1 + bh + _GAP, max(x1 - _GAP, 0) : x1 + bw + _GAP].any():
            continue
        local = _draw_mask(cls, rng, bw, bh)
        ys, xs = np.nonzero(local)
        if len(xs) == 0:
            continue
        occupied[y1 : y1 + bh, x1 : x1 + bw] = True
        color = np.clip(np.asarray(COLORS[cls]) + rng.integers(-15, 16, size=3), 0, 255).astype(np.uint8)
        img[y1 : y1 + bh, x1 : x1 + bw][local] = color
        mask = np.zeros((h, w), bool)
        mask[y1 : y1 + bh, x1 : x1 + bw] = local
        # pixel-edge extents of the drawn pixels
        corners.append((x1 + xs.min(), y1 + ys.min(), x1 + xs.max() + 1, y1 + ys.max() + 1))
        classes.append(cls)
        masks.append(mask)
    xywhn = xyxy_to_xywhn(np.asarray(corners, np.float64).reshape(-1, 4), w, h, clip=False)
    labels = np.concatenate((np.asarray(classes, np.float64).reshape(-1, 1), xywhn), 1).astype(np.float32)
    return img, labels, masks


def _image_size(rng: np.random.Generator, min_side: int, max_side: int) -> tuple[int, int]:
    if rng.random() < 0.25:  # some square images too
        s = int(rng.integers(min_side, max_side + 1))
        return s, s
    h, w = rng.integers(min_side, max_side + 1, size=2)
    return int(h), int(w)


def _write_image(root: Path, split: str, i: int, params: dict) -> None:
    rng = np.random.default_rng([params["seed"], _SPLITS[split], i])  # image i depends only on (seed, split, i)
    h, w = _image_size(rng, params["min_side"], params["max_side"])
    img, labels, _ = render_sample(
        rng, h, w, max_size=params.get("max_object_side", _MAX_OBJECT_SIDE), noise=params.get("noise", _NOISE)
    )
    ok, buf = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, params["quality"]])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for synthetic image {split}/{i}")
    stem = f"{split}_{i:06d}"
    (root / IMAGES_DIR / split / f"{stem}.jpg").write_bytes(buf.tobytes())
    (root / LABELS_DIR / split / f"{stem}{LABEL_SUFFIX}").write_text(format_labels(labels.tolist()))


def _write_split(root: Path, split: str, n: int, params: dict) -> None:
    (root / IMAGES_DIR / split).mkdir(parents=True, exist_ok=True)
    (root / LABELS_DIR / split).mkdir(parents=True, exist_ok=True)
    # Threads: JPEG encoding and most numpy work release the GIL; every image has its own generator.
    with ThreadPoolExecutor(max(1, min(_WRITE_THREADS, os.cpu_count() or 1))) as pool:
        list(pool.map(lambda i: _write_image(root, split, i, params), range(n)))


def _data_yaml(names: Sequence[str]) -> str:
    lines = [
        "# Synthetic shapes dataset generated by yolo5l.data.synthetic.ensure_synthetic",
        "path: .",
        *(f"{split}: {IMAGES_DIR}/{split}" for split in _SPLITS),
        "names:",
    ]
    lines += [f"  {i}: {n}" for i, n in enumerate(names)]
    return "\n".join(lines) + "\n"


def _is_complete(root: Path, params: dict) -> bool:
    try:
        return json.loads((root / MARKER).read_text()) == params and (root / DATA_YAML).is_file()
    except (OSError, ValueError):
        return False


def ensure_synthetic(
    root: str | os.PathLike | None = None,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_val: int = DEFAULT_NUM_VAL,
    seed: int = 0,
    min_side: int = 240,
    max_side: int = 400,
    quality: int = 90,
    max_object_side: int = _MAX_OBJECT_SIDE,
    noise: int = _NOISE,
) -> Path:
    """Generate the synthetic dataset once (or reuse it) and return its dataset yaml.

    Args:
        root: Dataset folder; default :data:`DEFAULT_ROOT`.
        num_train: Train images.
        num_val: Val images.
        seed: Generation seed; the same parameters always give the same files.
        min_side: Smallest image side in pixels.
        max_side: Largest image side in pixels.
        quality: JPEG quality.
        max_object_side: Largest object side in pixels (see :func:`render_sample`).
        noise: Background noise amplitude (see :func:`render_sample`).

    Returns:
        Path of ``<root>/data.yaml`` (ultralytics layout: images/{train,val}, labels/{train,val}).
    """
    root = Path(root if root is not None else DEFAULT_ROOT).absolute()
    params = {
        "version": _FORMAT_VERSION,
        "num_train": int(num_train),
        "num_val": int(num_val),
        "seed": int(seed),
        "min_side": int(min_side),
        "max_side": int(max_side),
        "quality": int(quality),
    }
    # Recorded only when not the default, so that datasets generated before these options existed stay valid.
    if max_object_side != _MAX_OBJECT_SIDE:
        params["max_object_side"] = int(max_object_side)
    if noise != _NOISE:
        params["noise"] = int(noise)
    if _is_complete(root, params):
        return root / DATA_YAML
    if min_side < _MIN_IMAGE_SIDE or max_side < min_side:
        raise ValueError(
            f"need {_MIN_IMAGE_SIDE} <= min_side <= max_side, got min_side={min_side}, max_side={max_side}"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    # One process generates; the others wait, then find it complete. Unlocked, each would render the whole dataset,
    # and one could move the copy another had just put in place aside as stale while that one was reading it.
    with file_lock(root.parent / f".{root.name}.lock", f"generating the synthetic dataset {root}"):
        if _is_complete(root, params):
            return root / DATA_YAML
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            _write_split(tmp, "train", num_train, params)
            _write_split(tmp, "val", num_val, params)
            (tmp / DATA_YAML).write_text(_data_yaml(NAMES))
            (tmp / MARKER).write_text(json.dumps(params))  # last: marks the dataset complete
            if root.exists() and not _is_complete(root, params):
                # A stale or partial dataset (other parameters, or an interrupted pre-marker layout): move it aside.
                stale = Path(tempfile.mkdtemp(prefix=f".{root.name}.stale-", dir=root.parent))
                with contextlib.suppress(OSError):
                    os.replace(root, stale / root.name)
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, root)
            except OSError:
                # Without flock (Windows) another process may have renamed its identical copy into place first.
                if not _is_complete(root, params):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root / DATA_YAML


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m yolo5l.data.synthetic --out datasets/synthetic``: generate the dataset and print its yaml path."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_ROOT), help="dataset folder")
    p.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN)
    p.add_argument("--num-val", type=int, default=DEFAULT_NUM_VAL)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(ensure_synthetic(a.out, a.num_train, a.num_val, a.seed))


if __name__ == "__main__":
    main()
