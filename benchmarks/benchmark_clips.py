"""Clips per second of the clip reader next to a naive loop that decodes every frame of each file from its start.

    python benchmarks/benchmark_clips.py                       # 384 px files, 90 frames, 17-frame windows at 256 px
    python benchmarks/benchmark_clips.py --size 480 --frames 120 --keyframe_intervals 30 250 --clips 12

Data: `--num_files` H.264 mp4 files per keyframe interval, written by scripts/make_demo_clips.py (pans and zooms
over the photos shipped in scikit-image; crf 18), `--size` px square, `--frames` frames at 24 fps, in a temporary
folder. Rows, per keyframe interval:
- ``naive loop``: per clip, open the file, decode every frame to RGB from its start (what a reader without seeking
  does, e.g. one that reads whole files), take a random window of `--num_frames` frames `--frame_stride` apart and
  crop each to `--resolution` (vae_trainer.data.images.crop).
- ``reader``: ``ImageStream`` with ``--num_frames`` (what one DataLoader worker runs): a seek to the keyframe
  before a random window, its frames decoded, the same crop.
Both run in one process, alternating clip by clip, so that both see the same machine load. ``ratio`` = reader
clips/s over the naive loop's. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from make_demo_clips import main as make_clips  # noqa: E402

from vae_trainer.data.dataset import ImageStream  # noqa: E402
from vae_trainer.data.images import crop  # noqa: E402


def naive_clip(path: str, num_frames: int, stride: int, resolution: int, rng: np.random.Generator) -> np.ndarray:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=384)
    parser.add_argument("--frames", type=int, default=90)
    parser.add_argument("--keyframe_intervals", type=int, nargs="+", default=[30, 250])
    parser.add_argument("--num_files", type=int, default=4)
    parser.add_argument("--clips", type=int, default=12, help="Clips timed per row.")
    parser.add_argument("--num_frames", type=int, default=17)
    parser.add_argument("--frame_stride", type=int, default=1)
    parser.add_argument("--resolution", type=int, default=256)
    args = parser.parse_args(argv)
    import skimage

    photos = os.path.join(os.path.dirname(skimage.__file__), "data")
    print(f"{args.num_files} files of {args.frames} frames at {args.size} px; windows of {args.num_frames} frames, "
          f"stride {args.frame_stride}, cropped to {args.resolution} px; {args.clips} clips per row")
    print(f"{'keyframe interval':>18} {'naive clips/s':>14} {'reader clips/s':>15} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as folder:
        for interval in args.keyframe_intervals:
            out = os.path.join(folder, f"gop{interval}")
            files = [str(path) for path in make_clips(
                ["--image_dir", photos, "--output_dir", out, "--num_clips", str(args.num_files), "--frames",
                 str(args.frames), "--size", str(args.size), "--keyframe_interval", str(interval)])]
            stream = iter(ImageStream(out, args.resolution, num_frames=args.num_frames,
                                      frame_stride=args.frame_stride))
            rng, naive, reader = np.random.default_rng(0), 0.0, 0.0
            next(stream)  # (warm-up: imports, first open)
            for k in range(args.clips):
                began = time.perf_counter()
                naive_clip(files[k % len(files)], args.num_frames, args.frame_stride, args.resolution, rng)
                middle = time.perf_counter()
                next(stream)
                naive, reader = naive + middle - began, reader + time.perf_counter() - middle
            print(f"{interval:>18} {args.clips / naive:>14.2f} {args.clips / reader:>15.2f} {naive / reader:>6.2f}")


if __name__ == "__main__":
    main()
