"""Write a ``.filelist`` (part files or tar shards of folders) with its ``.counts``, a ``.filelist.list``
(weighted sources), or the ``.counts`` of an existing filelist.

Paths are written relative to the output file's folder (absolute with ``--absolute``), which is how
the reader resolves them. The ``.counts`` file (``NAME<TAB>records<TAB>bytes`` per part) lets the
trainer give every shard an equal share of records, so every image is shown equally often (see
vae_trainer/data/sharding.py); counting reads every part once (``--jobs`` in parallel).

    python scripts/write_filelist.py --parts_dir data/demo/train --output data/filelist/train.filelist
    python scripts/write_filelist.py --filelists a.filelist b.filelist:3 photos_folder:2 --output mix.filelist.list
    python scripts/write_filelist.py --count /data/laion400m/laion.filelist --jobs 16
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import sys
from collections.abc import Iterable
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from vae_trainer.data.filelists import COUNTS_SUFFIX, IMAGE, PIPE_PREFIX, Part, is_tar_spec, read_filelist  # noqa: E402
from vae_trainer.data.records import Damaged, iterate_records  # noqa: E402


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


def _count(part: Part) -> tuple[int, str | None]:
    """(readable records, the damage's detail if any), reading the whole part once."""
    records, damage = 0, None
    for payload in iterate_records(part, start=1 << 62):  # (None for each record: nothing kept)
        if isinstance(payload, Damaged):
            damage = payload.detail
        else:
            records += 1
    return records, damage


def write_counts(filelist: str, jobs: int = 1) -> tuple[str, int, list[str]]:
    """Count the records of every part of `filelist` into ``<filelist>.counts``.

    Returns (counts file, records in all, messages about damaged parts, whose readable records count).
    """
    parts = [part for part in read_filelist(filelist, counts=False).parts if part.kind != IMAGE]
    with Pool(max(1, jobs)) as pool:
        results = pool.map(_count, parts, chunksize=1) if jobs > 1 else list(map(_count, parts))
    output = os.path.abspath(filelist) + COUNTS_SUFFIX
    rows, damaged = ["# records per part (NAME, records, bytes), written by scripts/write_filelist.py\n"], []
    for part, (records, damage) in zip(parts, results):
        local = not part.path.startswith(PIPE_PREFIX)
        name = _reference(part.path, output, False) if local else part.path
        rows.append(f"{name}\t{records}\t{os.path.getsize(part.path) if local else '-'}\n")
        if damage:
            damaged.append(f"{part.path}: {damage} (its {records} readable records are counted)")
    Path(output).write_text("".join(rows))
    return output, sum(records for records, _ in results), damaged


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
    kind.add_argument("--parts_dir", nargs="+", help="folders of part files (or .tar shards) -> a .filelist + .counts")
    kind.add_argument("--filelists", nargs="+",
                      help="a.filelist[:weight], image folders, tar patterns ... -> a .filelist.list")
    kind.add_argument("--count", metavar="FILELIST", help="write FILELIST.counts for an existing .filelist")
    parser.add_argument("--output", help="the file to write (with --parts_dir / --filelists)")
    parser.add_argument("--pattern", default="*", help="glob for part file names (default: all files)")
    parser.add_argument("--absolute", action="store_true", help="write absolute paths")
    parser.add_argument("--no_counts", action="store_true", help="with --parts_dir: do not count records")
    parser.add_argument("--jobs", type=int, default=1, help="processes counting records in parallel")
    args = parser.parse_args(argv)
    if args.count is None and args.output is None:
        parser.error("--output is required with --parts_dir and --filelists")
    return args


def _report_counts(filelist: str, jobs: int) -> None:
    output, total, damaged = write_counts(filelist, jobs)
    print(f"wrote {output}: {total} records")
    for message in damaged:
        print(f"  damaged: {message}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parts_dir:
        parts = part_files(args.parts_dir, args.pattern, exclude=args.output)
        if not parts:
            raise SystemExit(f"no part files matching {args.pattern!r} in {args.parts_dir}")
        write_part_filelist(parts, args.output, args.absolute)
        print(f"wrote {args.output}: {len(parts)} part files")
        if not args.no_counts:
            _report_counts(args.output, args.jobs)
    elif args.count:
        _report_counts(args.count, args.jobs)
    else:
        entries = [parse_weighted(spec) for spec in args.filelists]
        for path, _ in entries:
            if not (os.path.exists(path) or is_tar_spec(path)):
                raise SystemExit(f"{path}: not found")
        write_filelist_list(entries, args.output, args.absolute)
        print(f"wrote {args.output}: {len(entries)} filelists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
