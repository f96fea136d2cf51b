"""Checkpoints `OUTPUT_DIR/checkpoint-N/`: written atomically (fsynced, manifest last), found again (`latest`,
complete ones only), loaded, rotated and set aside on a rollback (docs/reliability.md)."""

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle

from .disk import (delete_folder, failed_write, folder_bytes, fsync_path, is_disk_error, publish_folder, replace_file,
                   tensor_bytes)
from .distributed import all_ranks_agree, from_rank_0, rank, world_size
from .precision import HALF_DTYPES

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"
MODEL_NAME = "model_state.pdparams"
TRAINER_STATE_NAME = "trainer_state.json"
VAE_CONFIG_NAME = "vae_config.json"
DISCRIMINATOR_CONFIG_NAME = "discriminator_config.json"
EXPORT_CONFIG_NAME = "export_config.json"
MANIFEST_NAME = "manifest.json"  # {"files": {name: size}} of the other files, written last
ABANDONED_DIR = "abandoned"  # later checkpoints set aside when a run resumes from an earlier one
EVAL_METRICS_NAME = "eval_metrics.jsonl"  # one line per in-training evaluation
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_UNFINISHED_RE = re.compile(rf"^{PREFIX}-\d+\.(tmp|old)$")  # interrupted saves and deletions
_RANK_STATE_RE = re.compile(r"^rank_state_(\d+)\.pdparams$")
_reported: set = set()  # incomplete checkpoints already warned about


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def list_checkpoints(output_dir: str, complete: bool = True) -> List[Tuple[int, str]]:
    """(step, path) of the complete checkpoints (`complete=False`: every `checkpoint-N` folder), oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match, path = _CHECKPOINT_RE.match(name), os.path.join(output_dir, name)
        if not match or not os.path.isdir(path):
            continue
        problem = checkpoint_problem(path) if complete else None
        if not problem:
            found.append((int(match.group(1)), path))
        elif path not in _reported:
            _reported.add(path)
            logger.warning("skipping %s: an incomplete checkpoint (%s), e.g. left by a node crash during its save",
                           path, problem)
    return sorted(found)


def checkpoint_problem(path: str) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None. Without a manifest (older versions) trainer_state counts."""
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        has_state = os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))
        return None if has_state else f"no {MANIFEST_NAME} and no {TRAINER_STATE_NAME}"
    try:
        for name, size in read_json(manifest)["files"].items():
            file = os.path.join(path, name)
            found = f"has {os.path.getsize(file)} bytes" if os.path.isfile(file) else "is missing"
            if found != f"has {size} bytes":
                return f"{name} {found}, {MANIFEST_NAME} says {size} bytes"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_NAME} cannot be read"
    return None


def write_manifest(folder: str, ranks: int = 1) -> None:
    """Write `folder`'s manifest.json, fsynced, naming the `ranks` rank states (a network mount may lag)."""
    names = set(os.listdir(folder)) - {MANIFEST_NAME} | {f"rank_state_{r}.pdparams" for r in range(ranks)}
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(names)
             if not os.path.isdir(os.path.join(folder, name))}
    Path(folder, MANIFEST_NAME).write_text(json.dumps({"files": files}, indent=2, sort_keys=True))
    fsync_path(os.path.join(folder, MANIFEST_NAME))


