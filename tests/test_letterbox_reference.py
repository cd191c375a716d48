"""`yolo5l.data.letterbox.letterbox` against ultralytics/yolov5 v7.0's `utils/augmentations.py::letterbox`, run in
the reference environment (PyPI's `yolov5==7.0.14`, whose letterbox is the v7.0 tag's; `.refvenv/` or the python
named by YOLO5L_REFERENCE_PYTHON; skipped without it): the same pixels, ratio and pad, shrinking, enlarging, square
and rectangular targets, with and without `auto` and `scaleup`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_val_reference import _reference_python

from yolo5l.data.letterbox import letterbox

pytestmark = pytest.mark.reference  # make refvenv; CI runs them with make test-ci

CASES = [  # (h, w), new_shape, auto, scaleup
    ((480, 640), 128, False, True), ((481, 333), 320, False, False), ((90, 60), 128, False, True),
    ((90, 60), 128, False, False), ((375, 500), 640, True, True), ((1000, 77), [256, 320], False, True),
    ((240, 240), 96, True, False),
]  # fmt: skip

_REFERENCE = """
import json, sys
import numpy as np
from yolov5.utils.augmentations import letterbox
data = np.load(sys.argv[1])
cases = json.loads(sys.argv[2])
out = {}
for i, (_, new_shape, auto, scaleup) in enumerate(cases):
    im, ratio, pad = letterbox(data[str(i)], new_shape, auto=auto, scaleup=scaleup, stride=32)
    out[str(i)] = im
    out[f"{i}_meta"] = np.array([*ratio, *pad], dtype=np.float64)
np.savez(sys.argv[3], **out)
"""


def test_letterbox_is_v7s(tmp_path: Path):
    python = _reference_python()
    if python is None:
        pytest.skip("no reference environment (.refvenv/ with yolov5==7.0.14, or YOLO5L_REFERENCE_PYTHON)")
    rng = np.random.default_rng(1)
    images = {str(i): rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for i, (hw, *_) in enumerate(CASES)}
    np.savez(tmp_path / "in.npz", **images)
    args = [str(tmp_path / "in.npz"), json.dumps(CASES), str(tmp_path / "v7.npz")]
    subprocess.run([python, "-W", "ignore", "-c", _REFERENCE, *args], check=True, timeout=300, capture_output=True)
    v7 = np.load(tmp_path / "v7.npz")
    for i, (_, new_shape, auto, scaleup) in enumerate(CASES):
        im, ratio, pad = letterbox(images[str(i)], new_shape, auto=auto, scaleup=scaleup, stride=32)
        np.testing.assert_array_equal(im, v7[str(i)], err_msg=str(CASES[i]))
        np.testing.assert_array_equal(np.array([*ratio, *pad]), v7[f"{i}_meta"], err_msg=str(CASES[i]))
