"""From raw heads to results: NMS and box conversions, test-time augmentation, drawing boxes, feature maps, and
predict's sources and outputs."""
