"""The host input path's batch: collate_fn in a DataLoader worker writes the batch into shared memory (no second copy
on its way to the main process), channels_last, with the values of the collate in the main process."""

from __future__ import annotations

import glob

import torch
from torch.utils.data import DataLoader

from yolo5l.data.dataset import YOLODataset, collate_fn
from yolo5l.data.label_scan import scan_labels
from yolo5l.data.synthetic import NAMES, ensure_synthetic

IMGSZ = 96
KEYS = [(i, True, (0, 1, 0)) for i in range(6)]  # training items: mosaics, the same draws in any process


def collate_in_worker(batch):
    """collate_fn, plus whether its images and targets were in shared memory where it ran (in the worker)."""
    out = collate_fn(batch)
    return out, out[0].is_shared(), out[1].is_shared()


def test_worker_collate_writes_shared_channels_last_batches(tmp_path):
    root = ensure_synthetic(tmp_path / "syn", num_train=6, num_val=2).parent
    files = sorted(glob.glob(str(root / "images" / "train" / "*.jpg")))
    index = scan_labels(files, len(NAMES), root / "labels" / "train.cache")
    ds = YOLODataset(index, imgsz=IMGSZ, augment=True)
    loader = DataLoader(ds, batch_size=3, sampler=KEYS, num_workers=1, collate_fn=collate_in_worker)
    batches = list(loader)
    assert len(batches) == 2
    for k, ((images, targets, paths, shapes), images_shared, targets_shared) in enumerate(batches):
        assert images_shared
        assert targets_shared
        assert images.is_shared()
        assert targets.is_shared()
        assert images.shape == (3, 3, IMGSZ, IMGSZ)
        assert images.dtype == torch.uint8
        assert images.is_contiguous(memory_format=torch.channels_last)
        local = collate_fn([ds[key] for key in KEYS[3 * k : 3 * k + 3]])
        assert not local[0].is_shared()  # in the main process torch allocates as usual
        assert local[0].is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(images, local[0], rtol=0, atol=0)
        torch.testing.assert_close(targets, local[1], rtol=0, atol=0)
        assert (paths, shapes) == local[2:]
