"""Training and evaluation data: sources (image folders, WebDataset tars, LAION part files), streamed,
sharded, decoded to sRGB crops or aspect-ratio buckets, exactly resumable.

filelists (what --file_list names) -> records (reading a part) -> sharding (who reads what, in which
order) -> images (decode, colour, crop) -> buckets (batches of one shape) -> dataset (the stream and the
DataLoaders built on it) -> position (where the stream is, what it skipped, the resume state);
loader (Paddle's DataLoader made safe: errors reach the main thread, workers end with their iteration).
"""
