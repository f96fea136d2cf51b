"""Where the training stream is and what it skipped: each batch's ``"position"`` (:func:`encode_position`) and the
resume state a rank checkpoints (:class:`StreamPosition`); the layout and the resume rule are in docs/data.md."""

from collections import Counter

import numpy as np

# What reading counts, one slot each in a batch's position: why a training record was skipped (BadImage.reason,
# Damaged.reason: one data/skipped_<reason> scalar each), then the NOTES (a saved state names them: older ones load).
SKIP_REASONS = ("base64", "not_image", "truncated", "too_small", "too_large", "unsupported",  # the image
                "columns", "no_image", "unreadable", "corrupt_gzip", "corrupt_tar", "missing", "missing_file",
                "not_video", "too_short", "opaque")  # a clip; a note
OPAQUE = "opaque"  # a note: an image without alpha that a 4-channel (RGBA) VAE reads as opaque (alpha 1)
NOTES = (OPAQUE,)  # records used, not skipped: counted (not per file) and summarised apart from the skips
FILES_IN_POSITION = 64  # per shard, the part files with the most skips (every batch carries them)
NUMBERS_KEPT = 8  # per part file, the smallest bad record numbers kept (the end-of-run summary shows them)
_PER_SHARD = ("positions", "pending", "skipped", "skipped_files", "bad_records")  # the state's {shard: ...} entries
_SETTINGS = ("num_workers", "world_size", "seed", "shuffle_buffer_size")  # what the reading order depends on


def encode_position(shard: int, epoch: int, consumed: int, skipped: Counter, pending: list[int],
                    bad: dict[int, list[int]]) -> list[int]:
    """``[shard, epoch, consumed, *skipped per reason, num_pending, *pending, *(file, skips, n, bad, *n numbers)]``:
    `skipped` counts per reason (str keys) and per part file (int keys, into ``ImageStream.part_paths``); `bad`: per
    part file, its distinct bad records and their smallest numbers (:func:`note_bad`)."""
    files = sorted(((key, n) for key, n in skipped.items() if isinstance(key, int) and n),
                   key=lambda pair: (-pair[1], pair[0]))
    entries = [(key, n, bad.get(key, [0])) for key, n in files[:FILES_IN_POSITION]]
    groups = [value for key, n, entry in entries for value in (key, n, len(entry) - 1, *entry)]
    return [shard, epoch, consumed, *(skipped[reason] for reason in SKIP_REASONS), len(pending), *pending, *groups]


def note_bad(bad: dict[int, list[int]], part: int, number: int | None) -> None:
    """Count a bad record of part `part` read for the first time: ``bad[part] = [distinct bad records, *their
    NUMBERS_KEPT smallest numbers]`` (`number` None: an image file, nothing to number). A new list: never the saved."""
    count, *numbers = bad.get(part, [0])
    bad[part] = [count + 1, *sorted({*numbers, number} - {None})[:NUMBERS_KEPT]]


def merge_file_skips(into: dict[str, list[int]], files: dict[str, list[int]]) -> dict[str, list[int]]:
    """Add `files`, {path: [skips, distinct bad records, *smallest numbers]} of other shards (whose records are
    others: the distinct counts add up), into `into`."""
    for path, (skips, count, *numbers) in files.items():
        had_skips, had_count, *had = into.get(path, [0, 0])
        into[path] = [had_skips + skips, had_count + count, *sorted({*had, *numbers})[:NUMBERS_KEPT]]
    return into


