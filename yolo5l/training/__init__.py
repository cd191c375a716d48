"""What training is made of besides the model and the data: YOLOv5Module, the loss, the optimiser recipe, the
divergence checks, AutoAnchor, the AMP check, the batch-size search, the run's best fitness and the closing
validation of best.pt."""
