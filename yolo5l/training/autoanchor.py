"""AutoAnchor: how well a model's anchors fit a dataset's boxes, and a re-fit with k-means plus evolution.

Definitions (YOLOv5's; ``thr`` is the hyperparameter ``anchor_t``, 4.0): a box (w, h) and an anchor (aw, ah) have
the ratio metric ``x = min(w / aw, aw / w, h / ah, ah / h)``, and the loss can assign the box to the anchor when
``x > 1 / thr``. Over the boxes of a dataset, at the training size:

- best possible recall (BPR): the share of boxes whose best anchor passes, ``mean(max_a x > 1 / thr)``;
- anchors per target (AAT): the mean number of anchors a box passes, ``mean(sum_a (x > 1 / thr))``;
- fitness (what the re-fit maximises): ``mean(best * (best > 1 / thr))`` with ``best = max_a x``.

The metric is computed as YOLOv5 computes it (float32, ``r = w / aw``, ``min(r, 1 / r)``), so that boxes exactly at
the threshold fall on the same side, for many candidate anchor sets in one tensor operation.

Reference: ultralytics/yolov5 v7.0 `utils/autoanchor.py::check_anchors` (BPR and AAT on the training labels with a
0.9-1.1 scale jitter per image; re-fit when BPR <= 0.98, kept only when the BPR improves) and
`utils/autoanchor.py::kmean_anchors` (boxes with no side >= 2 px dropped, k-means on whitened (w, h), then a
mutation-and-selection search on the fitness).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BPR_THRESHOLD",
    "AnchorCheck",
    "anchor_fitness",
    "anchor_metrics",
    "check_anchors",
    "evolve_anchors",
    "kmean_anchors",
    "kmeans",
    "label_wh",
]

#: The anchors are re-fitted when the BPR is at or below this (YOLOv5's threshold).
BPR_THRESHOLD = 0.98
# Memory bound of one fitness evaluation: candidates x boxes x anchors floats per chunk.
_CHUNK_ELEMENTS = 1 << 22


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch single-threaded inside: the tensors here are small (anchors x boxes), so the intra-op pool's
    fork/join costs more than it saves, and far more on a busy machine (2 s single-threaded, 30 s with 2 threads
    for 94k boxes on 2 contended cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def label_wh(
    labels: Sequence[np.ndarray],
    shapes_hw: np.ndarray,
    imgsz: int,
    jitter: tuple[float, float] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The (w, h) of every labelled box in pixels at the training size (each image's long side = ``imgsz``).

    Args:
        labels: Per image, (n, 5) rows ``[cls, cx, cy, w, h]`` normalised to the image.
        shapes_hw: (images, 2) original ``[height, width]``.
        imgsz: Training image size.
        jitter: Scale range drawn once per image (YOLOv5's BPR check uses (0.9, 1.1)); None for none.
        generator: The draws' generator (seeded by the caller).

    Returns:
        (N, 2) float32 (w, h) pixels.
    """
    shapes = np.asarray(shapes_hw, dtype=np.float64).reshape(-1, 2)[:, ::-1]  # (w, h)
    size = imgsz * shapes / shapes.max(1, keepdims=True)  # (images, 2) the resized image
    if jitter is not None:
        lo, hi = jitter
        draws = torch.rand(len(size), 1, generator=generator, dtype=torch.float64).numpy()
        size = size * (lo + (hi - lo) * draws)
    counts = np.array([len(lb) for lb in labels], dtype=np.int64)
    if counts.sum() == 0:
        return torch.zeros(0, 2)
    wh = np.concatenate([np.asarray(lb, dtype=np.float64).reshape(-1, 5)[:, 3:5] for lb in labels])
    return torch.from_numpy(wh * np.repeat(size, counts, axis=0)).float()


def _ratio_metric(wh: Tensor, k: Tensor) -> Tensor:
    """(..., n, N) ratio metric between anchor sets ``k`` (..., n, 2) and boxes ``wh`` (N, 2), float32.

    Boxes run along the last axis, so a reduction over anchors (dim -2) is an element-wise min or max of rows.
    """
    rw = wh[:, 0] / k[..., :, 0, None]  # (..., n, N)
    rh = wh[:, 1] / k[..., :, 1, None]
    xw = torch.minimum(rw, rw.reciprocal())
    return torch.minimum(xw, torch.minimum(rh, rh.reciprocal(), out=rh), out=xw)