def resume_requested(resume_from_checkpoint: Optional[str]) -> bool:
    return resume_from_checkpoint not in (None, "", "none", "None", "false", "False")


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """--resume_from_checkpoint as a checkpoint folder or None ('latest': rank 0's; a path: checked on all ranks)."""
    if not resume_requested(resume_from_checkpoint):
        return None
    if resume_from_checkpoint not in ("latest", "true", "True"):  # a path
        with all_ranks_agree("checking --resume_from_checkpoint"):
            unfinished = _UNFINISHED_RE.match(os.path.basename(os.path.normpath(resume_from_checkpoint)))
            problem = "an unfinished save or deletion" if unfinished else checkpoint_problem(resume_from_checkpoint)
            if problem:
                raise FileNotFoundError(f"--resume_from_checkpoint {resume_from_checkpoint}: not a complete checkpoint "
                                        f"folder ({problem}); give another checkpoint, or `latest` for the newest "
                                        "complete one")
        return resume_from_checkpoint
    found = list_checkpoints(output_dir) if rank() == 0 else []
    step = from_rank_0(found[-1][0] if found else None)
    if step is None:
        logger.warning("--resume_from_checkpoint latest: no checkpoint in %s, starting from scratch", output_dir)
        return None
    return checkpoint_path(output_dir, step)


def _generators() -> Dict[str, Any]:
    """The CPU's and the current device's generators, keyed by device type (a state restores on another GPU)."""
    device, new = paddle.device.get_device(), paddle.framework.random.Generator  # "cpu", "gpu:3", ...
    return {"cpu": new("cpu"), device.split(":")[0]: new(device)}


