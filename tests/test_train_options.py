"""v7.0 train.py's data options as `data.*` keys: single_cls, rect, image_weights, multi_scale, quad.

Each is checked against ultralytics/yolov5 v7.0's definition: hand-derived values here, and, where the reference
environment exists (`.refvenv/` at the repository root with yolov5==7.0.14, see scripts/bench_reference.py), against
v7.0's own `labels_to_class_weights`, `labels_to_image_weights` and `LoadImagesAndLabels.collate_fn4`.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from yolo5l.data.batch_transforms import TrainBatchTransform, multi_scale_shape, quad_images, quad_targets
from yolo5l.data.datamodule import YOLODataModule
from yolo5l.data.dataset import collate_fn
from yolo5l.data.image_weights import ImageWeights, class_maps, class_weights, image_weights
from yolo5l.data.samplers import MOSAIC_PARTNERS, ShardSampler, rect_shard

IMGSZ = 128
REF_PYTHON = Path(__file__).resolve().parents[1] / ".refvenv" / "bin" / "python"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "synthetic"
    return {"root": str(root), "num_train": 24, "num_val": 10, "seed": 0, "min_side": 80, "max_side": 200}


def make_dm(synthetic, **kw) -> YOLODataModule:
    args = {"synthetic": synthetic, "imgsz": IMGSZ, "batch_size": 4, "num_workers": 0, "cache": "none"}
    args.update(kw)
    return YOLODataModule(**args)


def stub_trainer(epoch: int = 0, batch_idx: int = 0, rank: int = 0, training: bool = True) -> SimpleNamespace:
    """What the datamodule's batch hooks read of a Trainer, for a batch `batch_idx` of `epoch` on `rank`."""
    loop = SimpleNamespace(batch_idx=batch_idx - 1, batch_progress=None)  # the batch is moved before it counts
    stride = torch.tensor([8.0, 16.0, 32.0])
    return SimpleNamespace(
        training=training, current_epoch=epoch, global_rank=rank, world_size=2,
        fit_loop=SimpleNamespace(epoch_loop=loop),
        lightning_module=SimpleNamespace(model=SimpleNamespace(stride=stride)),
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
    )  # fmt: skip


