"""Images per second of the training reader next to a naive PIL loop, on the same lines of real JPEG photos.

    python benchmarks/benchmark_data.py                               # 64, 256 and 512 px; 1 and 2 workers
    python benchmarks/benchmark_data.py --resolutions 64 --workers 1 4 --images 600

Data: `--images` LAION-style lines (``caption<TAB>-<TAB>base64(JPEG)``) of random crops of the photos
shipped in scikit-image, scikit-learn and matplotlib, rescaled so the shorter side is 400-1000 px
(like LAION's larger images) and saved as JPEG quality 90, in gzip parts of `--lines_per_part`
lines in a temporary folder. Every row reads the same lines.

Rows, per resolution R:
- ``naive loop``: per line: split the columns, ``base64.b64decode``, ``Image.open``,
  ``convert("RGB")``, resize the shorter side to R (bicubic), random R x R crop, float32 CHW. What a
  straightforward reader does (no checks, no EXIF, no colour management).
- ``reader, in one process``: ``ImageStream`` iterated in one process (what one DataLoader worker
  runs). It runs in the same process as the naive loop, alternating image by image, so that both see
  the same machine load and their ratio holds on a shared machine.
- ``loader, W workers``: ``build_train_dataloader`` with W workers and batches of 8 (the whole
  pipeline, in its own process; its ratio is against the naive loop of the first row).

Times count the images after the first `--warmup` (worker start-up excluded). Peak RSS is the
maximum resident set of the process (first two rows: one process, Paddle imported) or of the largest
worker (``loader`` rows; the main process is not included). ``ratio`` = images/s over the naive
loop's. Targets (issue 11): reader >= 1.5x the naive loop at 64 px and >= 1.0x at 512 px.
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def photo_files() -> list[Path]:
    """The real photographs shipped in installed packages (see ENVIRONMENT.md)."""
    import matplotlib
    import skimage.data
    import sklearn.datasets

    candidates = [Path(skimage.data.__file__).parent / name for name in
                  ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")]
    candidates += [Path(sklearn.datasets.__file__).parent / "images" / name for name in ("china.jpg", "flower.jpg")]
    candidates.append(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    return [path for path in candidates if path.is_file()]


def make_parts(folder: Path, images: int, lines_per_part: int, seed: int = 0) -> tuple[str, float]:
    """Write the benchmark parts and a .filelist; returns (filelist, mean JPEG kilobytes)."""
    rng = np.random.default_rng(seed)
    photos = [Image.open(path).convert("RGB") for path in photo_files()]
    lines, sizes = [], []
    for index in range(images):
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w, crop_h = int(width * rng.uniform(0.6, 1.0)), int(height * rng.uniform(0.6, 1.0))
        left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
        image = photo.crop((left, top, left + crop_w, top + crop_h))
        scale = rng.uniform(400, 1000) / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        sizes.append(len(buffer.getvalue()))
        lines.append(b"photo %d\t-\t" % index + base64.b64encode(buffer.getvalue()) + b"\n")
    names = []
    for start in range(0, images, lines_per_part):
        name = f"part-{start // lines_per_part:05d}.gz"
        (folder / name).write_bytes(gzip.compress(b"".join(lines[start : start + lines_per_part]), compresslevel=6))
        names.append(name)
    (folder / "bench.filelist").write_text("".join(name + "\n" for name in names))
    return str(folder / "bench.filelist"), float(np.mean(sizes)) / 1024


# ------------------------------------------------------------------------------------- the rows


def naive_images(filelist: str, resolution: int, count: int):
    """The naive loop, cycling over the lines until `count` images were made."""
    rng = np.random.default_rng(0)
    folder = Path(filelist).parent
    parts = [folder / name for name in Path(filelist).read_text().split()]
    made = 0
    while True:
        for part in parts:
            for line in gzip.decompress(part.read_bytes()).splitlines():
                image = Image.open(io.BytesIO(base64.b64decode(line.split(b"\t")[2]))).convert("RGB")
                scale = resolution / min(image.size)
                image = image.resize((max(resolution, round(image.width * scale)),
                                      max(resolution, round(image.height * scale))), Image.Resampling.BICUBIC)
                left = int(rng.integers(0, image.width - resolution + 1))
                top = int(rng.integers(0, image.height - resolution + 1))
                pixels = np.asarray(image.crop((left, top, left + resolution, top + resolution)))
                yield (pixels.transpose(2, 0, 1).astype(np.float32) / 127.5 - 1.0)
                made += 1
                if made == count:
                    return


def reader_images(filelist: str, resolution: int, count: int):
    from vae_trainer.data.dataset import ImageStream

    stream = ImageStream(filelist, resolution, seed=0, min_image_size=1)
    for number, sample in enumerate(stream):
        if number == count:
            return
        yield sample["pixel_values"]


def loader_batches(filelist: str, resolution: int, count: int, workers: int, batch_size: int = 8):
    from vae_trainer.data.dataset import build_train_dataloader

    loader = build_train_dataloader(filelist, resolution, batch_size, workers, 0, 0, 1, min_image_size=1)
    made = 0
    for batch in loader:
        yield batch["pixel_values"]
        made += batch["pixel_values"].shape[0]
        if made >= count:
            return


def _peak_rss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


def run_pair(filelist: str, resolution: int, images: int, warmup: int) -> dict:
    """The naive loop and the reader, alternating image by image; images/s of each and the peak RSS."""
    naive = naive_images(filelist, resolution, images + warmup)
    reader = reader_images(filelist, resolution, images + warmup)
    seconds = {"naive": 0.0, "reader": 0.0}
    for number in range(images + warmup):
        for name, items in (("naive", naive), ("reader", reader)):
            start = time.perf_counter()
            next(items)
            if number >= warmup:
                seconds[name] += time.perf_counter() - start
    return {"naive": images / seconds["naive"], "reader": images / seconds["reader"],
            "peak_rss_mib": _peak_rss_mib(resource.RUSAGE_SELF)}


def run_loader(filelist: str, resolution: int, images: int, warmup: int, workers: int) -> dict:
    """Images/s of the DataLoader with `workers` workers and the largest worker's peak RSS."""
    items = loader_batches(filelist, resolution, images + warmup, workers)
    made, start = 0, None
    for item in items:
        size = 1 if item.ndim == 3 else int(item.shape[0])
        made += size
        if start is None and made >= warmup:
            start, made = time.perf_counter(), 0
    elapsed = time.perf_counter() - start
    items.close()  # shuts the DataLoader down, so the workers' peak is in RUSAGE_CHILDREN
    del items
    gc.collect()
    time.sleep(0.5)
    return {"loader": made / elapsed, "peak_rss_mib": _peak_rss_mib(resource.RUSAGE_CHILDREN)}


