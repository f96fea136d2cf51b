"""Pack folders of images into LAION-style part files (``caption \\t path \\t base64(bytes)`` per line).

Images are found recursively and in sorted order, so the output is deterministic; the original file
bytes are stored unchanged. Files that do not decode as images are skipped and counted.

    python scripts/make_parts.py --image_dir photos --output_dir parts --lines_per_part 1000
"""

from __future__ import annotations

import argparse
import base64
import gzip
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from vae_trainer.data.images import BadImage, load_rgb, open_image  # noqa: E402

PART_PATTERN = "part-{:05d}{}"
MAX_PIXELS = 16384 * 16384
# mtime=0 makes gzip output byte-identical between runs.
_GZIP_OPTIONS = {"compresslevel": 6, "mtime": 0}


@dataclass
class Record:
    """One line of a part file."""

    caption: str
    placeholder: str
    image_bytes: bytes

    def to_line(self) -> bytes:
        fields = [_one_line(self.caption), _one_line(self.placeholder) or "-"]
        return "\t".join(fields).encode("utf-8") + b"\t" + base64.b64encode(self.image_bytes) + b"\n"


def _one_line(text: str) -> str:
    """Tabs and newlines would break the line format."""
    return " ".join(text.split())


def image_files(image_dirs: Iterable[str]) -> list[tuple[Path, Path]]:
    """(folder, file) for every file under each folder, recursive, sorted by relative path."""
    found = []
    for folder in map(Path, image_dirs):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: not a folder")
        files = (path for path in folder.rglob("*") if path.is_file() and not path.name.startswith("."))
        found += [(folder, path) for path in sorted(files, key=lambda p: p.relative_to(folder).as_posix())]
    return found


def caption_for(path: Path, caption_from: str) -> str:
    if caption_from == "sidecar" and path.with_suffix(".txt").is_file():
        return path.with_suffix(".txt").read_text(encoding="utf-8", errors="replace")
    return "" if caption_from == "none" else path.stem


def records_from_folders(
    image_dirs: Iterable[str], caption_from: str, packed: list[str], skipped: list[str]
) -> Iterator[Record]:
    """Records of all readable images; the paths go to `packed` or, if unreadable, to `skipped`."""
    for folder, path in image_files(image_dirs):
        if path.suffix.lower() == ".txt" and caption_from == "sidecar":
            continue
        data = path.read_bytes()
        try:
            load_rgb(open_image(data, MAX_PIXELS))
        except BadImage:
            skipped.append(str(path))
            continue
        packed.append(str(path))
        yield Record(caption_for(path, caption_from), path.relative_to(folder).as_posix(), data)


def _write_part(path: Path, lines: list[bytes], use_gzip: bool) -> None:
    payload = b"".join(lines)
    path.write_bytes(gzip.compress(payload, **_GZIP_OPTIONS) if use_gzip else payload)


def write_parts(records: Iterable[Record], output_dir: str, lines_per_part: int, use_gzip: bool = True) -> list[Path]:
    """Write `records` into part-00000(.gz), ... with `lines_per_part` lines each; returns the paths."""
    if lines_per_part < 1:
        raise ValueError("lines_per_part must be >= 1")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if use_gzip else ".txt"
    written, pending = [], []
    for record in records:
        pending.append(record.to_line())
        if len(pending) == lines_per_part:
            written.append(out / PART_PATTERN.format(len(written), suffix))
            _write_part(written[-1], pending, use_gzip)
            pending = []
    if pending:
        written.append(out / PART_PATTERN.format(len(written), suffix))
        _write_part(written[-1], pending, use_gzip)
    return written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_dir", action="append", required=True, help="folder of images (repeatable)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--lines_per_part", type=int, default=1000)
    parser.add_argument("--gzip", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--caption_from", choices=["filename", "sidecar", "none"], default="filename",
        help="filename: the file stem; sidecar: the text of <stem>.txt if present, else the stem",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    packed: list[str] = []
    skipped: list[str] = []
    records = records_from_folders(args.image_dir, args.caption_from, packed, skipped)
    parts = write_parts(records, args.output_dir, args.lines_per_part, args.gzip)
    print(f"wrote {len(packed)} images into {len(parts)} part files in {args.output_dir}; skipped {len(skipped)} unreadable files")
    for path in skipped[:20]:
        print(f"  skipped: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
