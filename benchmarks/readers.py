"""How fast do the training readers read, next to a naive loop on the same files? Images per second of the image
reader (`images`) and clips per second of the clip reader (`clips`).

    python benchmarks/readers.py images                     # 64, 256 and 512 px; 1 and 2 workers
    python benchmarks/readers.py images --resolutions 64 --workers 1 4 --images 600
    python benchmarks/readers.py clips                      # 384 px files, 90 frames, 17-frame windows at 256 px
    python benchmarks/readers.py clips --frames 240 --keyframe_intervals 24 250 --clips 12

In both, the naive loop and the reader run in one process, alternating item by item (harness.interleaved), so that
both see the same machine load and their ratio holds on a shared machine; ``ratio`` = the reader's items/s over the
naive loop's. Prints figures; asserts nothing.

images: `--images` LAION-style lines (``caption<TAB>-<TAB>base64(JPEG)``) of random crops of the photos shipped in
scikit-image, scikit-learn and matplotlib, rescaled so the shorter side is 400-1000 px (like LAION's larger images),
JPEG quality 90, in gzip parts of `--lines_per_part` lines. Rows, per resolution R: ``naive loop`` (per line: split
the columns, ``base64.b64decode``, ``Image.open``, ``convert("RGB")``, resize the shorter side to R (bicubic), random
R x R crop, float32 CHW: what a straightforward reader does, without checks, EXIF or colour management); ``reader,
in one process`` (``ImageStream``, what one DataLoader worker runs); ``loader, W workers`` (``build_train_dataloader``,
batches of 8, the whole pipeline in its own process; its ratio is against the naive loop of the first row). Each
resolution's pair and each loader row is a fresh process with one thread. Times count the items after `--warmup`
(worker start-up excluded). Peak RSS: of that process (Paddle imported) for the pair, of the largest worker for the
loader rows. Targets (issue 11): reader >= 1.5x the naive loop at 64 px, >= 1.0x at 512 px.

clips: `--num_files` H.264 mp4 files per keyframe interval, written by scripts/make_demo_clips.py (pans and zooms
over the photos shipped in scikit-image; crf 18), `--size` px square, `--frames` frames at 24 fps. ``naive loop``:
per clip, open the file, decode every frame to RGB from its start (what a reader without seeking does), take a
random window of `--num_frames` frames `--frame_stride` apart, crop each to `--resolution`
(vae_trainer.data.images.crop). ``reader``: ``ImageStream`` with ``--num_frames``: a seek to the keyframe before a
random window, its frames decoded, the same crop. One warm-up clip each (imports, the first open).
"""

from __future__ import annotations

import argparse
import base64
import gc
import gzip
import io
import itertools
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
from PIL import Image

import harness


# ---------------------------------------------------------------- images
def naive_images(filelist: str, resolution: int):
    """The naive loop, cycling over the lines."""
    rng = np.random.default_rng(0)
    parts = [Path(filelist).parent / name for name in Path(filelist).read_text().split()]
    for part in itertools.cycle(parts):
        for line in gzip.decompress(part.read_bytes()).splitlines():
            image = Image.open(io.BytesIO(base64.b64decode(line.split(b"\t")[2]))).convert("RGB")
            scale = resolution / min(image.size)
            image = image.resize((max(resolution, round(image.width * scale)),
                                  max(resolution, round(image.height * scale))), Image.Resampling.BICUBIC)
            left = int(rng.integers(0, image.width - resolution + 1))
            top = int(rng.integers(0, image.height - resolution + 1))
            pixels = np.asarray(image.crop((left, top, left + resolution, top + resolution)))
            yield (pixels.transpose(2, 0, 1).astype(np.float32) / 127.5 - 1.0)


