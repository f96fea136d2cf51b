"""Build the small built-in demo dataset from real photographs shipped inside installed packages.

Photos: scikit-image's ``skimage/data`` (astronaut, chelsea, coffee, rocket, motorcycle_left,
hubble_deep_field, retina), scikit-learn's ``sklearn/datasets/images`` (china, flower) and, if
matplotlib is installed, its ``grace_hopper.jpg``. Nothing is downloaded.

Two photos are held out for evaluation (grace_hopper and coffee, or chelsea and coffee without
matplotlib) and cut into non-overlapping 128 px tiles. The training photos give many random square
crops (10-100% of the shorter side) resized to 96-160 px and saved as JPEG. All randomness comes from
``--seed``, and gzip output carries no timestamp, so runs are byte-identical (idempotent).

Writes ``<output_dir>/{train,eval}/part-*.gz`` and, in ``--filelist_dir``, ``demo_train.filelist``,
``demo_eval.filelist`` and ``demo.filelist.list`` with paths relative to that folder.

    python scripts/prepare_demo_data.py --output_dir data/demo
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_parts import Record, write_parts  # noqa: E402
from write_filelist import write_counts, write_filelist_list, write_part_filelist  # noqa: E402

SKIMAGE_PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                  "hubble_deep_field.jpg", "retina.jpg"]
SKLEARN_PHOTOS = ["china.jpg", "flower.jpg"]
EVAL_PREFERENCE = ["grace_hopper", "coffee", "chelsea"]
TILE = 128
TRAIN_LINES_PER_PART = 100
EVAL_LINES_PER_PART = 16


def photo_paths() -> dict[str, Path]:
    """Name -> file of every demo photo that is present in the installed packages."""
    import skimage.data
    import sklearn.datasets

    candidates = [Path(skimage.data.__file__).parent / name for name in SKIMAGE_PHOTOS]
    candidates += [Path(sklearn.datasets.__file__).parent / "images" / name for name in SKLEARN_PHOTOS]
    try:
        import matplotlib

        candidates.append(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    except ImportError:
        pass  # optional: without it, other photos are held out
    return {path.stem: path for path in candidates if path.is_file()}


def split_photos(names: list[str]) -> tuple[list[str], list[str]]:
    """(training names, held-out names): the first two available of EVAL_PREFERENCE are held out."""
    held_out = [name for name in EVAL_PREFERENCE if name in names][:2]
    return sorted(name for name in names if name not in held_out), held_out


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def random_crops(photos: dict[str, Image.Image], count: int, rng: np.random.Generator) -> Iterator[Record]:
    """`count` square crops at random scales and places, resized to 96-160 px."""
    names = sorted(photos)
    for number in range(count):
        name = names[rng.integers(len(names))]
        photo = photos[name]
        shorter = min(photo.size)
        side = max(32, int(shorter * np.exp(rng.uniform(np.log(0.1), 0.0))))
        left = int(rng.integers(0, photo.width - side + 1))
        top = int(rng.integers(0, photo.height - side + 1))
        size = int(rng.integers(96, 161))
        crop = photo.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        yield Record(f"{name} crop {number}", f"{name}/{left},{top},{side}", _jpeg(crop, 90))


def tiles(photos: dict[str, Image.Image]) -> Iterator[Record]:
    """Non-overlapping TILE x TILE tiles of each photo, row by row."""
    for name in sorted(photos):
        photo = photos[name]
        for top in range(0, photo.height - TILE + 1, TILE):
            for left in range(0, photo.width - TILE + 1, TILE):
                tile = photo.crop((left, top, left + TILE, top + TILE))
                yield Record(f"{name} tile", f"{name}/{left},{top}", _jpeg(tile, 95))


def _clear_parts(folder: Path) -> None:
    for old in folder.glob("part-*"):
        old.unlink()


def _load(paths: dict[str, Path], names: list[str]) -> dict[str, Image.Image]:
    return {name: Image.open(paths[name]).convert("RGB") for name in names}


def prepare(output_dir: str, filelist_dir: str, num_crops: int, seed: int) -> dict[str, int]:
    """Write the demo parts and filelists; returns counts for the summary."""
    paths = photo_paths()
    train_names, eval_names = split_photos(sorted(paths))
    if len(train_names) < 2 or len(eval_names) < 2:
        raise SystemExit(f"too few demo photos found in the installed packages: {sorted(paths)}")
    train_dir, eval_dir = Path(output_dir) / "train", Path(output_dir) / "eval"
    for folder in (train_dir, eval_dir):
        folder.mkdir(parents=True, exist_ok=True)
        _clear_parts(folder)
    crops = random_crops(_load(paths, train_names), num_crops, np.random.default_rng(seed))
    train_parts = write_parts(crops, str(train_dir), TRAIN_LINES_PER_PART)
    eval_records = list(tiles(_load(paths, eval_names)))
    eval_parts = write_parts(eval_records, str(eval_dir), EVAL_LINES_PER_PART)
    lists = Path(filelist_dir)
    write_part_filelist([str(p) for p in train_parts], str(lists / "demo_train.filelist"))
    write_counts(str(lists / "demo_train.filelist"))  # generated (gitignored): even shards, see README
    write_part_filelist([str(p) for p in eval_parts], str(lists / "demo_eval.filelist"))
    write_filelist_list([(str(lists / "demo_train.filelist"), 1.0)], str(lists / "demo.filelist.list"))
    return {"train_photos": len(train_names), "crops": num_crops, "train_parts": len(train_parts),
            "eval_photos": len(eval_names), "tiles": len(eval_records), "eval_parts": len(eval_parts)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(REPO / "data" / "demo"))
    parser.add_argument("--filelist_dir", default=str(REPO / "data" / "filelist"))
    parser.add_argument("--num_crops", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = prepare(args.output_dir, args.filelist_dir, args.num_crops, args.seed)
    print(
        f"demo data in {args.output_dir}: {counts['crops']} crops of {counts['train_photos']} photos in "
        f"{counts['train_parts']} parts; {counts['tiles']} eval tiles of {counts['eval_photos']} photos in "
        f"{counts['eval_parts']} parts; filelists in {args.filelist_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