QUAD_DRAWS = ([0.9, 0.1], [0.1, 0.9], [0.9, 0.9])  # v7.0's random.random() per group: < 0.5 upscales
MAPS = [0.5, 0.0, 1.0, 0.25]
_REFERENCE = """
import json, random, sys
import numpy as np, torch
from yolov5.utils.dataloaders import LoadImagesAndLabels
from yolov5.utils.general import labels_to_class_weights, labels_to_image_weights
folder = sys.argv[1]
d = json.load(open(folder + "/in.json"))
labels = [np.array(x, dtype=np.float32).reshape(-1, 5) for x in d["labels"]]
cwm = labels_to_class_weights(labels, 4) * 4  # train.py: model.class_weights
cw = cwm.cpu().numpy() * (1 - np.array(d["maps"])) ** 2 / 4
out = {"class_weights": cwm.tolist(), "image_weights": labels_to_image_weights(labels, 4, cw).tolist()}
items = torch.load(folder + "/items.pt")
quads = []
for draws in d["draws"]:
    it = iter(draws)
    random.random = lambda: next(it)
    im, lb, _, _ = LoadImagesAndLabels.collate_fn4([(i.clone(), l.clone(), p, s) for i, l, p, s in items])
    quads.append((im, lb))
torch.save(quads, folder + "/quads.pt")
json.dump(out, open(folder + "/out.json", "w"))
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """v7.0's own results, computed once in the reference environment: image weights of LABELS with MAPS, and
    collate_fn4 of `_items(10)` under each of QUAD_DRAWS."""
    if not REF_PYTHON.exists():
        pytest.skip("no .refvenv with yolov5==7.0.14 (scripts/bench_reference.py says how to make it)")
    folder = tmp_path_factory.mktemp("reference")
    (folder / "in.json").write_text(
        json.dumps({"labels": [lb.tolist() for lb in LABELS], "maps": MAPS, "draws": QUAD_DRAWS})
    )
    torch.save(_items(10), folder / "items.pt")
    proc = subprocess.run([str(REF_PYTHON), "-c", _REFERENCE, str(folder)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads((folder / "out.json").read_text()), "quads": torch.load(folder / "quads.pt")}


# --------------------------------------------------------------------------------------------- single_cls
def test_single_cls_one_class_named_item_and_every_label_class_zero(synthetic):
    dm = make_dm(synthetic, single_cls=True)
    assert (dm.num_classes, dm.names) == (1, ["item"])
    assert make_dm(synthetic).num_classes == 4
    dm.setup("fit")
    assert all((lb[:, 0] == 0).all() for lb in dm.train_dataset.labels + dm.val_dataset.labels)
    assert sum(len(lb) for lb in dm.train_dataset.labels) > 0
    # the label index keeps its classes (another datamodule over the same scan sees them)
    assert any((np.asarray(lb)[:, 0] > 0).any() for lb in dm._scan("train").labels)
    _, targets, _, _ = next(iter(dm.train_dataloader()))
    assert len(targets)
    assert (targets[:, 1] == 0).all()


def test_single_cls_keeps_the_name_of_a_one_class_dataset(synthetic, monkeypatch):
    dm = make_dm(synthetic, single_cls=True)
    monkeypatch.setattr(type(dm), "spec", property(lambda self: SimpleNamespace(names=["cell"], num_classes=1)))
    assert (dm.num_classes, dm.names) == (1, ["cell"])  # v7.0: names = {0: 'item'} only when nc != 1


def test_single_cls_validation_is_class_agnostic(tiny_module):
    """YOLOv5 val.py --single-cls: NMS across classes (agnostic=single_cls) and every detection's class set to 0."""

    def detect(module, boxes):
        module._eval_model = SimpleNamespace(decode=lambda heads: heads)  # `_detect` decodes with the eval model
        return module._detect(boxes)[0]

    # two overlapping boxes of different classes (IoU 0.9): class-aware NMS keeps both, agnostic NMS one
    pred = torch.tensor([[[50.0, 50, 20, 20, 0.9, 0.95, 0.05], [51.0, 50, 20, 20, 0.8, 0.05, 0.95]]])
    both = detect(tiny_module(), pred)
    assert sorted(both[:, 5].tolist()) == [0.0, 1.0]
    one = detect(tiny_module(single_cls=True), pred)
    assert len(one) == 1
    assert one[0, 5] == 0
    assert one[0, 4] == pytest.approx(0.9 * 0.95)


def test_single_cls_module_takes_one_name_for_a_model_of_any_class_count(tiny_module):
    from yolo5l.eval.metrics import DetectionMAP
    from yolo5l.training.module import YOLOv5Module

    model = tiny_module().model  # 2 classes
    module = YOLOv5Module(model, model, None, None, DetectionMAP(), names=["item"], single_cls=True)
    assert module.names == ["item"]
    with pytest.raises(ValueError, match="class names"):
        YOLOv5Module(model, model, None, None, DetectionMAP(), names=["item"])