def image_row(row: dict) -> dict:
    """The worker of one row: the naive loop and the reader alternating (workers 0), or the DataLoader."""
    from vae_trainer.data.dataset import ImageStream, build_train_dataloader

    if not row["workers"]:
        timed = harness.interleaved({"naive": naive_images(row["filelist"], row["resolution"]).__next__,
                                     "reader": iter(ImageStream(row["filelist"], row["resolution"], seed=0,
                                                                min_image_size=1)).__next__},
                                    row["images"], row["warmup"])
        return {name: row["images"] / sum(timed[name]["times_s"]) for name in timed} | {
            "peak_rss_mib": harness.peak_rss_bytes() / 2**20}
    loader = build_train_dataloader(row["filelist"], row["resolution"], 8, row["workers"], 0, 0, 1, min_image_size=1)
    # batches of 8: the images and the warm-up rounded up to whole batches
    timed = harness.interleaved({"loader": iter(loader).__next__}, -(-row["images"] // 8), -(-row["warmup"] // 8))
    # its iterator went with the dict above: this shuts the DataLoader down, so the workers' peak is in RUSAGE_CHILDREN
    del loader
    gc.collect()
    time.sleep(0.5)
    return {"loader": 8 * len(timed["loader"]["times_s"]) / sum(timed["loader"]["times_s"]),
            "peak_rss_mib": harness.peak_rss_bytes(resource.RUSAGE_CHILDREN) / 2**20}


def images(args: argparse.Namespace) -> List[list]:
    with tempfile.TemporaryDirectory(prefix="readers_") as folder:
        filelist, kilobytes = harness.laion_parts(folder, args.images + args.warmup, lines_per_part=args.lines_per_part)
        part_mib = os.path.getsize(Path(folder) / "part-00000.gz") / 2**20
        print(f"{args.images} timed images (+{args.warmup} warm-up), JPEG q90 of {len(harness.photo_files())} photos, "
              f"shorter side 400-1000 px, mean {kilobytes:.0f} KiB; parts of {args.lines_per_part} lines "
              f"({part_mib:.1f} MiB gzip); {os.cpu_count()} CPUs, OMP_NUM_THREADS=1\n")
        rows = []
        for resolution, workers in itertools.product(args.resolutions, [0] + args.workers):
            result = harness.in_fresh_process(__file__, {"filelist": filelist, "resolution": resolution, "images":
                                                         args.images, "warmup": args.warmup, "workers": workers}, 1)
            if "error" in result:
                raise SystemExit(f"{resolution} px, {workers} workers failed:\n" + "\n".join(result["error"]))
            if not workers:
                naive, rss = result["naive"], result["peak_rss_mib"]
                rows += [[resolution, "naive loop", naive, 1, rss], [resolution, "reader, in one process",
                                                                     result["reader"], result["reader"] / naive, rss]]
            else:
                rows.append([resolution, f"loader, {workers} worker{'s' if workers > 1 else ''}", result["loader"],
                             result["loader"] / naive, result["peak_rss_mib"]])
    return [[px, name, f"{speed:.1f}", f"{ratio:.2f}x", f"{rss:.0f}"] for px, name, speed, ratio, rss in rows]


# ---------------------------------------------------------------- clips
def naive_clip(path: str, num_frames: int, stride: int, resolution: int, rng: np.random.Generator) -> np.ndarray:
    import av

    from vae_trainer.data.images import crop

    with av.open(path) as container:
        frames = [frame.to_image() for frame in container.decode(video=0)]
    span = (num_frames - 1) * stride + 1
    start = int(rng.integers(0, len(frames) - span + 1))
    state = rng.bit_generator.state
    cropped = []
    for frame in frames[start : start + span : stride]:
        rng.bit_generator.state = state
        cropped.append(crop(frame, (resolution, resolution), rng, True))
    return np.stack(cropped)


def clips(args: argparse.Namespace) -> List[list]:
    import skimage

    sys.path.insert(0, os.path.join(harness.REPO_ROOT, "scripts"))
    from make_demo_clips import main as make_clips

    from vae_trainer.data.dataset import ImageStream

    print(f"{args.num_files} files of {args.frames} frames at {args.size} px; windows of {args.num_frames} frames, "
          f"stride {args.frame_stride}, cropped to {args.resolution} px; {args.clips} clips per row\n")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for interval in args.keyframe_intervals:
            out = os.path.join(folder, f"gop{interval}")
            files = itertools.cycle(str(path) for path in make_clips(
                ["--image_dir", os.path.join(os.path.dirname(skimage.__file__), "data"), "--output_dir", out,
                 "--num_clips", str(args.num_files), "--frames", str(args.frames), "--size", str(args.size),
                 "--keyframe_interval", str(interval)]))
            stream = iter(ImageStream(out, args.resolution, num_frames=args.num_frames, frame_stride=args.frame_stride))
            rng = np.random.default_rng(0)
            timed = harness.interleaved({
                "naive": lambda: naive_clip(next(files), args.num_frames, args.frame_stride, args.resolution, rng),
                "reader": lambda: next(stream)}, args.clips, warmup=1)
            naive, reader = (sum(timed[name]["times_s"]) for name in ("naive", "reader"))
            rows.append([interval, f"{args.clips / naive:.2f}", f"{args.clips / reader:.2f}", f"{naive / reader:.2f}"])
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    if harness.serve_worker(argv, image_row):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    readers = parser.add_subparsers(dest="reader", required=True)
    on_images = readers.add_parser("images", help="the image reader and DataLoader")
    on_images.add_argument("--resolutions", type=int, nargs="+", default=[64, 256, 512])
    on_images.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="DataLoader worker counts to time")
    on_images.add_argument("--images", type=int, default=300, help="images timed per row")
    on_images.add_argument("--warmup", type=int, default=16, help="images made before the clock starts")
    on_images.add_argument("--lines_per_part", type=int, default=100)
    on_clips = readers.add_parser("clips", help="the clip reader")
    on_clips.add_argument("--size", type=int, default=384)
    on_clips.add_argument("--frames", type=int, default=90)
    on_clips.add_argument("--keyframe_intervals", type=int, nargs="+", default=[30, 250])
    on_clips.add_argument("--num_files", type=int, default=4)
    on_clips.add_argument("--clips", type=int, default=12, help="Clips timed per row.")
    on_clips.add_argument("--num_frames", type=int, default=17)
    on_clips.add_argument("--frame_stride", type=int, default=1)
    on_clips.add_argument("--resolution", type=int, default=256)
    args = parser.parse_args(argv)
    harness.header(__file__, argv)
    if args.reader == "images":
        print(harness.markdown(["px", "row", "images/s", "ratio vs naive", "peak RSS MiB (per worker for loader rows)"],
                               images(args)))
    else:
        print(harness.markdown(["keyframe interval", "naive clips/s", "reader clips/s", "ratio"], clips(args)))


if __name__ == "__main__":
    main()
