"""Write RGBA PNGs (photos with a synthetic alpha) for 4-channel VAEs (Qwen-Image 2.1's): demo, tests, benchmarks.

Each image is a random square crop of a photo (the demo photos, ``data/demo``'s part files, or any folder of images
or LAION-style part files as ``--image_dir``, as scripts/make_demo_clips.py reads them), resized to ``--size``, with
an alpha of its own: a soft-edged ellipse, opaque inside, transparent outside, a linear ramp between. It is not a
real matte (no hair, glass or colour spill). The colour under alpha 0 is black, what a resize leaves there anyway
(Pillow resizes RGBA premultiplied): so crops the reader resizes and crops it does not agree (docs/data.md, "RGBA").
All randomness comes from ``--seed``.

    python scripts/make_demo_rgba.py --image_dir data/demo/train --output_dir data/demo_rgba/train \\
        --num_images 64 --size 64
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from scripts.make_demo_clips import photos  # noqa: E402
from vae_trainer.data.images import RESAMPLING  # noqa: E402


def synthetic_alpha(size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [size, size]: an ellipse of random centre and radii, 255 inside, 0 outside, a ramp a quarter of its radius
    wide across its edge (so every image has opaque, transparent and partly transparent pixels)."""
    rows, columns = np.mgrid[0:size, 0:size] / size
    (centre_y, centre_x), (radius_y, radius_x) = rng.uniform(0.35, 0.65, 2), rng.uniform(0.3, 0.5, 2)
    distance = np.hypot((rows - centre_y) / radius_y, (columns - centre_x) / radius_x)  # 1 on the ellipse
    return np.round(np.clip((1.0 - distance) * 4.0 + 0.5, 0.0, 1.0) * 255).astype(np.uint8)


def rgba_images(image_dir: str, num_images: int, size: int, seed: int) -> Iterator[np.ndarray]:
    """`num_images` uint8 [size, size, 4] crops of the photos of `image_dir` (in turn, again if too few)."""
    rng, pool = np.random.default_rng(seed), list(itertools.islice(photos(image_dir), num_images))
    if not pool:
        raise SystemExit(f"error: --image_dir {image_dir}: no image found")
    for index in range(num_images):
        photo = pool[index % len(pool)]
        side = int(min(photo.size) * rng.uniform(0.6, 1.0))
        left, top = (int(rng.integers(0, extent - side + 1)) for extent in photo.size)
        crop = photo.resize((size, size), RESAMPLING, box=(left, top, left + side, top + side))
        alpha = synthetic_alpha(size, rng)
        yield np.dstack([np.asarray(crop) * (alpha > 0)[..., None], alpha])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image_dir", required=True, help="a folder of images or of LAION-style part files")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_images", type=int, default=64)
    parser.add_argument("--size", type=int, default=64, help="side of the square PNGs, in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for index, pixels in enumerate(rgba_images(args.image_dir, args.num_images, args.size, args.seed)):
        Image.fromarray(pixels, "RGBA").save(out / f"rgba_{index:05d}.png")
    print(f"wrote {args.num_images} RGBA PNGs of {args.size} px to {out}")


if __name__ == "__main__":
    main()
