"""Training and evaluation data: image folders, WebDataset tars and LAION part files, streamed, sharded over ranks
and loader workers, decoded to sRGB crops or aspect-ratio buckets, exactly resumable (docs/data.md)."""
