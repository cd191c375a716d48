"""Judging a model: the mAP metrics (YOLOv5's protocol and COCO's), per-class results, the plots and the saved
predictions (save_txt, save_json), and the run's best fitness."""
