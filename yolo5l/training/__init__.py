"""What training is made of besides the model and the data: YOLOv5Module, the loss, the optimiser recipe, the
divergence checks, AutoAnchor, the AMP check and the batch-size search."""
