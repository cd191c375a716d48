"""What composing the config costs a command before its work starts: yolo5l's runner (`yolo5l._cli.run_hydra_app`,
one composition that the override check and the run share) against the override check followed by Hydra's own
`@hydra.main` runner (three: the check's, then Hydra's two, one of them only to read `hydra.mode`).

Both run the same no-op task on train's config with the same overrides, alternating in one process, each into its
own run folder under a temporary directory; the first round is left out (imports, caches).

    python scripts/bench_compose.py                 # 7 rounds
    python scripts/bench_compose.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import hydra
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from yolo5l._cli import run_hydra_app
from yolo5l.overrides import check_overrides

OVERRIDES = [
    "model=yolov5n",
    "data.imgsz=320",
    "trainer.max_epochs=3",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
]


@hydra.main(version_base="1.3", config_path="pkg://yolo5l.conf", config_name="train")
def noop(cfg: object) -> None:
    """The task: nothing, so that only what comes before it is timed."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    compositions = 0
    compose = ConfigLoaderImpl.load_configuration

    def counted(self: ConfigLoaderImpl, *a: object, **k: object) -> object:
        nonlocal compositions
        compositions += 1
        return compose(self, *a, **k)

    ConfigLoaderImpl.load_configuration = counted  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"check + @hydra.main": [], "run_hydra_app": []}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        for i in range(args.rounds):
            for name in times:
                argv = [*OVERRIDES, f"hydra.run.dir={name.replace(' ', '_')}/{i}"]
                compositions, t0 = 0, time.perf_counter()
                if name == "run_hydra_app":
                    run_hydra_app(noop, "train", argv)
                else:
                    check_overrides(argv, "train")
                    sys.argv[1:] = argv
                    noop()
                times[name].append(time.perf_counter() - t0)
                counts[name] = compositions
    base = statistics.median(times["check + @hydra.main"][1:])
    for name, t in times.items():
        median = statistics.median(t[1:])
        print(f"{name:20s} {counts[name]} compositions  median {median * 1000:6.0f} ms  ({base / median:.2f}x)")


if __name__ == "__main__":
    main()
