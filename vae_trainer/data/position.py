"""Where the training stream is and what it skipped: each batch's ``"position"`` (:func:`encode_position`), the
resume state checkpoints hold (:class:`StreamPosition`) and where each shard starts again (:class:`ShardStart`).
The layout and the resume rule are in docs/data.md ("How the stream works")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import paddle

from . import images, records

# Why a training record was skipped: one data/skipped_<reason> scalar each.
SKIP_REASONS = images.REASONS + records.REASONS
_HEADER = 3  # shard, epoch, consumed
FILES_IN_POSITION = 64  # per shard, the part files with the most skips (every batch carries them)


def encode_position(shard: int, epoch: int, consumed: int, skipped: Counter, pending: list[int]) -> list[int]:
    """``[shard, epoch, consumed, *skipped per reason, num_pending, *pending, num_files, *(file, skips)]``:
    `skipped` counts per reason (str keys) and per part file (int keys, into ``ImageStream.part_paths``)."""
    files = sorted(((key, n) for key, n in skipped.items() if isinstance(key, int) and n),
                   key=lambda pair: (-pair[1], pair[0]))
    pairs = [value for pair in files[:FILES_IN_POSITION] for value in pair]
    return [shard, epoch, consumed, *(skipped[reason] for reason in SKIP_REASONS), len(pending), *pending,
            len(pairs) // 2, *pairs]


@dataclass
class ShardStart:
    """Where one shard starts: a position saved by :class:`StreamPosition` (or the beginning)."""

    epoch: int = 0
    consumed: int = 0
    pending: tuple[int, ...] = ()
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_files: dict[int, int] = field(default_factory=dict)  # part index -> skips

    def counts(self) -> Counter:
        """The skip counts to go on from: per reason (str keys) and per part file (int keys)."""
        return Counter({**self.skipped, **self.skipped_files})


class StreamPosition:
    """What a rank must save to resume its stream exactly, and its skip counts: :meth:`update` it with the
    ``"position"`` of every batch taken from the DataLoader. The loader workers, world size, seed and shuffle
    buffer size are kept to refuse a resume that would read the records in another order."""

    def __init__(self, num_workers: int | None = None, world_size: int | None = None, seed: int | None = None,
                 shuffle_buffer_size: int | None = None) -> None:
        self.num_workers, self.world_size = num_workers, world_size
        self.seed, self.shuffle_buffer_size = seed, shuffle_buffer_size
        self.positions: dict[int, tuple[int, int]] = {}  # shard -> (epoch, consumed)
        self.pending: dict[int, list[int]] = {}
        self.skipped: dict[int, dict[str, int]] = {}
        self.skipped_files: dict[int, dict[int | str, int]] = {}  # shard -> {part index (or saved path): skips}
        self.files: list[str] | None = None  # ImageStream.part_paths: names the part indices
        self.batches_consumed = 0

    def update(self, position) -> None:
        """Record one consumed batch from its ``"position"`` (a list of ints; arrays are accepted)."""
        if isinstance(position, paddle.Tensor):
            position = position.numpy()
        values = [int(value) for value in np.asarray(position).reshape(-1)]
        shard, epoch, consumed = values[:_HEADER]
        first = _HEADER + len(SKIP_REASONS) + 1
        num_pending = values[first - 1]
        self.positions[shard] = (epoch, consumed)
        self.pending[shard] = values[first : first + num_pending]
        self.skipped[shard] = {reason: n for reason, n in zip(SKIP_REASONS, values[_HEADER : first - 1]) if n}
        rest = values[first + num_pending :]
        if rest:  # (positions of older versions end after the pending records)
            pairs = rest[1 : 1 + 2 * rest[0]]
            self.skipped_files[shard] = dict(zip(pairs[::2], pairs[1::2]))
        self.batches_consumed += 1

    def skipped_totals(self) -> dict[str, int]:
        """Skipped records per reason (every reason, zeros included), summed over this rank's shards."""
        totals = sum(map(Counter, self.skipped.values()), Counter())
        return {reason: totals.get(reason, 0) for reason in SKIP_REASONS}

    def skipped_by_file(self) -> dict[str, int]:
        """Skipped records per part file (those with skips), summed over this rank's shards."""
        totals = Counter()
        for counts in self.skipped_files.values():
            totals.update({self._name(key): n for key, n in counts.items()})
        return dict(totals)

    def _name(self, key: int | str) -> str:
        return self.files[key] if isinstance(key, int) and self.files and key < len(self.files) else str(key)

    def _index(self, key: int | str) -> int | None:
        """A part index from a saved key: an index, or a path (None if no longer in the file list)."""
        if isinstance(key, int):
            return key
        if self.files and key in self.files:
            return self.files.index(key)
        return int(key) if key.isdigit() else None

    def start_of(self, shard: int) -> ShardStart:
        epoch, consumed = self.positions.get(shard, (0, 0))
        files = {self._index(key): n for key, n in self.skipped_files.get(shard, {}).items()}
        files.pop(None, None)
        return ShardStart(epoch, consumed, tuple(self.pending.get(shard, ())), dict(self.skipped.get(shard, {})), files)

    def state_dict(self) -> dict:
        """Plain ints, lists and string keys (files by path), so the state survives JSON as well as pickle."""
        return {
            "positions": {str(shard): list(position) for shard, position in sorted(self.positions.items())},
            "pending": {str(shard): list(pending) for shard, pending in sorted(self.pending.items()) if pending},
            "skipped": {str(shard): dict(counts) for shard, counts in sorted(self.skipped.items()) if counts},
            "skipped_files": {str(shard): {self._name(key): n for key, n in counts.items()}
                              for shard, counts in sorted(self.skipped_files.items()) if counts},
            "batches_consumed": self.batches_consumed,
            "num_workers": self.num_workers,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle_buffer_size": self.shuffle_buffer_size,
        }

    @classmethod
    def from_state(cls, state: dict) -> StreamPosition:
        position = cls(state.get("num_workers"), state.get("world_size"), state.get("seed"),
                       state.get("shuffle_buffer_size"))
        position.positions = {int(shard): (int(p[0]), int(p[1])) for shard, p in state["positions"].items()}
        position.pending = {int(shard): [int(i) for i in p] for shard, p in state.get("pending", {}).items()}
        position.skipped = {int(shard): {str(reason): int(n) for reason, n in counts.items()}
                            for shard, counts in state.get("skipped", {}).items()}
        position.skipped_files = {int(shard): {str(key): int(n) for key, n in counts.items()}
                                  for shard, counts in state.get("skipped_files", {}).items()}
        position.batches_consumed = int(state["batches_consumed"])
        return position

    def check_resume(self, world_size: int, seed: int, shuffle_buffer_size: int) -> None:
        """Raise ValueError if this state was saved by a run that read its records in another order."""
        if self.world_size not in (None, world_size):
            raise ValueError(f"resume_state was saved with world_size {self.world_size}, not {world_size}")
        saved = {"--seed": (self.seed, seed), "--shuffle_buffer_size": (self.shuffle_buffer_size, shuffle_buffer_size)}
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
