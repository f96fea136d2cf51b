"""--output_dir: refuse (or with --overwrite_output_dir clear) one that holds an earlier run, never deleting what
the run reads or what is not ours; refuse one the ranks do not share (docs/training.md)."""

import functools
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from .arguments import DataArguments, ModelArguments, VAETrainingArguments
from .checkpoint import ABANDONED_DIR, EVAL_METRICS_NAME, PREFIX, list_checkpoints, resume_requested
from .data.filelists import PIPE_PREFIX, read_sources
from .disk import delete_folder
from .distributed import all_ranks_agree, from_rank_0, rank, world_size

logger = logging.getLogger(__name__)

EXPORTS = ("vae", "vae_raw", "discriminator", EVAL_METRICS_NAME)  # what a run writes besides checkpoints
# What a save, export or deletion killed mid-way leaves (checkpoint.py, disk.py): checkpoint-N.tmp, vae.old, ...
LEFTOVER_RE = re.compile(rf"^({PREFIX}-\d+|{'|'.join(EXPORTS[:3])})\.(tmp|old)$")
LOG_FILES_NAME = "visualdl_records.txt"  # the VisualDL record files our runs wrote, relative to OUTPUT_DIR


def prepare_output_dir(args: VAETrainingArguments, reads: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Check that all ranks share --output_dir; unless resuming, refuse or clear (--overwrite_output_dir) an earlier
    run, refusing to clear what the run reads (`reads`, flag -> path)."""
    check_shared(args.output_dir)
    if resume_requested(args.resume_from_checkpoint):
        return
    with all_ranks_agree("checking --output_dir"):  # also where the other ranks wait until rank 0 has cleared
        found = []  # the earlier run's checkpoints (complete or not) and exports
        if rank() == 0:
            found = [os.path.basename(path) for _, path in list_checkpoints(args.output_dir, complete=False)]
            found += [name for name in EXPORTS if os.path.exists(os.path.join(args.output_dir, name))]
        if not found:
            return
        if not args.overwrite_output_dir:
            raise FileExistsError(
                f"--output_dir {args.output_dir} already holds an earlier run ({', '.join(found)}). Continue it with "
                "--resume_from_checkpoint latest, or start over with --overwrite_output_dir (deletes its "
                "checkpoints, logs and exports), or choose another --output_dir.")
        refuse_to_delete_inputs(args.output_dir, reads or {})
        clear_run(args.output_dir)
        logger.info("--overwrite_output_dir: deleted the earlier run's %s in %s", ", ".join(found), args.output_dir)


def check_shared(output_dir: str) -> None:
    """Refuse a --output_dir that is not one folder for all ranks: every rank must read back rank 0's random file."""
    if world_size() < 2:
        return
    token = from_rank_0(secrets.token_hex(8))
    path = os.path.join(output_dir, f".shared_check_{token}")
    try:
        with all_ranks_agree("creating --output_dir"):
            if rank() == 0:
                os.makedirs(output_dir, exist_ok=True)
                Path(path).write_text(token)
        with all_ranks_agree("checking that --output_dir is shared"):
            if not os.path.isfile(path) or Path(path).read_text() != token:
                raise ValueError(
                    f"--output_dir {output_dir} is not shared: rank {rank()} does not see the file rank 0 wrote "
                    "there. All ranks (all nodes) must write into one folder on a shared file system (e.g. an NFS "
                    "or Lustre mount), named the same on every node.")
    finally:
        if rank() == 0 and os.path.exists(path):
            os.remove(path)


def run_inputs(model_args: ModelArguments, data_args: DataArguments) -> Dict[str, Optional[str]]:
    """Flag -> path of everything a run reads that an --output_dir could hold (a resumed run clears nothing)."""
    names = ("pretrained_model_name_or_path", "vae_config_file", "init_from_ckpt", "discriminator_path",
             "lpips_weights", "file_list", "eval_file_list", "inception_weights")
    reads = {f"--{name}": getattr(model_args if hasattr(model_args, name) else data_args, name) for name in names}
    pretrained = model_args.pretrained_model_name_or_path
    if pretrained and model_args.subfolder:
        reads["--pretrained_model_name_or_path"] = os.path.join(pretrained, model_args.subfolder)
    return reads


def doomed_paths(output_dir: str) -> List[str]:
    """What `clear_run` would delete."""
    listed = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    names = [name for name in listed if LEFTOVER_RE.match(name)] + [*EXPORTS, ABANDONED_DIR, LOG_FILES_NAME]
    paths = [path for _, path in list_checkpoints(output_dir, complete=False)]
    paths += [os.path.join(output_dir, name) for name in names] + _noted_log_files(output_dir)
    return [path for path in paths if os.path.lexists(path)]


def refuse_to_delete_inputs(output_dir: str, reads: Dict[str, Optional[str]]) -> None:
    """Refuse, naming the first, when clearing `output_dir` would delete an input (`reads`: flag -> given path). A
    file list counts with the lists and parts it names."""
    doomed = {os.path.realpath(path): path for path in doomed_paths(output_dir)}
    real_folder = functools.lru_cache(maxsize=None)(os.path.realpath)  # a file list's 100k parts share few folders
    for flag, given in reads.items():
        if not given or given.startswith(PIPE_PREFIX):
            continue
        for member in _file_list_members(given) if flag.endswith("file_list") else [given]:
            folder, name = os.path.split(os.path.abspath(member))
            real = os.path.join(real_folder(folder), name)
            real = os.path.realpath(real) if os.path.islink(real) else real
            while real not in doomed and os.path.dirname(real) != real:  # is it, or one of its folders, doomed?
                real = os.path.dirname(real)
            if real in doomed:
                named = "" if member == given else f" (it names {member})"
                copy = f"{os.path.normpath(output_dir)}_{os.path.basename(os.path.normpath(doomed[real]))}"
                raise FileExistsError(
                    f"--overwrite_output_dir would delete {doomed[real]}, which this run reads: {flag} {given}{named}. "
                    f"Nothing was deleted. Copy it out of {output_dir} first and give {flag} the copy (e.g. cp -r "
                    f"{doomed[real]} {copy}), or continue the earlier run with --resume_from_checkpoint latest instead "
                    "of starting over, or choose another --output_dir.")


def _file_list_members(file_list: str) -> List[str]:
    """The list and every local filelist, folder and part it names; just the list if it cannot be read now."""
    try:
        sources = read_sources(file_list, counts=False)
    except Exception:  # noqa: BLE001 - a broken list is reported where the data is built, with file:line
        return [file_list]
    names = [source.name for source in sources] + [part.path for source in sources for part in source.parts]
    return [file_list] + [name for name in names if not name.startswith(PIPE_PREFIX)]


def clear_run(output_dir: str) -> None:
    """Delete `doomed_paths`, then the log folders inside OUTPUT_DIR they leave empty; nothing else."""
    log_files = _noted_log_files(output_dir)  # (before the listing is deleted)
    for path in doomed_paths(output_dir):
        if not os.path.lexists(path) or (path in log_files and not os.path.isfile(path)):
            continue
        if re.fullmatch(rf"{PREFIX}-\d+", os.path.basename(path)):  # a checkpoint: via checkpoint-N.old, which the
            delete_folder(path)  # next start removes if this one is killed
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    top = os.path.abspath(output_dir)
    for folder in {os.path.abspath(os.path.dirname(path)) for path in log_files}:
        inside = folder != top and os.path.commonpath([folder, top]) == top
        if inside and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def note_log_file(output_dir: str, record_file: str) -> None:
    """Remember that a run in `output_dir` writes the VisualDL record file `record_file` (rank 0 only)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, LOG_FILES_NAME), "a") as handle:
        handle.write(os.path.relpath(os.path.abspath(record_file), os.path.abspath(output_dir)) + "\n")


def _noted_log_files(output_dir: str) -> List[str]:
    """The record files noted in `output_dir` (only VisualDL record names: an edited list deletes nothing else)."""
    listing = Path(output_dir, LOG_FILES_NAME)
    lines = listing.read_text().split("\n") if listing.is_file() else []
    paths = [os.path.normpath(os.path.join(output_dir, line.strip())) for line in lines if line.strip()]
    return [path for path in paths if os.path.basename(path).startswith("vdlrecords.")]  # VisualDL's names