# --------------------------------------------------------------------------------------------- rect
@pytest.mark.parametrize(
    ("n", "batch", "world"), [(10, 4, 1), (10, 4, 2), (10, 4, 3), (9, 3, 2), (3, 4, 2), (25, 4, 4)]
)
def test_rect_shard_whole_batches_equal_counts(n, batch, world):
    parts = [rect_shard(n, batch, r, world) for r in range(world)]
    if world == 1:
        assert parts[0].tolist() == list(range(n))  # v7.0 --rect on one device: in order
    nb = math.ceil(n / batch)
    assert {len(range(0, len(p), batch)) for p in parts} == {math.ceil(nb / world)}  # the same batch count
    for part in parts:
        for i in range(0, len(part), batch):  # a loader of `batch` never mixes two rectangular batches
            chunk = part[i : i + batch]
            assert len({int(j) // batch for j in chunk}) == 1
            assert chunk.tolist() == list(range(chunk[0], chunk[0] + len(chunk)))
    assert set(np.concatenate(parts).tolist()) == set(range(n))  # every image trains


def test_rect_shard_hand_values():
    assert rect_shard(10, 4, 0, 2).tolist() == [0, 1, 2, 3, 8, 9]
    assert rect_shard(10, 4, 1, 2).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]  # wraps around to batch 0


def test_rect_training_batches_v7_shapes_in_order_without_mosaic(synthetic):
    """v7.0 --rect: images sorted by h/w, batch i letterboxed to ceil(shape_i * imgsz / 32 + pad) * 32 with pad 0.0
    for training (`create_dataloader`'s default), shape_i = [max h/w, 1] when all h/w < 1, [1, 1 / min h/w] when
    all > 1, else [1, 1]; no shuffle, no mosaic; the other augmentations stay."""
    dm = make_dm(synthetic, rect=True, hyp={"fliplr": 0.0, "hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0})
    dm.setup("fit")
    ds = dm.train_dataset
    hw = np.asarray(dm._scan("train").shapes, dtype=float)
    ar = np.sort(hw[:, 0] / hw[:, 1])
    expect = []
    for b in range(math.ceil(len(ar) / 4)):
        lo, hi = ar[b * 4 : (b + 1) * 4].min(), ar[b * 4 : (b + 1) * 4].max()
        shape = [hi, 1] if hi < 1 else [1, 1 / lo] if lo > 1 else [1, 1]
        expect.append([math.ceil(s * IMGSZ / 32 + 0.0) * 32 for s in shape])
    assert ds.batch_shapes.tolist() == expect
    assert len({tuple(s) for s in expect}) > 1  # the data has batches of different shapes
    assert ar.tolist() == sorted((ds.shapes[:, 0] / ds.shapes[:, 1]).tolist())

    loader = dm.train_dataloader()
    for epoch in (0, 1):
        dm.train_sampler.set_epoch(epoch)
        batches = list(loader)
        assert [tuple(b[0].shape[2:]) for b in batches] == [tuple(s) for s in expect]
        assert all(s is not None for b in batches for s in b[3])  # letterboxed, never a mosaic
        assert [p for b in batches for p in b[2]] == ds.im_files  # in order, every epoch


def test_rect_and_image_weights_exclude_each_other(synthetic):
    with pytest.raises(ValueError, match="exclude"):
        make_dm(synthetic, rect=True, image_weights=True)


# --------------------------------------------------------------------------------------------- image weights
LABELS = [
    np.array([[0, 0.5, 0.5, 0.1, 0.1], [0, 0.2, 0.2, 0.1, 0.1], [1, 0.3, 0.3, 0.1, 0.1]], np.float32),
    np.array([[0, 0.5, 0.5, 0.1, 0.1]], np.float32),
    np.zeros((0, 5), np.float32),
    np.array([[2, 0.5, 0.5, 0.1, 0.1], [0, 0.5, 0.5, 0.2, 0.2]], np.float32),
]  # class counts 0: 4, 1: 1, 2: 1, 3: none


def test_class_and_image_weights_hand_values():
    # 1 / counts (a class without labels counts 1) = [1/4, 1, 1, 1], normalised (sum 13/4), times nc = 4
    cw = class_weights(LABELS, 4)
    assert cw.dtype == np.float32
    np.testing.assert_allclose(cw, np.array([1, 4, 4, 4]) / 13 * 4, rtol=1e-6)
    maps = np.array([0.5, 0.0, 1.0, 0.25])
    per_class = cw * (1 - maps) ** 2 / 4  # v7.0 train.py: cw = class_weights * (1 - maps) ** 2 / nc
    iw = image_weights(LABELS, 4, per_class)
    np.testing.assert_allclose(iw, [2 * per_class[0] + per_class[1], per_class[0], 0.0, per_class[2] + per_class[0]])
    weights = ImageWeights(LABELS, 4)
    np.testing.assert_allclose(weights(), image_weights(LABELS, 4, cw / 4))  # maps start at 0
    weights.update_maps(maps)
    np.testing.assert_allclose(weights(), iw)
    restored = ImageWeights(LABELS, 4)
    restored.load_state_dict(weights.state_dict())
    np.testing.assert_array_equal(restored(), weights())


def test_class_maps_fill_classes_without_validation_labels_with_the_mean():
    # v7.0 val.py: maps = np.zeros(nc) + map; maps[c] = ap[i] for the classes with labels
    np.testing.assert_allclose(class_maps(np.array([0, 2]), np.array([0.2, 0.6]), 4), [0.2, 0.4, 0.6, 0.4])


@pytest.mark.reference
def test_image_weights_match_v7(reference):
    np.testing.assert_array_equal(class_weights(LABELS, 4), np.array(reference["class_weights"], np.float32))
    weights = ImageWeights(LABELS, 4)
    weights.update_maps(np.array(MAPS))
    np.testing.assert_allclose(weights(), reference["image_weights"], rtol=1e-12)


def test_weighted_sampler_draws_by_weight_deterministically():
    w = np.array([0.0, 1.0, 2.0, 4.0, 1.0])
    s = ShardSampler(5, seed=3)
    s.set_image_weights(lambda: w)
    s.set_epoch(1)
    first = list(s)
    assert first == list(s)  # a pure function of (seed, epoch, rank) and the weights
    s.set_epoch(2)
    assert first != list(s)
    assert len(first) == 5
    index, mosaic, key, partners = first[0]
    assert mosaic is True
    assert key == (3, 1, 0, 0)
    assert len(partners) == MOSAIC_PARTNERS
    assert [item[2] for item in first] == [(3, 1, 0, pos) for pos in range(5)]  # a drawn-twice image: own key
    counts = Counter()
    for epoch in range(400):
        s.set_epoch(epoch)
        for index, _, _, partners in s:
            counts.update([index, *partners])
    assert counts[0] == 0  # weight 0 (an image without labels in v7.0): never drawn, not even as a partner
    total = sum(counts.values())
    for i in (1, 2, 3, 4):
        assert counts[i] / total == pytest.approx(w[i] / w.sum(), abs=0.01)


def test_weighted_sampler_stays_in_its_shard_and_resumes_mid_epoch():
    shards = [ShardSampler(20, r, 2, seed=1) for r in range(2)]
    for s in shards:
        s.set_image_weights(lambda: np.arange(20, dtype=float))
        drawn = {i for item in s for i in (item[0], *item[3])}
        assert drawn <= set(s.indices.tolist())
    full = list(shards[1])
    resumed = ShardSampler(20, 1, 2, seed=1)
    resumed.set_image_weights(lambda: np.arange(20, dtype=float))
    resumed.resume_at(0, 4)
    assert list(resumed) == full[4:]


def test_mosaic_takes_the_partners_the_item_carries(synthetic, monkeypatch):
    """v7.0 draws both mosaics' partners from the weighted indices, the mixup image itself uniformly."""
    dm = make_dm(synthetic, hyp={"mosaic": 1.0, "mixup": 1.0, "copy_paste": 0.5})  # copy-paste: all 4 are loaded
    dm.setup("fit")
    ds = dm.train_dataset
    loaded: list[int] = []
    real = ds.load_image
    monkeypatch.setattr(ds, "load_image", lambda i: loaded.append(int(i)) or real(i))
    ds[(0, True, (0, 0, 0, 0), (5, 6, 7, 8, 9, 10))]
    assert len(loaded) == 8
    assert sorted(loaded[:4]) == [0, 5, 6, 7]  # the mosaic: the image and the item's first 3 partners
    assert {8, 9, 10} <= set(loaded[4:])  # the mixup's mosaic: its image and the item's last 3 partners


def test_datamodule_image_weights_follow_the_last_validation_and_checkpoint(synthetic):
    dm = make_dm(synthetic, image_weights=True)
    dm.trainer = trainer = SimpleNamespace(
        global_rank=0, world_size=1, lightning_module=SimpleNamespace(class_maps=None),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(
            current=SimpleNamespace(processed=0)))),
    )  # fmt: skip
    dm.setup("fit")
    nc = dm.num_classes
    before = dm._epoch_image_weights()
    labels = dm.train_dataset.labels
    np.testing.assert_allclose(before, image_weights(labels, nc, class_weights(labels, nc) / nc))
    trainer.lightning_module.class_maps = maps = np.array([0.9, 0.1, 0.5, 0.0])
    after = dm._epoch_image_weights()
    assert not np.allclose(before, after)
    state = dm.state_dict()
    assert state["image_weights_maps"] == maps.tolist()
    resumed = make_dm(synthetic, image_weights=True)
    resumed.trainer = SimpleNamespace(global_rank=0, world_size=1, lightning_module=SimpleNamespace(class_maps=None))
    resumed.setup("fit")
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(resumed._epoch_image_weights(), after)
    assert list(resumed.train_sampler) == list(dm.train_sampler)


# --------------------------------------------------------------------------------------------- multi-scale
def test_multi_scale_sizes_are_v7s():
    """v7.0: sz = randrange(imgsz * 0.5, imgsz * 1.5 + gs) // gs * gs, uniform over those integers; the batch's long
    side becomes sz and each side ceil(side * sz / long / gs) * gs."""
    rng = np.random.default_rng(0)
    sizes = Counter(max(multi_scale_shape(rng, 640, (640, 640), 32) or (640, 640)) for _ in range(21000))
    assert sorted(sizes) == list(range(320, 961, 32))  # 21 sizes, each floor of 32 consecutive integers
    assert all(c == pytest.approx(1000, rel=0.15) for c in sizes.values())
    rng = np.random.default_rng(1)
    sizes64 = {max(multi_scale_shape(rng, 640, (640, 640), 64) or (640, 640)) for _ in range(2000)}
    assert sizes64 == set(range(320, 961, 64))  # P6's grid: randrange(320, 1024) // 64 * 64
    assert multi_scale_shape(_FixedDraw(448), 640, (384, 640), 32) == (288, 448)  # ceil(384 * 0.7 / 32) * 32 = 288
    assert multi_scale_shape(_FixedDraw(640), 640, (640, 640), 32) is None  # sf == 1: unchanged


class _FixedDraw:
    def __init__(self, value: int) -> None:
        self.value = value

    def integers(self, low: int, high: int) -> int:
        assert low <= self.value < high
        return self.value


def test_multi_scale_on_the_device_hook_same_size_on_every_rank_and_deterministic(synthetic):
    dm = make_dm(synthetic, multi_scale=True, seed=5)
    images = torch.randint(0, 256, (2, 3, IMGSZ, IMGSZ), dtype=torch.uint8)
    batch = (images, torch.zeros((0, 6)), ("a", "b"), (None, None))

    def moved(epoch: int, idx: int, rank: int = 0, training: bool = True) -> torch.Tensor:
        dm.trainer = stub_trainer(epoch, idx, rank, training)
        dm._grid = None
        return dm.on_after_batch_transfer(dm.on_before_batch_transfer(batch, 0), 0)[0]

    shapes = [tuple(moved(0, i).shape[2:]) for i in range(30)]
    assert len(set(shapes)) > 3
    assert all(h == w and h % 32 == 0 and IMGSZ // 2 <= h <= IMGSZ * 3 // 2 for h, w in shapes)
    assert [tuple(moved(0, i, rank=1).shape[2:]) for i in range(30)] == shapes  # DDP: the same on every rank
    assert [tuple(moved(1, i).shape[2:]) for i in range(30)] != shapes  # another epoch, other draws
    out = moved(0, 0)
    expect = torch.nn.functional.interpolate(
        images.float() / 255, size=shapes[0], mode="bilinear", align_corners=False
    ) if shapes[0] != (IMGSZ, IMGSZ) else images.float() / 255  # fmt: skip
    torch.testing.assert_close(out, expect)
    assert tuple(moved(0, 3, training=False).shape[2:]) == (IMGSZ, IMGSZ)  # validation batches keep their size


# --------------------------------------------------------------------------------------------- quad
def _items(n: int, hw: tuple[int, int] = (4, 6)) -> list:
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        img = torch.randint(0, 256, (3, *hw), dtype=torch.uint8, generator=g)
        labels = torch.zeros((i % 3, 6))
        labels[:, 1] = 10 * i + torch.arange(i % 3)  # the class says which image and label it came from
        labels[:, 2:] = torch.rand((i % 3, 4), generator=g) * 0.5 + 0.25
        items.append((img, labels, f"{i}.jpg", None))
    return items


def test_quad_hand_layout():
    items = _items(9)
    images, targets, _, _ = collate_fn([(im.clone(), lb.clone(), p, s) for im, lb, p, s in items])
    upscaled = [False, True]
    out = quad_images(images, upscaled)
    assert out.shape == (2, 3, 8, 12)
    im = [it[0] for it in items]
    assert torch.equal(out[0, :, :4, :6], im[0])
    assert torch.equal(out[0, :, 4:, :6], im[1])  # below the first
    assert torch.equal(out[0, :, :4, 6:], im[2])  # right of the first
    assert torch.equal(out[0, :, 4:, 6:], im[3])
    up = torch.nn.functional.interpolate(im[4][None].float(), scale_factor=2.0, mode="bilinear", align_corners=False)
    assert torch.equal(out[1], up[0].to(torch.uint8))
    t = quad_targets(targets, 9, upscaled)
    # images 0 and 3 have no labels, 5-7 are not shown (group 1 is image 4 upscaled), 8 is left over
    assert t[:, 1].tolist() == [10, 20, 21, 40]
    for row in t:
        src = targets[targets[:, 1] == row[1]][0]
        if row[0] == 0:
            pos = int(row[1]) // 10
            x = (src[2] + (pos >= 2)) / 2
            y = (src[3] + (pos % 2)) / 2
            torch.testing.assert_close(row[2:], torch.stack((x, y, src[4] / 2, src[5] / 2)))
        else:
            torch.testing.assert_close(row[2:], src[2:])
    assert t[:, 0].tolist() == sorted(t[:, 0].tolist())


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(QUAD_DRAWS)))
def test_quad_matches_v7_collate_fn4(reference, case):
    """v7.0's collate_fn4 with its random draws fixed against quad_images + quad_targets."""
    ref_images, ref_targets = reference["quads"][case]
    items = _items(10)
    images, targets, _, _ = collate_fn([(im.clone(), lb.clone(), p, s) for im, lb, p, s in items])
    upscaled = [d < 0.5 for d in QUAD_DRAWS[case]]
    assert torch.equal(quad_images(images, upscaled), ref_images)
    torch.testing.assert_close(quad_targets(targets, len(items), upscaled), ref_targets)


