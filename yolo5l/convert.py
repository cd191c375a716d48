"""Convert an ultralytics/yolov5 v6-v7 ``.pt`` file (or a yolo5l training checkpoint) into a yolo5l weights file.

    python -m yolo5l.convert yolov5s.pt yolov5s_yolo5l.pt [--num-classes N]

The output is what :func:`yolo5l.models.weights.save_weights` writes: ``model_config`` {depth, width, num_classes,
anchors, cfg (the layer table: None for P5, "p6", or the model yaml)}, ``state_dict`` (half precision), ``names``
and ``imgsz``; ``torch.load(out, weights_only=True)`` reads it. The input (a stripped release file, or the
unstripped ``last.pt``/``best.pt`` of a run, whose EMA weights are taken) is read without running pickled code
(``yolo5l.io.safe_pickle``): no ultralytics install is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from yolo5l.base.errors import EXIT_USAGE
from yolo5l.deploy.exported import not_weights
from yolo5l.models.weights import UnsafeCheckpointError, load_weights, save_weights


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage mistake as one `error: ...` line (exit code 2) naming the closest option."""

    def error(self, message: str) -> NoReturn:
        import difflib

        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        unrecognized = message.startswith("unrecognized arguments:")
        unknown = [a for a in message.removeprefix("unrecognized arguments:").split() if a.startswith("-")]
        close = difflib.get_close_matches(unknown[0].split("=", 1)[0], options, n=1) if unrecognized and unknown else []
        hint = (
            f"; did you mean {close[0]}?"
            if close
            else f"; usage: {self.format_usage().strip().removeprefix('usage: ')}"
        )
        print(f"error: {message}{hint}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m yolo5l.convert",
        description="Convert an ultralytics/yolov5 v6-v7 .pt file (GitHub or PyPI yolov5 layout), or a yolo5l "
        "last.ckpt / best.pt, into a yolo5l weights file (safe to load).",
    )
    parser.add_argument("source", help="yolov5s.pt, an ultralytics best.pt, or a yolo5l last.ckpt / best.pt")
    parser.add_argument("output", help="yolo5l checkpoint to write")
    parser.add_argument(
        "--num-classes",
        type=int,
        default=None,
        help="build the model for N classes (the Detect convs are then freshly initialised); default: the file's",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the converter.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status: 0 on success, 2 when the input cannot be converted (a one-line message on stderr), as the
        other entry points.
    """
    args = _parser().parse_args(argv)
    keyed = next((a for a in (args.source, args.output) if "=" in a and not os.path.exists(a)), None)
    if keyed is not None:
        print(f"error: {keyed}: convert takes two paths, not key=value: python -m yolo5l.convert SOURCE OUTPUT",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if args.num_classes is not None and args.num_classes < 1:
        print(f"error: --num-classes must be >= 1, got {args.num_classes}", file=sys.stderr)
        return EXIT_USAGE
    if os.path.abspath(args.source) == os.path.abspath(args.output):
        print(f"error: {args.output}: output would overwrite the source; choose another path", file=sys.stderr)
        return EXIT_USAGE
    if problem := not_weights(args.source, "converted"):
        print(f"error: {args.source}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isfile(args.source):
        print(f"error: {args.source}: no such file; pass an ultralytics .pt (yolov5s.pt, a train.py best.pt) or a "
              "yolo5l run's last.ckpt", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    try:
        model, info = load_weights(args.source, num_classes=args.num_classes)
        save_weights(model, args.output, info.names, imgsz=info.imgsz)
    except (FileNotFoundError, UnsafeCheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"Transferred {info.transferred}/{info.total} items from {args.source}; wrote {args.output} "
        f"({model.describe()}, {model.num_classes} classes, depth {model.depth}, width {model.width})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
