"""Write short video clips (slow pans and zooms over photos) for the clip demo, tests and benchmarks.

The clip demo's clips are made from the demo photos (``data/demo``'s part files, themselves crops of photographs
shipped in scikit-image and scikit-learn), not filmed footage: every clip is a camera move over one still photo, so
there is motion between frames but no moving objects, occlusions or scene cuts. Any folder of images (searched
recursively) or of LAION-style part files works as ``--image_dir``. All randomness comes from ``--seed``.

    python scripts/make_demo_clips.py --image_dir data/demo/train --output_dir data/demo_clips/train \\
        --num_clips 16 --frames 17 --size 64

``--codec libx264`` (default) writes H.264 ``.mp4``, ``libvpx-vp9`` ``.webm`` (whose header holds no frame count)
and ``ffv1`` lossless ``.mkv``; ``--keyframe_interval`` sets the GOP (a keyframe every K frames, no scene cuts).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from vae_trainer.data.filelists import LINES, Part, image_suffixes  # noqa: E402
from vae_trainer.data.images import BadImage, load_rgb, open_image  # noqa: E402
from vae_trainer.data.records import image_bytes, iterate_records  # noqa: E402

SUFFIX = {"libx264": ".mp4", "libvpx-vp9": ".webm", "ffv1": ".mkv"}
PIXEL_FORMAT = {"libx264": "yuv420p", "libvpx-vp9": "yuv420p", "ffv1": "yuv444p"}
MAX_PIXELS = 8192 * 8192


def photos(image_dir: str) -> Iterator[Image.Image]:
    """The images under `image_dir` in sorted order: image files, and the images of part files (column 2)."""
    for path in sorted(Path(image_dir).rglob("*")):
        if not path.is_file() or path.name.startswith("."):
            continue
        try:
            if path.suffix.lower() in image_suffixes():
                yield load_rgb(open_image(path.read_bytes(), MAX_PIXELS))
                continue
            for line in iterate_records(Part(str(path), LINES)):
                if isinstance(line, bytes):
                    yield load_rgb(open_image(image_bytes(line, 2), MAX_PIXELS))
        except BadImage:
            continue


def camera_path(photo: Image.Image, frames: int, rng: np.random.Generator) -> list[tuple[float, ...]]:
    """Square boxes (left, top, right, bottom) from a random start to a random end: a pan with a zoom."""
    width, height = photo.size
    short = min(width, height)
    boxes = []
    for _ in range(2):
        side = short * rng.uniform(0.5, 0.9)
        left, top = rng.uniform(0, width - side), rng.uniform(0, height - side)
        boxes.append(np.array([left, top, left + side, top + side]))
    steps = np.linspace(0.0, 1.0, frames)
    return [tuple((1 - t) * boxes[0] + t * boxes[1]) for t in steps]


def write_clip(path: Path, frames: Iterator[np.ndarray], size: int, fps: int, codec: str, keyframe_interval: int,
               crf: int) -> None:
    """Encode uint8 [size, size, 3] frames with a keyframe every `keyframe_interval` frames."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = PIXEL_FORMAT[codec]
        stream.codec_context.gop_size = keyframe_interval
        if codec == "libx264":
            stream.options = {"crf": str(crf), "x264-params": f"keyint={keyframe_interval}:min-keyint="
                                                             f"{keyframe_interval}:scenecut=0"}
        elif codec == "libvpx-vp9":
            stream.options = {"crf": str(crf), "b": "0", "keyint_min": str(keyframe_interval), "deadline": "realtime"}
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image_dir", required=True, help="Folder of images or part files (recursive).")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_clips", type=int, default=16)
    parser.add_argument("--frames", type=int, default=17, help="Frames per clip.")
    parser.add_argument("--size", type=int, default=64, help="Square frame side in pixels (even).")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--keyframe_interval", type=int, default=30, help="A keyframe every K frames.")
    parser.add_argument("--codec", choices=sorted(SUFFIX), default="libx264")
    parser.add_argument("--crf", type=int, default=18, help="Quality of libx264 / libvpx-vp9 (lower: better).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sources = []
    for photo in photos(args.image_dir):
        sources.append(photo)
        if len(sources) == args.num_clips:
            break
    if not sources:
        raise SystemExit(f"{args.image_dir}: no images found")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    rng, written = np.random.default_rng(args.seed), []
    for index in range(args.num_clips):
        photo = sources[index % len(sources)]
        boxes = camera_path(photo, args.frames, rng)
        path = output / f"clip-{index:05d}{SUFFIX[args.codec]}"
        frames = (np.asarray(photo.resize((args.size, args.size), Image.Resampling.BICUBIC, box=box)) for box in boxes)
        write_clip(path, frames, args.size, args.fps, args.codec, args.keyframe_interval, args.crf)
        written.append(path)
    print(f"wrote {len(written)} clips of {args.frames} frames at {args.size} px to {output}")
    return written


if __name__ == "__main__":
    main()
