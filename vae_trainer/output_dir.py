"""What our runs write into --output_dir besides the checkpoints' contents, and a new run's safety there.

A new run never eats an earlier one: `prepare_output_dir` (called by both drivers before anything is
written) refuses to start into an OUTPUT_DIR that holds checkpoints or exports of an earlier run unless
the user chose --resume_from_checkpoint (continue it) or --overwrite_output_dir (delete that run's files
first). Rank 0 decides and deletes; the other ranks learn the decision from it.

--overwrite_output_dir deletes only what our runs wrote, and nothing it cannot prove is ours:
checkpoint-N folders (complete, `.tmp`, `.old`), the exports (vae/, vae_raw/, discriminator/), and the
VisualDL record files listed in `OUTPUT_DIR/visualdl_records.txt`, to which every run appends the
record file it opens (`note_log_file`). A log folder left empty by that is removed too if it is inside
OUTPUT_DIR. Everything else stays: the user's own files (also when --logging_dir is OUTPUT_DIR itself),
`launch_logs/`, and the record files of other runs that share a --logging_dir.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import List

import paddle
import paddle.distributed as dist

from .checkpoint import delete_checkpoint, list_checkpoints, remove_unfinished, resume_requested
from .distributed import rank, world_size

logger = logging.getLogger(__name__)

EVAL_METRICS_NAME = "eval_metrics.jsonl"  # one line per in-training evaluation (evaluation.TrainingEvaluator)
# What a run writes into OUTPUT_DIR besides checkpoints: export.export_run's folders at the end, the evaluations.
EXPORTS = ("vae", "vae_raw", "discriminator", EVAL_METRICS_NAME)
# The VisualDL record files our runs in OUTPUT_DIR wrote, one path per line, relative to OUTPUT_DIR.
LOG_FILES_NAME = "visualdl_records.txt"
_RECORD_PREFIX = "vdlrecords."  # what VisualDL names its record files


def earlier_run(output_dir: str) -> List[str]:
    """Names in `output_dir` that belong to an earlier run: complete checkpoints and final exports."""
    names = [os.path.basename(path) for _, path in list_checkpoints(output_dir)]
    return names + [name for name in EXPORTS if os.path.exists(os.path.join(output_dir, name))]


def prepare_output_dir(args) -> None:
    """Refuse, or clear with --overwrite_output_dir, an --output_dir that holds an earlier run.

    Decided once, by rank 0, and broadcast, so that all ranks refuse together and only rank 0 deletes
    (the others wait for it). Resuming (--resume_from_checkpoint) leaves the folder as it is.
    """
    if resume_requested(args.resume_from_checkpoint):
        return
    found = earlier_run(args.output_dir) if rank() == 0 else []
    if found and args.overwrite_output_dir and rank() == 0:
        clear_run(args.output_dir)
        logger.info("--overwrite_output_dir: deleted the earlier run's %s in %s", ", ".join(found), args.output_dir)
    refused = bool(found) and not args.overwrite_output_dir
    if world_size() > 1:  # also the point where the other ranks wait until rank 0 has cleared
        shared = paddle.to_tensor([int(refused)], dtype="int64")
        dist.broadcast(shared, src=0)
        refused = bool(shared.item())
    if refused:
        shown = ", ".join(found) if found else "checkpoints"
        raise FileExistsError(
            f"--output_dir {args.output_dir} already holds an earlier run ({shown}). Continue it with "
            "--resume_from_checkpoint latest, or start over with --overwrite_output_dir (deletes its checkpoints, "
            "logs and exports), or choose another --output_dir.")


def clear_run(output_dir: str) -> None:
    """Delete an earlier run's checkpoints (complete or not), exports and VisualDL record files, nothing else."""
    for _, path in list_checkpoints(output_dir):
        delete_checkpoint(path)
    remove_unfinished(output_dir)
    for name in EXPORTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    _remove_log_files(output_dir)


def note_log_file(output_dir: str, record_file: str) -> None:
    """Remember that a run in `output_dir` writes the VisualDL record file `record_file` (rank 0 only)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, LOG_FILES_NAME), "a") as handle:
        handle.write(os.path.relpath(os.path.abspath(record_file), os.path.abspath(output_dir)) + "\n")


def _noted_log_files(output_dir: str) -> List[str]:
    """Absolute paths of the record files noted in `output_dir`; only VisualDL record names count, so an
    edited list cannot make --overwrite_output_dir delete anything else."""
    listing = os.path.join(output_dir, LOG_FILES_NAME)
    if not os.path.isfile(listing):
        return []
    with open(listing) as handle:
        names = [line.strip() for line in handle if line.strip()]
    paths = [os.path.normpath(os.path.join(output_dir, name)) for name in names]
    return [path for path in paths if os.path.basename(path).startswith(_RECORD_PREFIX)]


def _remove_log_files(output_dir: str) -> None:
    folders = set()
    for path in _noted_log_files(output_dir):
        if os.path.isfile(path):
            os.remove(path)
        folders.add(os.path.dirname(path))
    listing = os.path.join(output_dir, LOG_FILES_NAME)
    if os.path.exists(listing):
        os.remove(listing)
    for folder in folders:  # a log folder of ours that is now empty (not OUTPUT_DIR itself)
        if _strictly_inside(folder, output_dir) and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def _strictly_inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path != folder and os.path.commonpath([path, folder]) == folder

