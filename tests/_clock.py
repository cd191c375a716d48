"""A clock that tests move by hand, and data that takes time on it: timing code tested without sleeping."""

from __future__ import annotations

from lightning.pytorch.demos.boring_classes import RandomDataset


class FakeClock:
    """A `time.perf_counter` that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowItems(RandomDataset):
    """`length` random items of `size` values that take `seconds` each to load, on `clock`."""

    def __init__(self, clock: FakeClock, seconds: float, length: int, size: int = 32) -> None:
        super().__init__(size, length)
        self.clock, self.seconds = clock, seconds

    def __getitem__(self, i):
        self.clock.advance(self.seconds)
        return super().__getitem__(i)