def rng_state() -> Dict[str, Any]:
    # numpy's MT19937 key is uint32, a dtype paddle.load cannot turn into a tensor: store it as int64.
    kind, key, *rest = np.random.get_state()
    return {"paddle": {name: generator.get_state() for name, generator in _generators().items()},
            "numpy": (kind, key.astype(np.int64), *rest), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore `rng_state()`; `{"seed": s}` (a rank new to the checkpoint) seeds instead."""
    if "seed" in state:
        paddle.seed(state["seed"]), np.random.seed(state["seed"]), random.seed(state["seed"])
        return
    saved = state["paddle"]
    if isinstance(saved, dict):
        for name, generator in _generators().items():
            if name in saved:
                generator.set_state(saved[name])
    else:  # earlier versions: paddle.get_rng_state(), every visible device's generator
        try:
            paddle.set_rng_state(saved)
        except ValueError as error:
            logger.warning("paddle's random state not restored (%s): saved on another device count", error)
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(key).astype(np.uint32), *rest))
    random.setstate(state["python"])


def save_checkpoint(output_dir: str, step: int, *, model: paddle.nn.Layer, stateful: Dict[str, Any], trainer_state,
                    rank_state: Dict[str, Any], save_total_limit: Optional[int] = None, keep: Optional[str] = None,
                    configs: Optional[Dict[str, dict]] = None) -> str:
    """Write checkpoint-`step` from all ranks into `.tmp`, then rank 0 renames it; return its path. `stateful` /
    `configs`: file name -> object with `state_dict()` / JSON dict; rotation never deletes `keep`."""
    final = checkpoint_path(output_dir, step)
    tmp, own_state = final + ".tmp", f"rank_state_{rank()}.pdparams"
    stateful = {MODEL_NAME: model, **stateful}

    def explain(error: Exception) -> Exception:  # a full disk, quota, read-only or I/O error: a message
        if not is_disk_error(error):
            return error
        previous = list_checkpoints(output_dir)
        last_good = previous[-1][1] if previous else None
        needed = folder_bytes(last_good) or tensor_bytes([obj.state_dict() for obj in stateful.values()])
        return failed_write(error, os.path.basename(final), output_dir, tmp, needed, last_good)  # removes tmp
    what = f"saving {os.path.basename(final)}"  # each region ends with every rank knowing all succeeded
    with all_ranks_agree(what, explain):
        if rank() == 0:
            for name in sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []:
                if _UNFINISHED_RE.match(name):  # left by a process killed while saving or deleting a checkpoint
                    shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
                    logger.info("removed unfinished %s", name)
            os.makedirs(tmp)
    with all_ranks_agree(what, explain):
        if rank() == 0:
            for name, obj in stateful.items():
                paddle.save(obj.state_dict(), os.path.join(tmp, name))
            trainer_state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
            for name, config in (configs or {}).items():
                Path(tmp, name).write_text(json.dumps(config, indent=2, sort_keys=True))
        paddle.save(rank_state, os.path.join(tmp, own_state))
        written = [name for name in os.listdir(tmp) if not _RANK_STATE_RE.match(name)] if rank() == 0 else []
        for name in written + [own_state]:
            fsync_path(os.path.join(tmp, name))
    with all_ranks_agree(what, explain):
        if rank() == 0:
            write_manifest(tmp, world_size())  # all ranks' files exist: the manifest makes the checkpoint complete
            publish_folder(tmp, final)
            rotate_checkpoints(output_dir, save_total_limit, keep=keep)
    logger.info("saved %s", final)
    return final


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int], keep: Optional[str] = None) -> None:
    """Keep the newest `save_total_limit` checkpoints, plus the one named by `keep`; delete the others."""
    if not save_total_limit or save_total_limit <= 0:
        return
    keep = os.path.realpath(keep) if keep else None  # (the best checkpoint's path may be another spelling of it)
    for _, path in list_checkpoints(output_dir)[:-save_total_limit]:
        if os.path.realpath(path) != keep:
            delete_folder(path)
            logger.info("deleted old checkpoint %s (--save_total_limit %d)", path, save_total_limit)


def set_aside_later(output_dir: str, resume: Optional[str]) -> List[str]:
    """Move the checkpoints not on `resume`'s branch (those after it; all if it is elsewhere) and their evaluation
    lines into OUTPUT_DIR/abandoned/<when>-.../; return their new paths."""
    with all_ranks_agree("setting aside the later checkpoints"):  # (a `return` in it still agrees)
        found = list_checkpoints(output_dir) if resume and rank() == 0 else []
        # one of this folder's checkpoint-N: N is its step, the later ones go; a checkpoint elsewhere: all go
        after = next((step for step, path in found if os.path.realpath(path) == os.path.realpath(resume)), None)
        later = [path for step, path in found if after is None or step > after]
        if not later:
            return []
        name = f"after-{PREFIX}-{after}" if after is not None else \
            f"before-resuming-{os.path.basename(os.path.normpath(resume))}"
        base = os.path.join(output_dir, ABANDONED_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")
        branch, count = base, 1
        while os.path.lexists(branch):  # two rollbacks within a second
            count += 1
            branch = f"{base}-{count}"
        os.makedirs(branch)
        moved = [os.path.join(branch, os.path.basename(path)) for path in later]
        for path, target in zip(later, moved):  # one atomic rename each: a kill mid-way leaves every checkpoint whole
            os.replace(path, target)
        metrics = Path(output_dir, EVAL_METRICS_NAME)  # the moved steps' lines move too; unreadable ones stay
        lines = [line + "\n" for line in metrics.read_text().split("\n") if line.strip()] if metrics.is_file() else []
        moves = [step is not None and (after is None or step > after) for step in map(eval_line_step, lines)]
        if any(moves):
            for path, moving in ((os.path.join(branch, EVAL_METRICS_NAME), True), (str(metrics), False)):
                replace_file(path, "".join(line for line, move in zip(lines, moves) if move == moving))
        for folder in (branch, os.path.dirname(branch), output_dir):  # the renames and new folders, before training
            fsync_path(folder)  # goes on: after a crash the abandoned checkpoints must not come back to `latest`
        logger.warning("resuming from %s, which is not the newest checkpoint of %s: moved the abandoned branch's %s "
                       "to %s (delete it when no longer needed)", resume, output_dir,
                       ", ".join(os.path.basename(path) for path in later), branch)
        return moved


def eval_line_step(line: str) -> Optional[int]:
    """The step of one line of eval_metrics.jsonl, None if the line cannot be read."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def load_model_state(path: str, model: paddle.nn.Layer) -> None:
    """Load the weights into `model`, cast to its dtypes (the Trainer loads O2 weights before decorating for O2)."""
    current = model.state_dict()
    state = {k: v.astype(current[k].dtype) if k in current and v.dtype != current[k].dtype else v
             for k, v in paddle.load(os.path.join(path, MODEL_NAME)).items()}
    missing, unexpected = model.set_state_dict(state)
    if missing or unexpected:
        raise RuntimeError(f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")


def load_stateful(path: str, stateful: Dict[str, Any]) -> None:
    """Restore optimizers, schedulers and registered extras saved by `save_checkpoint`."""
    for name, obj in stateful.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} missing: cannot resume exactly")
        load = getattr(obj, "set_state_dict", None) or obj.load_state_dict  # GradScaler, EMAModel: load_state_dict
        load(paddle.load(file))
        if isinstance(obj, paddle.optimizer.lr.LRScheduler):
            obj.last_lr = obj.get_lr()  # the saved run's peak rate made it: a new --learning_rate applies at once


def load_rank_state(path: str) -> Dict[str, Any]:
    """This rank's RNG and data position. From another number of ranks: no data position, a rank without its own
    file seeded from rank r % saved's state and its rank, and a warning."""
    saved = 1 + max((int(m.group(1)) for m in map(_RANK_STATE_RE.match, os.listdir(path)) if m), default=-1)
    own = os.path.join(path, f"rank_state_{rank()}.pdparams")
    if saved == world_size() or saved == 0:
        if not os.path.isfile(own):
            raise FileNotFoundError(f"{own} missing: the checkpoint is incomplete")
        return paddle.load(own, return_numpy=True)  # arrays stay numpy (the fingerprint, the RNG key)
    state = paddle.load(os.path.join(path, f"rank_state_{rank() % saved}.pdparams"), return_numpy=True)
    if rank() >= saved:
        state["rng"] = {"seed": (int(np.asarray(state["rng"]["numpy"][1])[0]) + 1_000_003 * rank()) % 2**32}
    state["data"] = None
    if rank() == 0:
        fresh = f"; ranks {saved}-{world_size() - 1} draw new random numbers" if world_size() > saved else ""
        logger.warning("%s was saved by %d ranks, this run has %d: weights, optimizers and step resume, but the data "
                       "stream starts again from its beginning (its order depends on the number of ranks)%s. See "
                       "docs/reliability.md, 'Resuming on another topology'", path, saved, world_size(), fresh)
    return state


def read_model_state(file: str) -> Dict[str, Any]:
    """A checkpoint's model_state.pdparams, half-precision (O2) weights replaced by the optimizers' float32 masters."""
    state = paddle.load(file)
    half = [key for key, value in state.items() if getattr(value, "dtype", None) in HALF_DTYPES]
    if not half:
        return state
    optimizers = [os.path.join(os.path.dirname(file), name) for name in ("optimizer.pdopt", "disc_optimizer.pdopt")]
    masters = {name: master for optimizer in optimizers if os.path.isfile(optimizer)
               for name, master in paddle.load(optimizer).get("master_weights", {}).items()}
    restored = {key: masters[state[key].name] for key in half if state[key].name in masters}
    unrestored = sorted(set(half) - set(restored))
    if unrestored:
        logger.warning("%s: %d half-precision weights have no float32 master copy (e.g. %s); they are used as "
                       "saved", file, len(unrestored), unrestored[:3])
    return {**state, **restored}


def checkpoint_vae_config(path: Optional[str], name: str = VAE_CONFIG_NAME) -> Optional[str]:
    """The path of the vae_config.json (`name`) of checkpoint `path` (a folder or a file in it), if there is one."""
    file = os.path.join(path if os.path.isdir(path or "") else os.path.dirname(path or ""), name)
    return file if path and os.path.isfile(file) else None


def checkpoint_export_config(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The export_config.json of checkpoint `path` (a folder or a file in it), read, if there is one."""
    config = checkpoint_vae_config(path, EXPORT_CONFIG_NAME)
    return read_json(config) if config else None


def read_json(path: str) -> Dict[str, Any]:
    return json.loads(Path(path).read_text())
