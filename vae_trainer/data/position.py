"""Where the training stream is, and what it skipped: the per-batch ``"position"``, the resume state that
checkpoints hold (:class:`StreamPosition`), and where each shard starts again (:class:`ShardStart`).

A batch's position is a list of ints (:func:`encode_position`):
``[shard, epoch, consumed, *skipped, num_pending, *pending, num_files, *(file, skips)]``; the meaning of each
field is in :mod:`vae_trainer.data.dataset` ("Batches and positions"). The trailing pairs are the shard's
skip counts per part file (an index into ``ImageStream.part_paths``; the :data:`FILES_IN_POSITION` files
with the most skips), so that the end-of-run summary can name the broken parts. Plain ints pass through the DataLoader and the
Trainer without becoming device tensors, so tracking costs no device synchronisation.

The resume state also records what the positions are relative to: the number of DataLoader workers
and ranks (shards), the data seed (--seed: which records each shard reads and in which order) and
--shuffle_buffer_size (the shuffle blocks). Resuming with any of them changed is refused
(:meth:`StreamPosition.check_resume`): a position counts records in that run's order, and would point
elsewhere in another. States saved before the seed and buffer size were recorded are not checked for them.
"""

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
    """A batch's ``"position"`` (module doc). `skipped` counts per reason (str keys) and per part file (int
    keys: indices into ``ImageStream.part_paths``)."""
    files = sorted(((key, n) for key, n in skipped.items() if isinstance(key, int) and n), key=lambda kv: (-kv[1], kv[0]))
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


class StreamPosition:
    """What the trainer must save to resume the stream exactly, and the skip counts of this rank.

    Call :meth:`update` with ``batch["position"]`` of every batch the trainer takes from the
    DataLoader (one instance per rank). `num_workers`, `world_size`, `seed` and `shuffle_buffer_size`
    are stored to refuse a resume that would read the records in another order.
    """

    def __init__(self, num_workers: int | None = None, world_size: int | None = None, seed: int | None = None,
                 shuffle_buffer_size: int | None = None) -> None:
        self.num_workers, self.world_size = num_workers, world_size
        self.seed, self.shuffle_buffer_size = seed, shuffle_buffer_size
        self.positions: dict[int, tuple[int, int]] = {}
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
        counts = values[_HEADER : _HEADER + len(SKIP_REASONS)]
        num_pending = values[_HEADER + len(SKIP_REASONS)]
        first = _HEADER + len(SKIP_REASONS) + 1
        self.positions[shard] = (epoch, consumed)
        self.pending[shard] = values[first : first + num_pending]
        self.skipped[shard] = {reason: count for reason, count in zip(SKIP_REASONS, counts) if count}
        rest = values[first + num_pending :]
        if rest:  # (positions of older versions end after the pending records)
            pairs = rest[1 : 1 + 2 * rest[0]]
            self.skipped_files[shard] = dict(zip(pairs[::2], pairs[1::2]))
        self.batches_consumed += 1

    def skipped_totals(self) -> dict[str, int]:
        """Skipped records per reason (every reason, zeros included), summed over this rank's shards."""
        totals = Counter()
        for counts in self.skipped.values():
            totals.update(counts)
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
        """A part index from a saved key: a path (looked up in `files`) or an index."""
        if isinstance(key, int):
            return key
        if self.files and key in self.files:
            return self.files.index(key)
        return int(key) if key.isdigit() else None  # a path no longer in the file list: dropped

    def start_of(self, shard: int) -> ShardStart:
        epoch, consumed = self.positions.get(shard, (0, 0))
        files = {self._index(key): n for key, n in self.skipped_files.get(shard, {}).items()}
        return ShardStart(epoch, consumed, tuple(self.pending.get(shard, ())), dict(self.skipped.get(shard, {})),
                          {index: n for index, n in files.items() if index is not None})

    def state_dict(self) -> dict:
        """Plain ints, lists and string keys, so the state survives JSON as well as pickle."""
        return {
            "positions": {str(shard): list(position) for shard, position in sorted(self.positions.items())},
            "pending": {str(shard): list(pending) for shard, pending in sorted(self.pending.items()) if pending},
            "skipped": {str(shard): dict(counts) for shard, counts in sorted(self.skipped.items()) if counts},
            # by path, so that a checkpoint names its files whatever the order of a later file list
            "skipped_files": {str(shard): {self._name(key): n for key, n in counts.items()}
                              for shard, counts in sorted(self.skipped_files.items()) if counts},
            "batches_consumed": self.batches_consumed,
            "num_workers": self.num_workers,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle_buffer_size": self.shuffle_buffer_size,
        }

    def load_state_dict(self, state: dict) -> None:
        self.positions = {int(shard): (int(p[0]), int(p[1])) for shard, p in state["positions"].items()}
        self.pending = {int(shard): [int(i) for i in p] for shard, p in state.get("pending", {}).items()}
        self.skipped = {int(shard): {str(r): int(n) for r, n in counts.items()}
                        for shard, counts in state.get("skipped", {}).items()}
        self.skipped_files = {int(shard): {str(key): int(n) for key, n in counts.items()}
                              for shard, counts in state.get("skipped_files", {}).items()}
        self.batches_consumed = int(state["batches_consumed"])
        self.num_workers, self.world_size = state.get("num_workers"), state.get("world_size")
        self.seed, self.shuffle_buffer_size = state.get("seed"), state.get("shuffle_buffer_size")

    @classmethod
    def from_state(cls, state: dict) -> StreamPosition:
        tracker = cls()
        tracker.load_state_dict(state)
        return tracker

    def check_resume(self, world_size: int, seed: int, shuffle_buffer_size: int) -> None:
        """Raise ValueError if this state was saved by a run that read its records in another order."""
        if self.world_size not in (None, world_size):
            raise ValueError(f"resume_state was saved with world_size {self.world_size}, not {world_size}")
        saved = {"--seed": self.seed, "--shuffle_buffer_size": self.shuffle_buffer_size}
        now = {"--seed": seed, "--shuffle_buffer_size": shuffle_buffer_size}
        changed = [f"{flag} {saved[flag]} (this run: {now[flag]})" for flag in saved
                   if saved[flag] is not None and saved[flag] != now[flag]]
        if changed:
            raise ValueError(
                f"the checkpoint's data position was saved with {', '.join(changed)}; it counts records in that "
                "run's order, so resuming exactly needs the same values: resume with them, or start a new run "
                "(--init_from_ckpt) to change them")

    def check_workers(self, num_workers: int) -> None:
        """Raise if the state was saved with a different number of DataLoader workers."""
        if self.num_workers is not None and max(1, self.num_workers) != num_workers:
            raise ValueError(
                f"resume_state was saved with num_workers={self.num_workers}; exact resume needs the same "
                f"number of DataLoader workers, this run has {num_workers}"
            )
