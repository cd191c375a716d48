"""YOLOv5 training loss (ultralytics v7.0 ``ComputeLoss`` semantics) without host synchronisation.

ultralytics builds its targets by boolean-mask filtering (anchor match, neighbour cells), which makes every
intermediate shape depend on the data and costs several device-to-host syncs per step. Here every candidate row
(target x anchor x 5 cell offsets) is kept, with a 0/1 validity weight, so all shapes depend only on the number of
targets N and the loss runs without a single sync (and compiles as one graph).

The CIoU is ``yolo5l_kernels.ciou.ciou_xywh`` (fused forward and backward; ``ciou_backend="reference"`` selects
the pure-torch ``yolo5l_kernels.reference.ciou_xywh``).

Reference: ultralytics/yolov5 v7.0 ``utils/loss.py::ComputeLoss`` and ``ComputeLoss.build_targets``; the gains are
rescaled as ``train.py`` does; the constructor's default gains are those of ``data/hyps/hyp.scratch-low.yaml``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from yolo5l_kernels.ciou import BACKENDS as CIOU_BACKENDS
from yolo5l_kernels.ciou import ciou_xywh

__all__ = ["LOSS_HYP_KEYS", "YOLOv5Loss", "loss_args"]

# ultralytics' objectness balance per level: _BALANCE_3 for the levels P3-P5, else the first nl of the P3-P7 list.
_BALANCE_3 = (4.0, 1.0, 0.4)
_BALANCE_OTHER = (4.0, 1.0, 0.25, 0.06, 0.02)

# Cell offsets of build_targets, in the row order ultralytics uses: centre, left, top, right, bottom, each scaled
# by the bias g. gij = (gxy - offset).long(), so +g picks the cell to the left/top and -g the one to the right/bottom.
_NEIGHBOUR_BIAS = 0.5
_OFFSETS = tuple((_NEIGHBOUR_BIAS * x, _NEIGHBOUR_BIAS * y) for x, y in ((0, 0), (1, 0), (0, 1), (-1, 0), (0, -1)))
_NUM_OFFSETS = len(_OFFSETS)

_FOCAL_ALPHA = 0.25  # YOLOv5's FocalLoss alpha
# train.py rescales the hyp gains from the setting they were tuned for: levels, image size, COCO's class count.
_TUNED_LEVELS, _TUNED_IMGSZ, _TUNED_CLASSES = 3, 640, 80


def _bce_with_logits(logits: Tensor, target: Tensor, pos_weight: Tensor, gamma: float, alpha: float) -> Tensor:
    """Element-wise BCE-with-logits (``pos_weight`` on positives), optionally focal-modulated (gamma > 0).

    Focal: ``bce * (t*alpha + (1-t)*(1-alpha)) * (1 - p_t)**gamma`` with ``p_t = t*sigmoid(x) + (1-t)*(1-sigmoid(x))``.
    Reference: ultralytics/yolov5 v7.0 ``utils/loss.py::FocalLoss``; Lin et al., arXiv:1708.02002.
    """
    loss = F.binary_cross_entropy_with_logits(logits, target, pos_weight=pos_weight, reduction="none")
    if gamma > 0:
        prob = logits.sigmoid()
        p_t = target * prob + (1 - target) * (1 - prob)
        loss = loss * (target * alpha + (1 - target) * (1 - alpha)) * (1.0 - p_t) ** gamma
    return loss


class _Candidates(NamedTuple):
    """All R = 5 * na * N candidate rows of one level, in ultralytics' row order (offset, anchor, target)."""

    image: Tensor  # (R,) long, image index b
    anchor: Tensor  # (R,) long, anchor index a
    gj: Tensor  # (R,) long, cell row (clamped)
    gi: Tensor  # (R,) long, cell column (clamped)
    tbox: Tensor  # (R, 4) float32, target (x - gi, y - gj, w, h) in grid units
    anchor_wh: Tensor  # (R, 2) float32, matched anchor size in grid units
    cls: Tensor  # (R,) long, class id
    valid: Tensor  # (R,) bool: anchor matched and the offset cell is used