def anchor_metrics(wh: Tensor, anchors: Tensor, thr: float = 4.0) -> tuple[float, float]:
    """BPR and anchors per target of ``anchors`` on the boxes ``wh`` (see the module docstring).

    Args:
        wh: (N, 2) box sizes in pixels.
        anchors: (..., 2) anchor sizes in pixels (any leading shape; flattened).
        thr: ``anchor_t``.

    Returns:
        ``(bpr, aat)`` as Python floats; (0, 0) without boxes.
    """
    if len(wh) == 0:
        return 0.0, 0.0
    wh, k = wh.float(), anchors.reshape(-1, 2).float()
    passes = torch.cat([_ratio_metric(c, k) > 1 / thr for c in wh.split(1 << 18)], dim=-1)  # (n, N)
    return float(passes.any(0).double().mean()), float(passes.sum(0).double().mean())


def anchor_fitness(wh: Tensor, anchors: Tensor, thr: float = 4.0) -> Tensor:
    """Fitness of one anchor set (n, 2) or of many at once (P, n, 2) on the boxes ``wh`` (N, 2), in pixels.

    Returns:
        A 0-dim tensor, or (P,), float32: ``mean(best * (best > 1 / thr))`` with ``best`` the box's best ratio metric.
    """
    single = anchors.ndim == 2
    k = anchors[None] if single else anchors
    wh, k = wh.float(), k.float()
    total = torch.zeros(len(k), dtype=torch.float64)
    step = max(1, _CHUNK_ELEMENTS // max(1, k.shape[0] * k.shape[1]))
    for chunk in wh.split(step):
        best = _ratio_metric(chunk, k).amax(-2)  # (P, n_chunk) the metric of each box's best anchor
        total += torch.where(best > 1 / thr, best, 0.0).sum(-1, dtype=torch.float64)
    fit = (total / max(1, len(wh))).float()
    return fit[0] if single else fit


def kmeans(
    points: Tensor,
    k: int,
    restarts: int = 30,
    generator: torch.Generator | None = None,
    thresh: float = 1e-5,
    max_iter: int = 100,
) -> Tensor | None:
    """Lloyd's k-means, the lowest mean distortion of ``restarts`` runs, each from ``k`` distinct random points.

    A run stops when the mean distance to the nearest centroid changes by at most ``thresh`` (scipy's
    ``scipy.cluster.vq.kmeans`` protocol) or after ``max_iter`` steps; a centroid that loses all its points keeps
    its place.

    Returns:
        (k, 2) centroids, or None with fewer than ``k`` distinct points.
    """
    points = points.float()
    if len(torch.unique(points, dim=0)) < k:
        return None
    best, best_dist = None, math.inf
    for _ in range(restarts):
        centroids, dist = _lloyd(points, points[torch.randperm(len(points), generator=generator)[:k]], thresh, max_iter)
        if dist < best_dist:
            best, best_dist = centroids, dist
    return best


def _lloyd(points: Tensor, centroids: Tensor, thresh: float, max_iter: int) -> tuple[Tensor, float]:
    """Lloyd iterations from ``centroids`` (k, 2) on ``points`` (N, 2): (final centroids, mean distance)."""
    k = len(centroids)
    prev = math.inf
    for _ in range(max_iter):
        dist, idx = _sq_distance(points, centroids).min(0)  # (N,): squared distance to, index of, the nearest
        mean = float(dist.sqrt_().mean(dtype=torch.float64))  # one host read per iteration: the stop test
        counts = torch.bincount(idx, minlength=k).to(points.dtype)[:, None]
        sums = torch.zeros_like(centroids).index_add_(0, idx, points)
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        if abs(prev - mean) <= thresh:
            break
        prev = mean
    return centroids, mean


def _sq_distance(points: Tensor, centroids: Tensor) -> Tensor:
    """(k, N) squared distances between points (N, 2) and centroids (k, 2)."""
    dx = (points[:, 0] - centroids[..., 0, None]).square_()
    return dx.add_((points[:, 1] - centroids[..., 1, None]).square_())


def evolve_anchors(
    wh: Tensor,
    anchors: Tensor,
    thr: float = 4.0,
    generations: int = 100,
    population: int = 10,
    generator: torch.Generator | None = None,
    mutation_prob: float = 0.9,
    sigma: float = 0.1,
    on_generation: Callable[[int, float], None] | None = None,
) -> tuple[Tensor, float]:
    """Improve an anchor set by mutation and selection on the fitness: each generation draws ``population`` mutants
    of the current best and evaluates them together; the best mutant replaces the parent when strictly fitter.

    A mutant multiplies each anchor side, with probability ``mutation_prob``, by
    ``clip(1 + u * sigma * N(0, 1), 0.3, 3.0)`` (u uniform in [0, 1), one per mutant), and keeps sides >= 2 px;
    YOLOv5 draws one mutant per generation (``population=1``) for 1000 generations.

    Returns:
        ``(anchors (n, 2), fitness)``.
    """
    k = anchors.float().clone()
    f = float(anchor_fitness(wh, k, thr))
    for g in range(generations):
        shape = (population, *k.shape)
        mask = torch.rand(shape, generator=generator) < mutation_prob
        scale = torch.rand(population, 1, 1, generator=generator)
        noise = torch.randn(shape, generator=generator)
        factors = (mask * scale * noise * sigma + 1).clamp(0.3, 3.0)
        mutants = (k * factors).clamp(min=2.0)  # (P, n, 2)
        fits = anchor_fitness(wh, mutants, thr)
        i = int(fits.argmax())  # one host read per generation: the selection is a decision
        if float(fits[i]) > f:
            f, k = float(fits[i]), mutants[i].clone()
        if on_generation is not None:
            on_generation(g, f)
    return k, f


def _sort_by_area(k: Tensor) -> Tensor:
    return k[torch.argsort(k.prod(1))]


def kmean_anchors(
    wh0: Tensor,
    n: int,
    img_size: int,
    thr: float = 4.0,
    generations: int = 100,
    population: int = 10,
    generator: torch.Generator | None = None,
    max_boxes: int | None = 10000,
    log: Callable[[str], None] | None = None,
) -> Tensor:
    """``n`` anchors fitted to the boxes ``wh0`` (pixels at the training size): k-means on the whitened sizes of the
    boxes with a side of at least 2 px (random sizes when k-means cannot give ``n``), then ``evolve_anchors``.

    With more than ``max_boxes`` such boxes, both run on a random sample of ``max_boxes`` of them (drawn from
    ``generator``): the fitness of a sample that size is within a fraction of a percent of the full set's, and the
    search takes seconds instead of minutes on 100k boxes. None uses every box.

    Returns:
        (n, 2) float32 anchors in pixels, smallest area first.
    """
    with _one_thread():
        return _kmean_anchors(wh0, n, img_size, thr, generations, population, generator, max_boxes, log)


def _kmean_anchors(
    wh0: Tensor,
    n: int,
    img_size: int,
    thr: float,
    generations: int,
    population: int,
    generator: torch.Generator | None,
    max_boxes: int | None,
    log: Callable[[str], None] | None,
) -> Tensor:
    say = log or (lambda _s: None)
    small = int((wh0 < 3.0).any(1).sum())
    if small:
        say(f"{small} of {len(wh0)} labels are smaller than 3 pixels (extremely small objects)")
    wh = wh0[(wh0 >= 2.0).any(1)].float()
    if max_boxes is not None and len(wh) > max_boxes:
        wh = wh[torch.randperm(len(wh), generator=generator)[:max_boxes]]
    k = None
    if len(wh) >= n:
        s = wh.std(0).clamp(min=1e-6)  # whitening sigmas
        k = kmeans(wh / s, n, generator=generator)
        k = None if k is None else (k * s).float()
    if k is None:
        say(f"k-means cannot place {n} anchors on {len(wh)} boxes: evolving from random sizes")
        k = torch.sort(torch.rand(n * 2, generator=generator))[0].reshape(n, 2) * img_size
    k, _ = evolve_anchors(wh if len(wh) else wh0.float(), _sort_by_area(k), thr, generations, population, generator)
    return _sort_by_area(k).float()


@dataclass
class AnchorCheck:
    """What ``check_anchors`` found, in pixels; ``anchors`` is None when the current ones are kept."""

    boxes: int
    bpr: float
    aat: float
    new_bpr: float | None = None
    new_aat: float | None = None
    anchors: Tensor | None = None
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)