def run_in_subprocess(filelist: str, resolution: int, args, workers: int = 0) -> dict:
    """run_pair (workers=0) or run_loader in a fresh process."""
    command = [sys.executable, __file__, "--_row", json.dumps([filelist, resolution, args.images, args.warmup, workers])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    rows = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not rows:
        raise SystemExit(f"{resolution} px, {workers} workers failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(rows[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="DataLoader worker counts to time")
    parser.add_argument("--images", type=int, default=300, help="images timed per row")
    parser.add_argument("--warmup", type=int, default=16, help="images made before the clock starts")
    parser.add_argument("--lines_per_part", type=int, default=100)
    parser.add_argument("--_row", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._row:
        filelist, resolution, images, warmup, workers = json.loads(args._row)
        row = run_loader(*json.loads(args._row)) if workers else run_pair(filelist, resolution, images, warmup)
        print(json.dumps(row))
        return 0
    with tempfile.TemporaryDirectory(prefix="benchmark_data_") as folder:
        filelist, kilobytes = make_parts(Path(folder), args.images + args.warmup, args.lines_per_part)
        part_mib = os.path.getsize(Path(folder) / "part-00000.gz") / 2**20
        print(f"{args.images} timed images (+{args.warmup} warm-up), JPEG q90 of {len(photo_files())} photos, "
              f"shorter side 400-1000 px, mean {kilobytes:.0f} KiB; parts of {args.lines_per_part} lines "
              f"({part_mib:.1f} MiB gzip); {os.cpu_count()} CPUs, OMP_NUM_THREADS=1\n")
        print("| px | row | images/s | ratio vs naive | peak RSS MiB (per worker for loader rows) |")
        print("|---|---|---|---|---|")
        for resolution in args.resolutions:
            pair = run_in_subprocess(filelist, resolution, args)
            rows = [("naive loop", pair["naive"], pair["peak_rss_mib"]),
                    ("reader, in one process", pair["reader"], pair["peak_rss_mib"])]
            for workers in args.workers:
                loader = run_in_subprocess(filelist, resolution, args, workers)
                rows.append((f"loader, {workers} worker{'s' if workers > 1 else ''}", loader["loader"],
                             loader["peak_rss_mib"]))
            for name, per_second, rss in rows:
                print(f"| {resolution} | {name} | {per_second:.1f} | {per_second / pair['naive']:.2f}x | {rss:.0f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
