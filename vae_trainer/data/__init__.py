"""Reading LAION-style filelists and streaming decoded images."""