def check_anchors(
    anchors_px: Tensor,
    labels: Sequence[np.ndarray],
    shapes_hw: np.ndarray,
    imgsz: int,
    thr: float = 4.0,
    seed: int = 0,
    generations: int = 100,
    population: int = 10,
    max_boxes: int | None = 10000,
) -> AnchorCheck:
    """YOLOv5's AutoAnchor check: BPR and AAT of the current anchors on the training boxes (scale-jittered 0.9-1.1
    per image, drawn from ``seed``); at or below ``BPR_THRESHOLD``, re-fit (``kmean_anchors``) and keep the result only
    when its BPR on the same boxes is higher.

    Args:
        anchors_px: (nl, na, 2) current anchors in pixels.
        labels: Per training image, (n, 5) ``[cls, cx, cy, w, h]`` normalised.
        shapes_hw: (images, 2) original ``[height, width]``.
        imgsz: Training image size.
        thr: ``anchor_t``.
        seed: Seeds every draw (jitter, k-means starts, mutations): the same inputs give the same anchors.
        generations: Evolution generations.
        population: Mutants evaluated together per generation.
        max_boxes: Boxes the re-fit samples at most (see ``kmean_anchors``); the BPR checks use every box.

    Returns:
        An ``AnchorCheck`` whose ``anchors`` are the new (nl, na, 2) pixel anchors, or None.
    """
    with _one_thread():
        return _check_anchors(
            anchors_px.detach().float().cpu(), labels, shapes_hw, imgsz, thr, seed, generations, population, max_boxes
        )