class YOLOv5Loss(nn.Module):
    """YOLOv5 v7.0 loss: CIoU box loss, objectness BCE with CIoU targets, class BCE; no host syncs.

    Per level i, with B images, na anchors, an H x W grid and targets scaled to grid units:

    - a (target, anchor) pair matches if ``max(r, 1/r) < anchor_t`` for ``r = t_wh / anchor_wh`` (both w and h);
    - each matched pair uses its centre cell plus the left (``frac(gx) < 0.5 and gx > 1``), top (same on gy),
      right and bottom (same on ``W - gx``, ``H - gy``) neighbours: at most 3 cells;
    - ``gij = (gxy - offset).long()`` clamped to the grid; box target ``(gxy - gij, gwh)``;
      prediction ``pxy = 2 sigmoid - 0.5``, ``pwh = (2 sigmoid)^2 * anchor``;
    - ``lbox += mean(1 - CIoU)``; ``tobj[b, a, gj, gi] = CIoU.detach().clamp(0)``;
      ``lobj += mean_cells(BCE(obj, tobj)) * balance[i]``;
      ``lcls += mean(BCE(cls, t))`` over matched rows x classes with ``t = 1 - eps/2`` at the class, ``eps/2``
      elsewhere (only when num_classes > 1).

    Returned: ``total = (lbox*box + lobj*obj + lcls*cls) * B`` and ``items = [lbox*box, lobj*obj, lcls*cls]``.

    Implementation: every candidate row (target x anchor x 5 offsets) is kept with a 0/1 validity weight, means
    are ``sum(w*x) / clamp(sum(w), 1)``, invalid rows get a harmless dummy box so nothing non-finite can leak,
    and objectness targets are scattered with invalid rows redirected to a dummy trailing slot. Where several
    rows hit the same (image, anchor, cell), the row written last by ultralytics wins, as there (its order is
    offset-major, then anchor, then target; picked deterministically with ``scatter_reduce("amax")`` on the
    row index). No ``.item()``, boolean-mask indexing or ``nonzero``: every shape depends only on N.

    Deviation: everything (including the objectness targets) is float32 even under AMP, where ultralytics
    keeps ``tobj`` in the head's half dtype; the difference is the fp16 rounding of the CIoU targets.

    Targets with a class id outside ``[0, num_classes)`` get no positive class target (ultralytics would
    raise); image indices must lie in ``[0, B)``. Checking either would need a host sync.

    Reference: ultralytics/yolov5 v7.0 ``utils/loss.py::ComputeLoss``; gains as in ``train.py``.

    Args:
        num_classes: number of classes C (heads have 5 + C channels).
        anchors: (nl, na, 2) anchor sizes in grid units of each level (pixels / stride), as the model stores them.
        strides: (nl,) strides of the levels (kept for reference; the loss works in grid units).
        box: box gain from the hyperparameters, before rescaling (``box *= _TUNED_LEVELS / nl``).
        obj: objectness gain before rescaling (``obj *= (imgsz / _TUNED_IMGSZ)^2 * _TUNED_LEVELS / nl``).
        cls: class gain before rescaling (``cls *= num_classes / _TUNED_CLASSES * _TUNED_LEVELS / nl``).
        anchor_t: anchor-multiple threshold of the shape match.
        label_smoothing: epsilon of the class targets (``cp = 1 - eps/2``, ``cn = eps/2``).
        balance: objectness weight per level; None picks ultralytics' default for nl.
        imgsz: training image size in pixels (scales the objectness gain).
        cls_pw: positive weight of the class BCE.
        obj_pw: positive weight of the objectness BCE.
        fl_gamma: focal-loss gamma (0 disables it; alpha is ``_FOCAL_ALPHA`` as in YOLOv5).
        ciou_backend: one of ``yolo5l_kernels.ciou.BACKENDS``, passed to ``yolo5l_kernels.ciou.ciou_xywh``.

    Raises:
        ValueError: on inconsistent shapes or out-of-range hyperparameters.
    """

    anchors: Tensor
    strides: Tensor

    def __init__(
        self,
        num_classes: int,
        anchors: Tensor | Sequence,
        strides: Tensor | Sequence[float],
        box: float = 0.05,
        obj: float = 1.0,
        cls: float = 0.5,
        anchor_t: float = 4.0,
        label_smoothing: float = 0.0,
        balance: Sequence[float] | None = _BALANCE_3,
        imgsz: int = _TUNED_IMGSZ,
        cls_pw: float = 1.0,
        obj_pw: float = 1.0,
        fl_gamma: float = 0.0,
        ciou_backend: str = "auto",
    ) -> None:
        super().__init__()
        anchors = torch.as_tensor(anchors, dtype=torch.float32).detach().clone()
        strides = torch.as_tensor(strides, dtype=torch.float32).detach().clone().reshape(-1)
        if anchors.ndim != 3 or anchors.shape[-1] != 2:
            raise ValueError(
                f"yolo5l/training/loss.py: anchors must be (nl, na, 2) in grid units, got {tuple(anchors.shape)}"
            )
        nl = anchors.shape[0]
        if strides.numel() != nl:
            raise ValueError(
                f"yolo5l/training/loss.py: {strides.numel()} strides for {nl} anchor levels; give one per level"
            )
        if num_classes < 1:
            raise ValueError(f"yolo5l/training/loss.py: num_classes must be >= 1, got {num_classes}")
        if anchor_t <= 1:
            raise ValueError(f"yolo5l/training/loss.py: anchor_t must be > 1 (YOLOv5 uses 4.0), got {anchor_t}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"yolo5l/training/loss.py: label_smoothing must be in [0, 1), got {label_smoothing}")
        if fl_gamma < 0:
            raise ValueError(f"yolo5l/training/loss.py: fl_gamma must be >= 0, got {fl_gamma}")
        if ciou_backend not in CIOU_BACKENDS:
            raise ValueError(
                f"yolo5l/training/loss.py: ciou_backend must be one of {CIOU_BACKENDS}, got {ciou_backend!r}"
            )
        if balance is None:
            balance = _BALANCE_3 if nl == len(_BALANCE_3) else _BALANCE_OTHER[:nl]
        balance = tuple(float(b) for b in balance)
        if len(balance) != nl:
            raise ValueError(
                f"yolo5l/training/loss.py: balance has {len(balance)} entries for {nl} levels; give one per level "
                "or balance=None for ultralytics' default"
            )

        self.num_classes = int(num_classes)
        self.nl, self.na = nl, anchors.shape[1]
        self.anchor_t = float(anchor_t)
        self.balance = balance
        self.label_smoothing = float(label_smoothing)
        self.cp, self.cn = 1.0 - 0.5 * label_smoothing, 0.5 * label_smoothing
        self.fl_gamma, self.fl_alpha = float(fl_gamma), _FOCAL_ALPHA
        # Gains rescaled exactly as ultralytics' train.py does before building ComputeLoss.
        self.box_gain = float(box) * _TUNED_LEVELS / nl
        self.cls_gain = float(cls) * num_classes / _TUNED_CLASSES * _TUNED_LEVELS / nl
        self.obj_gain = float(obj) * (imgsz / _TUNED_IMGSZ) ** 2 * _TUNED_LEVELS / nl
        self.imgsz = int(imgsz)
        self.ciou_backend = ciou_backend
        self._ciou = functools.partial(ciou_xywh, backend=ciou_backend)
        # Non-persistent: derived from the model, so they stay out of checkpoints.
        self.register_buffer("anchors", anchors, persistent=False)
        self.register_buffer("strides", strides, persistent=False)
        self.register_buffer("offsets", torch.tensor(_OFFSETS, dtype=torch.float32), persistent=False)
        self.register_buffer("cls_pos_weight", torch.tensor([float(cls_pw)]), persistent=False)
        self.register_buffer("obj_pos_weight", torch.tensor([float(obj_pw)]), persistent=False)

    @staticmethod  # not a classmethod: `cls` is one of the arguments (the class gain)
    def from_model(model: nn.Module, imgsz: int = _TUNED_IMGSZ, **kwargs: Any) -> YOLOv5Loss:
        """Build the loss for a ``YOLOv5`` model: its class count, anchors and strides, and the constructor's other
        arguments as given (conf/module/yolov5.yaml passes the hyp keys one by one; ``loss_args(hyp)`` picks them
        from a v7.0 hyp mapping).

        Args:
            model: exposes ``anchors`` ((nl, na, 2), grid units), ``stride`` ((nl,)) and ``num_classes``.
            imgsz: training image size in pixels.
            **kwargs: the constructor's arguments (``box``, ``obj``, ``cls``, ``anchor_t``, ``ciou_backend``, ...);
                ``balance`` defaults to None here (ultralytics' default for the model's level count).

        Returns:
            The loss on the device of ``model.anchors``.
        """
        kwargs.setdefault("balance", None)
        loss = YOLOv5Loss(int(model.num_classes), model.anchors.detach(), model.stride.detach(), imgsz=imgsz, **kwargs)
        return loss.to(model.anchors.device)

    @torch.no_grad()
    def set_anchors(self, anchors: Tensor) -> None:
        """Use new anchors, (nl, na, 2) in grid units: the model's after AutoAnchor re-fitted them or a checkpoint
        restored them."""
        if anchors.shape != self.anchors.shape:
            shapes = f"{tuple(anchors.shape)} for a loss of {tuple(self.anchors.shape)}"
            raise ValueError(f"yolo5l/training/loss.py: new anchors of shape {shapes}")
        self.anchors.copy_(anchors)

    def _candidates(self, i: int, targets: Tensor, height: int, width: int) -> _Candidates:
        """All candidate rows of level ``i`` for float32 ``targets`` (N, 6); see :class:`_Candidates`."""
        n, na = targets.shape[0], self.na
        anchors = self.anchors[i]  # (na, 2)
        # Python-scalar multiplies: same float32 result as ultralytics' gain tensor, with no host->device copy.
        gxy = torch.stack((targets[:, 2] * width, targets[:, 3] * height), -1)  # (N, 2)
        gwh = torch.stack((targets[:, 4] * width, targets[:, 5] * height), -1)  # (N, 2)
        gxi = torch.stack((width - gxy[:, 0], height - gxy[:, 1]), -1)  # (N, 2) distance to the far edges

        ratio = gwh[None] / anchors[:, None]  # (na, N, 2)
        match = torch.maximum(ratio, 1 / ratio).amax(-1) < self.anchor_t  # (na, N)
        near = ((gxy % 1 < _NEIGHBOUR_BIAS) & (gxy > 1)).T  # (2, N): left, top
        far = ((gxi % 1 < _NEIGHBOUR_BIAS) & (gxi > 1)).T  # (2, N): right, bottom
        use = torch.cat((torch.ones_like(near[:1]), near, far), 0)  # (5, N)
        valid = use[:, None, :] & match[None]  # (5, na, N)

        gij = (gxy[None] - self.offsets[:, None]).long()  # (5, N, 2), truncation as .long() in ultralytics
        gi = gij[..., 0].clamp(0, width - 1)
        gj = gij[..., 1].clamp(0, height - 1)
        txy = gxy[None] - torch.stack((gi, gj), -1)  # (5, N, 2), box target relative to the (clamped) cell

        k = _NUM_OFFSETS
        shape = (k, na, n)
        rows = k * na * n
        a_idx = torch.arange(na, device=targets.device)
        return _Candidates(
            image=targets[:, 0].long().expand(shape).reshape(rows),
            anchor=a_idx[None, :, None].expand(shape).reshape(rows),
            gj=gj[:, None].expand(shape).reshape(rows),
            gi=gi[:, None].expand(shape).reshape(rows),
            tbox=torch.cat((txy[:, None].expand(*shape, 2), gwh.expand(*shape, 2)), -1).reshape(rows, 4),
            anchor_wh=anchors[None, :, None].expand(*shape, 2).reshape(rows, 2),
            cls=targets[:, 1].long().expand(shape).reshape(rows),
            valid=valid.reshape(rows),
        )

    def forward(self, heads: Sequence[Tensor], targets: Tensor) -> tuple[Tensor, Tensor]:
        """Compute the loss.

        Args:
            heads: nl raw head tensors (B, na, H, W, 5 + C), any float dtype, possibly non-contiguous.
            targets: (N, 6) ``[image index, class, cx, cy, w, h]`` with xywh normalised to [0, 1].

        Returns:
            ``(total, items)``: total (scalar float32, differentiable) ``= items.sum() * B``; items (3,)
            detached ``[box, obj, cls]`` losses, each already multiplied by its gain.

        Raises:
            ValueError: on a wrong number of heads or a head / target shape that does not fit.
        """
        if len(heads) != self.nl:
            raise ValueError(f"yolo5l/training/loss.py: got {len(heads)} heads for {self.nl} anchor levels")
        no = 5 + self.num_classes
        for i, pi in enumerate(heads):
            if pi.ndim != 5 or pi.shape[1] != self.na or pi.shape[-1] != no:
                raise ValueError(
                    f"yolo5l/training/loss.py: head {i} has shape {tuple(pi.shape)}, "
                    f"expected (B, {self.na}, H, W, {no})"
                )
        if targets.ndim != 2 or targets.shape[-1] != 6:
            raise ValueError(
                "yolo5l/training/loss.py: targets must be (N, 6) [image, class, cx, cy, w, h], "
                f"got {tuple(targets.shape)}"
            )
        device = heads[0].device
        # The loss runs in float32 even when called inside an autocast region.
        with torch.autocast(device_type=device.type, enabled=False):
            return self._loss(heads, targets.to(device=device, dtype=torch.float32))

    def _loss(self, heads: Sequence[Tensor], targets: Tensor) -> tuple[Tensor, Tensor]:
        device = targets.device
        batch = heads[0].shape[0]
        zero = torch.zeros((), device=device)
        lbox, lobj, lcls = zero, zero, zero
        for i, pi in enumerate(heads):
            _, na, height, width, _ = pi.shape
            cand = self._candidates(i, targets, height, width)
            rows = cand.valid.shape[0]
            weight = cand.valid.float()  # (R,)
            n_valid = weight.sum().clamp(min=1)

            ps = pi[cand.image, cand.anchor, cand.gj, cand.gi].float()  # (R, 5 + C) gathered predictions
            pxy = ps[:, :2].sigmoid() * 2 - 0.5
            pwh = (ps[:, 2:4].sigmoid() * 2) ** 2 * cand.anchor_wh
            valid_col = cand.valid[:, None]
            # Invalid rows compare a dummy box with itself: always finite, and their weight is 0 anyway.
            pbox = torch.where(valid_col, torch.cat((pxy, pwh), 1), 1.0)
            tbox = torch.where(valid_col, cand.tbox, 1.0)
            iou = self._ciou(pbox, tbox)  # (R,)
            lbox = lbox + ((1.0 - iou) * weight).sum() / n_valid

            # Objectness targets: for each cell the highest row index wins (= ultralytics' last write); invalid
            # rows and losing duplicates go to a dummy trailing slot that is dropped.
            cells = batch * na * height * width
            lin = ((cand.image * na + cand.anchor) * height + cand.gj) * width + cand.gi
            lin = torch.where(cand.valid, lin, cells)
            row_id = torch.arange(rows, device=device)
            winner = torch.full((cells + 1,), -1, dtype=torch.long, device=device)
            winner = winner.scatter_reduce(0, lin, row_id, reduce="amax", include_self=True)
            lin = torch.where(winner[lin] == row_id, lin, cells)
            tobj = torch.zeros(cells + 1, device=device)
            tobj = tobj.scatter(0, lin, iou.detach().clamp(min=0))[:cells].view(batch, na, height, width)
            obj_bce = _bce_with_logits(pi[..., 4].float(), tobj, self.obj_pos_weight, self.fl_gamma, self.fl_alpha)
            lobj = lobj + obj_bce.mean() * self.balance[i]

            if self.num_classes > 1:
                classes = torch.arange(self.num_classes, device=device)
                tcls = torch.where(cand.cls[:, None] == classes, self.cp, self.cn)  # (R, C)
                cls_bce = _bce_with_logits(ps[:, 5:], tcls, self.cls_pos_weight, self.fl_gamma, self.fl_alpha)
                lcls = lcls + (cls_bce.sum(1) * weight).sum() / (n_valid * self.num_classes)

        lbox = lbox * self.box_gain
        lobj = lobj * self.obj_gain
        lcls = lcls * self.cls_gain
        items = torch.stack((lbox, lobj, lcls)).detach()
        return (lbox + lobj + lcls) * batch, items

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, nl={self.nl}, na={self.na}, gains=(box={self.box_gain:.4g}, "
            f"obj={self.obj_gain:.4g}, cls={self.cls_gain:.4g}), anchor_t={self.anchor_t}, balance={self.balance}, "
            f"label_smoothing={self.label_smoothing}, fl_gamma={self.fl_gamma}"
        )


#: The loss's keys in a v7.0 hyp mapping (conf/hyp/*.yaml, data/hyps/hyp.*.yaml).
LOSS_HYP_KEYS = ("box", "obj", "cls", "anchor_t", "label_smoothing", "cls_pw", "obj_pw", "fl_gamma")


def loss_args(hyp: Mapping[str, Any]) -> dict[str, float]:
    """The `YOLOv5Loss` arguments a hyp mapping holds (its other keys, learning rates and augmentation, are left
    out): `YOLOv5Loss.from_model(model, imgsz, **loss_args(hyp))`."""
    return {k: float(hyp[k]) for k in LOSS_HYP_KEYS if hyp.get(k) is not None}
