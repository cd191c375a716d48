"""Files in and out: atomic writes and the one lock, weights (yolo5l's and ultralytics'), safe unpickling,
downloads and archives, the model a run starts from, hyp files."""
