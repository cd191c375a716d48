"""yolo5l_kernels: fused box and upsample ops for YOLOv5 training (import name `yolo5l_kernels`)."""