def test_quad_batch_through_the_hooks(synthetic):
    dm = make_dm(synthetic, quad=True, batch_size=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    dm.trainer = stub_trainer(0, 2)
    before = dm.on_before_batch_transfer(batch, 0)
    assert len(before[2]) == 2
    assert len(before[1])
    assert before[1][:, 0].max() <= 1
    images = dm.on_after_batch_transfer(before, 0)[0]
    assert images.shape == (2, 3, 2 * IMGSZ, 2 * IMGSZ)
    assert images.dtype == torch.float32
    assert 0 <= float(images.min())
    assert float(images.max()) <= 1
    short = (batch[0][:3], batch[1][batch[1][:, 0] < 3], batch[2][:3], batch[3][:3])
    images = dm.on_after_batch_transfer(dm.on_before_batch_transfer(short, 0), 0)[0]
    assert images.shape == (1, 3, 2 * IMGSZ, 2 * IMGSZ)  # fewer than 4 images (v7.0 fails): the first upscaled


def test_quad_loss_counts_four_times(tiny_module, tiny_data, monkeypatch, one_thread):
    seen = []
    for quad in (False, True):
        module = tiny_module(quad=quad)
        module.trainer = SimpleNamespace(world_size=1)
        monkeypatch.setattr(module, "manual_backward", lambda loss, seen=seen: seen.append(loss.detach()))
        module._step_now = False
        module.log_dict = lambda *a, **k: None
        images, targets, _, _ = next(iter(tiny_data().train_dataloader()))
        module.training_step((images, targets), 0)
    torch.testing.assert_close(seen[1], 4 * seen[0])


def test_train_batch_transform_is_off_by_default():
    t = TrainBatchTransform(128)
    assert not t.active
    batch = (torch.zeros((2, 3, 8, 8), dtype=torch.uint8), torch.zeros((0, 6)), ("a", "b"), (None, None))
    assert t.before_transfer(batch, 0, 0, 0) is batch