class StreamPosition:
    """A rank's resume state in its saved layout ({str(shard): ...}, files by path), :meth:`update`d with every batch
    taken; workers, world size, seed and shuffle buffer refuse a resume that would read in another order."""

    def __init__(self, num_workers: int | None = None, world_size: int | None = None, seed: int | None = None,
                 shuffle_buffer_size: int | None = None) -> None:
        self.num_workers, self.world_size = num_workers, world_size
        self.seed, self.shuffle_buffer_size = seed, shuffle_buffer_size
        self.positions, self.pending, self.skipped = {}, {}, {}  # shard -> [epoch, consumed], [indices], {reason: n}
        self.skipped_files: dict[str, dict[str, int]] = {}  # shard -> {part path: skips}
        self.bad_records: dict[str, dict[str, list[int]]] = {}  # shard -> {part path: [bad records, *numbers]}
        self.files, self.batches_consumed = None, 0  # ImageStream.part_paths (names the part indices); batches taken

    def update(self, position) -> None:
        """Record one consumed batch from its ``"position"`` (a list, an array or a tensor of ints)."""
        values = [int(value) for value in np.asarray(position).reshape(-1)]
        shard, first = str(values[0]), 4 + len(SKIP_REASONS)
        self.positions[shard] = values[1:3]
        self.pending[shard] = values[first : first + values[first - 1]]
        self.skipped[shard] = {reason: n for reason, n in zip(SKIP_REASONS, values[3 : first - 1]) if n}
        self.skipped_files[shard], self.bad_records[shard] = files, bad = {}, {}
        at = first + values[first - 1]
        while at < len(values):  # (file, skips, n, bad records, *n numbers) groups
            key, n, kept = values[at : at + 3]
            name = self.files[key] if self.files else str(key)
            files[name], bad[name], at = n, values[at + 3 : at + 4 + kept], at + 4 + kept
        self.batches_consumed += 1

    def skipped_totals(self) -> dict[str, int]:
        """Skipped records per reason (every reason, zeros included), summed over this rank's shards."""
        totals = sum(map(Counter, self.skipped.values()), Counter())
        return {reason: totals.get(reason, 0) for reason in SKIP_REASONS}

    def skipped_by_file(self) -> dict[str, list[int]]:
        """Per part file with skips, over this rank's shards: [skips, distinct bad records, *their smallest numbers]
        (a checkpoint of an earlier version has no bad records: counted from its resume on)."""
        merged: dict[str, list[int]] = {}
        for shard, files in self.skipped_files.items():
            bad = self.bad_records.get(shard, {})
            merge_file_skips(merged, {path: [n, *bad.get(path, [0])] for path, n in files.items()})
        return merged

    def start_of(self, shard: int) -> tuple[int, int, set[int], Counter, dict[int, list[int]]]:
        """Where `shard` starts again (the beginning, or a saved position) and the skip counts it goes on from:
        (epoch, consumed, pending, counts per reason (str keys) and per part index (int keys), note_bad's distinct
        bad records per part index); saved skips of a part no longer listed are dropped."""
        key = str(shard)
        epoch, consumed = self.positions.get(key, (0, 0))
        indices = {path: index for index, path in enumerate(self.files or [])}
        files, bad = ({indices[name] if name in indices else int(name): value
                       for name, value in saved.get(key, {}).items() if name in indices or name.isdigit()}
                      for saved in (self.skipped_files, self.bad_records))
        counts = Counter({**self.skipped.get(key, {}), **files})
        return epoch, consumed, set(self.pending.get(key, ())), counts, bad

    def state_dict(self) -> dict:
        """Plain ints, lists and string keys, so the state survives JSON as well as pickle."""
        state = {name: {shard: value for shard, value in getattr(self, name).items() if value} for name in _PER_SHARD}
        return {**state, "batches_consumed": self.batches_consumed, **{name: getattr(self, name) for name in _SETTINGS}}

    @classmethod
    def from_state(cls, state: dict) -> "StreamPosition":
        position = cls(*(state.get(name) for name in _SETTINGS))
        for name in _PER_SHARD:
            setattr(position, name, {str(shard): value for shard, value in state.get(name, {}).items()})
        position.batches_consumed = int(state["batches_consumed"])
        return position

    def check_resume(self, world_size: int, seed: int, shuffle_buffer_size: int) -> None:
        """Raise ValueError if this state was saved by a run that read its records in another order."""
        saved = {"world_size": (self.world_size, world_size), "--seed": (self.seed, seed),
                 "--shuffle_buffer_size": (self.shuffle_buffer_size, shuffle_buffer_size)}
        changed = [f"{flag} {then} (this run: {now})" for flag, (then, now) in saved.items()
                   if then is not None and then != now]
        if changed:
            raise ValueError(
                f"the checkpoint's data position was saved with {', '.join(changed)}; it counts records in that "
                "run's order, so resuming exactly needs the same values: resume with them, or start a new run "
                "(--init_from_ckpt) to change them")

    def check_workers(self, num_workers: int) -> None:
        """Raise if the state was saved with a different number of DataLoader workers."""
        if self.num_workers is not None and max(1, self.num_workers) != num_workers:
            raise ValueError(f"resume_state was saved with num_workers={self.num_workers}; exact resume needs the "
                             f"same number of DataLoader workers, this run has {num_workers}")