def _check_anchors(
    anchors_px: Tensor,
    labels: Sequence[np.ndarray],
    shapes_hw: np.ndarray,
    imgsz: int,
    thr: float,
    seed: int,
    generations: int,
    population: int,
    max_boxes: int | None,
) -> AnchorCheck:
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(int(seed))
    wh = label_wh(labels, shapes_hw, imgsz, jitter=(0.9, 1.1), generator=generator)
    bpr, aat = anchor_metrics(wh, anchors_px, thr)
    result = AnchorCheck(boxes=len(wh), bpr=bpr, aat=aat)
    head = f"{aat:.2f} anchors/target, {bpr:.3f} Best Possible Recall (BPR) on {len(wh)} boxes at {imgsz} px"
    if len(wh) == 0 or bpr > BPR_THRESHOLD:
        why = "no labelled boxes to check" if len(wh) == 0 else "the anchors fit the dataset"
        result.lines.append(f"{head}: {why}")
        return result
    na = anchors_px.numel() // 2
    result.lines.append(f"{head}: a poor fit, re-fitting {na} anchors (k-means + {generations} generations)")
    wh0 = label_wh(labels, shapes_hw, imgsz)
    new = kmean_anchors(wh0, na, imgsz, thr, generations, population, generator, max_boxes, log=result.lines.append)
    new_bpr, new_aat = anchor_metrics(wh, new, thr)
    result.new_bpr, result.new_aat = new_bpr, new_aat
    result.seconds = time.perf_counter() - t0
    sizes = ", ".join(f"{round(float(w))},{round(float(h))}" for w, h in new)
    if new_bpr > bpr:
        result.anchors = new.reshape(anchors_px.shape)
        result.lines.append(
            f"new anchors: {new_aat:.2f} anchors/target, {new_bpr:.3f} BPR (was {bpr:.3f}), found in "
            f"{result.seconds:.1f} s; training and every weights file of the run use them: {sizes}"
        )
    else:
        result.lines.append(f"the re-fit reaches BPR {new_bpr:.3f} (was {bpr:.3f}): keeping the original anchors")
    return result
