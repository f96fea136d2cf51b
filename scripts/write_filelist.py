"""Write a ``.filelist`` (part files of folders) or a ``.filelist.list`` (weighted filelists).

Paths are written relative to the output file's folder (absolute with ``--absolute``), which is how
the reader resolves them.

    python scripts/write_filelist.py --parts_dir data/demo/train --output data/filelist/train.filelist
    python scripts/write_filelist.py --filelists a.filelist b.filelist:3 --output mix.filelist.list
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path


def _reference(target: str, output: str, absolute: bool) -> str:
    """How `output` should name `target`: relative to output's folder when possible."""
    target = os.path.abspath(target)
    if absolute:
        return target
    try:
        return os.path.relpath(target, os.path.dirname(os.path.abspath(output)))
    except ValueError:  # e.g. another drive on Windows
        return target


def part_files(parts_dirs: Iterable[str], pattern: str = "*", exclude: str | None = None) -> list[str]:
    """Files directly in each folder matching `pattern`, sorted, without hidden/underscore files."""
    found = []
    for folder in parts_dirs:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder}: not a folder")
        names = sorted(
            name for name in os.listdir(folder)
            if fnmatch.fnmatch(name, pattern) and not name.startswith((".", "_"))
            and os.path.isfile(os.path.join(folder, name))
        )
        found += [os.path.join(folder, name) for name in names]
    if exclude is not None:
        found = [path for path in found if os.path.abspath(path) != os.path.abspath(exclude)]
    return found


def write_part_filelist(parts: list[str], output: str, absolute: bool = False) -> None:
    """A ``.filelist`` naming `parts`."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text("".join(_reference(part, output, absolute) + "\n" for part in parts))


def parse_weighted(spec: str) -> tuple[str, float]:
    """``path[:weight]`` -> (path, weight); a suffix that is not a number is part of the path."""
    path, _, weight = spec.rpartition(":")
    try:
        value = float(weight)
    except ValueError:
        return spec, 1.0
    if not path or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{spec}: weight must be a finite number > 0")
    return path, value


def write_filelist_list(entries: list[tuple[str, float]], output: str, absolute: bool = False) -> None:
    """A ``.filelist.list`` naming each (filelist, weight)."""
    lines = []
    for filelist, weight in entries:
        reference = _reference(filelist, output, absolute)
        if any(character.isspace() for character in reference):
            raise ValueError(f"{reference}: paths in a .filelist.list cannot contain whitespace")
        lines.append(f"{reference} {weight:g}\n")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text("".join(lines))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--parts_dir", nargs="+", help="folders of part files -> a .filelist")
    kind.add_argument("--filelists", nargs="+", help="a.filelist[:weight] ... -> a .filelist.list")
    parser.add_argument("--output", required=True)
    parser.add_argument("--pattern", default="*", help="glob for part file names (default: all files)")
    parser.add_argument("--absolute", action="store_true", help="write absolute paths")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parts_dir:
        parts = part_files(args.parts_dir, args.pattern, exclude=args.output)
        if not parts:
            raise SystemExit(f"no part files matching {args.pattern!r} in {args.parts_dir}")
        write_part_filelist(parts, args.output, args.absolute)
        print(f"wrote {args.output}: {len(parts)} part files")
    else:
        entries = [parse_weighted(spec) for spec in args.filelists]
        for path, _ in entries:
            if not os.path.isfile(path):
                raise SystemExit(f"{path}: not found")
        write_filelist_list(entries, args.output, args.absolute)
        print(f"wrote {args.output}: {len(entries)} filelists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
