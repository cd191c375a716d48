from __future__ import annotations

import os

import _module_helpers as helpers
import pytest
import torch

# Tests run on 2 CPU cores: keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# yolo5l's user cache (label-scan logs and locks, read-only fallbacks) in a folder of this session, not in the home of
# whoever runs the tests; subprocesses inherit it.
if "YOLO5L_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["YOLO5L_CACHE_DIR"] = tempfile.mkdtemp(prefix="yolo5l-test-cache-")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models run fastest single-threaded on the shared CPU (two threads oversubscribe under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_module():
    """Factory of a seeded 2-class yolov5 `YOLOv5Module` at width 0.125 (64 px images), built like
    conf/module/yolov5.yaml: `tiny_module(nbs=8, ciou_backend="auto", map_backend="yolov5", **module_kwargs)`."""
    return helpers.tiny_module


@pytest.fixture
def tiny_data():
    """The `TinyData` LightningDataModule class: `tiny_data(n=8, batch_size=4, delay=0.0)` gives deterministic
    64 px images with one box each, the same images for training and validation (subclass it to change a hook)."""
    return helpers.TinyData


@pytest.fixture
def tiny_collate():
    """`TinyData`'s collate function: (images, targets [image, class, cx, cy, w, h], paths, shapes)."""
    return helpers.collate


@pytest.fixture
def make_trainer():
    """Factory of a quiet CPU trainer: `make_trainer(tmp_path, callbacks=(), **trainer_kwargs)`, 2 epochs, no logger,
    no sanity check, checkpointing only when a callback has a `dirpath`."""
    return helpers.make_trainer


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
