"""Convert COCO JSON annotations to YOLO labels: a thin wrapper of ``python -m yolo5l.data.coco2yolo``."""

from __future__ import annotations

from yolo5l.data.coco2yolo import main

if __name__ == "__main__":
    main()
