"""yolo5l.base.hostmem: glibc keeps freed buffers, so re-allocating a step's tensors faults no pages in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from yolo5l.base.hostmem import tune_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt (Linux)")

# A "step" that allocates, writes and frees ~130 MiB of differently sized float32 buffers in mixed order, like the
# activations of a training step; the number printed is the minor page faults of 5 steady steps.
_STEPS = textwrap.dedent(
    """
    import resource, sys, torch
    if sys.argv[1] == "tuned":
        from yolo5l.base.hostmem import tune_malloc
        assert tune_malloc()
    sizes = [1, 3, 8, 20, 2, 30, 5, 12, 6, 25, 4, 16]  # MiB
    def step():
        xs = [torch.ones(n << 18) for n in sizes]
        del xs[::2]
        ys = [torch.ones(n << 18) for n in sizes[::-1]]
        del xs, ys
    for _ in range(10):  # the heap settles (with 3 warm-up steps, 0-7,680 pages still faulted in as it grew)
        step()
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.bench  # counts page faults of the whole process: a measurement, kept out of the default run
def test_tuned_malloc_stops_page_faults_of_reused_buffers():
    untuned, tuned = _faults("default"), _faults("tuned")
    assert untuned > 20_000  # glibc's defaults hand these buffers back and fault ~150k pages in again
    # 0 tuned once the heap has settled (8 of 8 runs); the factor leaves room for a late heap growth of ~18 MiB
    assert tuned * 20 < untuned, f"{tuned} page faults with the tuned allocator (untuned: {untuned})"


def test_tune_malloc_is_idempotent(monkeypatch):
    assert tune_malloc() is True

    def no_libc(*args, **kwargs):
        raise AssertionError("tune_malloc reloaded libc for settings it had already applied")

    monkeypatch.setattr("yolo5l.base.hostmem.ctypes.CDLL", no_libc)
    assert tune_malloc() is True  # the same settings again: answered without a second mallopt round
