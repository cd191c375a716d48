"""Files in and out: downloads and archives, safe unpickling, hyp files, v7.0's old target format."""
