"""What a checkpoint holds, how it is written safely, found again, loaded and rotated.

`OUTPUT_DIR/checkpoint-N/` (the same layout from both drivers, so either can resume the other's run):

    model_state.pdparams       VAE + discriminator + output log-variance (VAEWithDiscriminator)
    optimizer.pdopt            VAE optimizer          scheduler.pdparams       VAE LR schedule
    disc_optimizer.pdopt       discriminator optimizer  disc_scheduler.pdparams  its LR schedule
    <name>.pdparams            any further state a driver registers (build.Optimization.stateful: fp16
                               loss scalers, the non-finite guard's skip counters, EMA weights)
    trainer_state.json         PaddleNLP TrainerState (global_step, best metric, log history)
    rank_state_R.pdparams      per rank: RNG states (this device's and the CPU's paddle generator, numpy,
                               random) and the data position
    vae_config.json            the VAE's AutoencoderKL config     discriminator_config.json  its build kwargs
    export_config.json         what an export needs beyond weights (posterior_std, scaling-factor mode,
                               input_size, resolution, the images the latent statistics are measured on):
                               `scripts/export_vae.py` turns any checkpoint into a VAE folder
    manifest.json              every other file's name and size; written last, by rank 0

An O2 (half-precision) run saves the half-precision weights in model_state.pdparams and their float32
master copies in the optimizer files; `read_model_state` gives the float32 ones back. Names follow the
PaddleNLP Trainer's. Every rank writes into `checkpoint-N.tmp/`; once all have
finished (a failure on any rank stops every rank with its message: `distributed.all_ranks_agree`),
rank 0 renames it to `checkpoint-N` (an atomic rename), so a process killed mid-save leaves at
most a `.tmp` folder, which `latest` never picks and the next save removes. Against a node crash: every file
and the folder are fsynced before the rename (the parent after it), and `latest`, rotation, the rollback and
an explicit resume take only checkpoints whose files match their manifest (one without a manifest, from an
earlier version, needs its trainer_state.json as before). A resume with another number of ranks restarts
the data stream (`load_rank_state`). A checkpoint is deleted
(rotation, or re-saving a step) by first renaming it to `checkpoint-N.old`, so a kill during the deletion
never leaves a half-deleted folder that still looks complete. Resuming from a checkpoint that is not the
newest starts a new branch: the later ones (all of OUTPUT_DIR's, when the resumed one is elsewhere) move to
`OUTPUT_DIR/abandoned/` (`set_aside_later`), where `latest` and rotation do not look. Assumes OUTPUT_DIR is on
a file system that all ranks share (one node, or a shared mount across nodes).

The three JSON files are written by this version and are not needed to resume (older checkpoints resume
as before). Not here: the final export (`OUTPUT_DIR/vae/`, `vae_raw/`, `discriminator/`) is `final_save.py`;
reading a discriminator for --discriminator_path is `models/discriminator.py`; refusing or clearing an
OUTPUT_DIR that holds an earlier run is `output_dir.py`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle
import paddle.distributed as dist

from .disk import failed_write, folder_bytes, fsync_path, is_disk_error
from .distributed import all_ranks_agree, assert_parameters_in_sync, rank, world_size
from .precision import HALF_DTYPES

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"
MODEL_NAME = "model_state.pdparams"
TRAINER_STATE_NAME = "trainer_state.json"
VAE_CONFIG_NAME = "vae_config.json"
DISCRIMINATOR_CONFIG_NAME = "discriminator_config.json"
EXPORT_CONFIG_NAME = "export_config.json"
MANIFEST_NAME = "manifest.json"  # {"files": {name: size}} of the other files, written last (write_manifest)
ABANDONED_DIR = "abandoned"  # later checkpoints set aside when a run resumes from an earlier one (set_aside_later)
EVAL_METRICS_NAME = "eval_metrics.jsonl"  # one line per in-training evaluation (evaluation.TrainingEvaluator)
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_UNFINISHED_RE = re.compile(rf"^{PREFIX}-\d+\.(tmp|old)$")  # interrupted saves and deletions
_RANK_STATE_RE = re.compile(r"^rank_state_(\d+)\.pdparams$")
_reported: set = set()  # incomplete checkpoints already warned about (once per process)


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def list_checkpoints(output_dir: str, complete: bool = True) -> List[Tuple[int, str]]:
    """Complete checkpoints (`complete=False`: all `checkpoint-N` folders) in `output_dir` as (step, path), oldest
    first. `.tmp` folders are ignored; an incomplete checkpoint is skipped with a warning naming it."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and (not complete or _usable(path)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: str) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None: a file of its manifest missing or of another size.
    Without a manifest (saved by an earlier version) its trainer_state.json is what counts."""
    manifest = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(manifest):
        if not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            return f"no {MANIFEST_NAME} and no {TRAINER_STATE_NAME}"
        logger.debug("%s has no %s (saved by an earlier version): taken as complete", path, MANIFEST_NAME)
        return None
    try:
        files = read_json(manifest)["files"]
        sizes = {name: os.path.getsize(os.path.join(path, name)) for name in files
                 if os.path.isfile(os.path.join(path, name))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_NAME} cannot be read"
    for name, size in files.items():
        if sizes.get(name) != size:
            found = "is missing" if name not in sizes else f"has {sizes[name]} bytes"
            return f"{name} {found}, {MANIFEST_NAME} says {size} bytes"
    return None


def _usable(path: str) -> bool:
    problem = checkpoint_problem(path)
    if problem and path not in _reported:
        _reported.add(path)
        logger.warning("skipping %s: an incomplete checkpoint (%s), e.g. left by a node crash during its save",
                       path, problem)
    return problem is None


def write_manifest(folder: str, ranks: int = 1) -> None:
    """Record the name and size of every file in `folder` in its manifest.json, fsynced (written last). The
    `ranks` rank states are looked up by name (a cached listing of a network mount may not show them yet)."""
    names = set(os.listdir(folder)) - {MANIFEST_NAME} | {f"rank_state_{r}.pdparams" for r in range(ranks)}
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(names)
             if not os.path.isdir(os.path.join(folder, name))}
    _write_json(os.path.join(folder, MANIFEST_NAME), {"files": files})
    fsync_path(os.path.join(folder, MANIFEST_NAME))


# The values of --resume_from_checkpoint that mean "the newest checkpoint of OUTPUT_DIR".
LATEST = ("latest", "true", "True")
_NO_RESUME = (None, "", "none", "None", "false", "False")


def resume_requested(resume_from_checkpoint: Optional[str]) -> bool:
    return resume_from_checkpoint not in _NO_RESUME


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """Turn --resume_from_checkpoint (None, 'latest' or a path) into a checkpoint folder or None.

    'latest' is decided by rank 0 and broadcast, so that every rank resumes from the same step even if
    a shared file system shows the ranks slightly different listings; a path is checked on every rank.
    """
    if not resume_requested(resume_from_checkpoint):
        return None
    if resume_from_checkpoint not in LATEST:
        with all_ranks_agree("checking --resume_from_checkpoint"):  # every rank must see it
            unfinished = _UNFINISHED_RE.match(os.path.basename(os.path.normpath(resume_from_checkpoint)))
            problem = "an unfinished save or deletion" if unfinished else checkpoint_problem(resume_from_checkpoint)
            if problem:
                raise FileNotFoundError(f"--resume_from_checkpoint {resume_from_checkpoint}: not a complete checkpoint "
                                        f"folder ({problem}); give another checkpoint, or `latest` for the newest "
                                        "complete one")
        return resume_from_checkpoint
    found = list_checkpoints(output_dir) if rank() == 0 else []
    step = found[-1][0] if found else -1
    if world_size() > 1:
        shared = paddle.to_tensor([step], dtype="int64")
        dist.broadcast(shared, src=0)
        step = int(shared.item())
    if step < 0:
        logger.warning("--resume_from_checkpoint latest: no checkpoint in %s, starting from scratch", output_dir)
        return None
    return checkpoint_path(output_dir, step)


def _generators() -> Dict[str, Any]:
    """The paddle generators this process draws from: the CPU's and the current device's ("gpu", "xpu", ...),
    keyed by device type, not index, so a state restores on another device or device count. (Paddle's own
    Generator: ppdiffusers replaces `paddle.Generator` with its RNG tracker.)"""
    device, new = paddle.device.get_device(), paddle.framework.random.Generator  # device: "cpu", "gpu:3", ...
    generators = {"cpu": new("cpu")}
    if device != "cpu":
        generators[device.split(":")[0]] = new(device)
    return generators


def rng_state() -> Dict[str, Any]:
    # numpy's MT19937 key is uint32, a dtype paddle.load cannot turn into a tensor: store it as int64.
    kind, key, *rest = np.random.get_state()
    return {"paddle": {name: generator.get_state() for name, generator in _generators().items()},
            "numpy": (kind, key.astype(np.int64), *rest), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore `rng_state()`; `{"seed": s}` (a rank new to the checkpoint, `load_rank_state`) seeds instead."""
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


def make_rank_state(model: paddle.nn.Layer, position) -> Dict[str, Any]:
    """This rank's share of a checkpoint; also verifies that all ranks hold the same weights."""
    fingerprint = assert_parameters_in_sync(model)
    return {"rng": rng_state(), "data": position.state_dict(), "parameter_fingerprint": fingerprint}


def save_checkpoint(
    output_dir: str,
    step: int,
    *,
    model: paddle.nn.Layer,
    stateful: Dict[str, Any],
    trainer_state,
    rank_state: Dict[str, Any],
    save_total_limit: Optional[int] = None,
    keep: Optional[str] = None,
    configs: Optional[Dict[str, dict]] = None,
) -> str:
    """Write checkpoint-`step` atomically from all ranks; return its path.

    `stateful` maps a file name (e.g. "optimizer.pdopt") to anything with `state_dict()`; rank 0 writes
    those, the model, `trainer_state` (a PaddleNLP TrainerState) and `configs` (file name -> JSON-able
    dict, e.g. `final_save.checkpoint_configs`). Every rank writes its `rank_state`.
    `keep` names a checkpoint that rotation must not delete (the best one).
    """
    final, tmp = checkpoint_path(output_dir, step), checkpoint_path(output_dir, step) + ".tmp"

    def explain(error: Exception) -> Exception:  # a full disk, quota, read-only or I/O error: a message
        if not is_disk_error(error):
            return error
        previous = list_checkpoints(output_dir)
        last_good = previous[-1][1] if previous else None
        needed = folder_bytes(last_good) or tensor_bytes([model.state_dict()] + [o.state_dict() for o in stateful.values()])
        return failed_write(error, os.path.basename(final), output_dir, tmp, needed, last_good)  # removes tmp

    what = f"saving {os.path.basename(final)}"  # each region ends with every rank knowing all succeeded
    with all_ranks_agree(what, explain):
        if rank() == 0:
            remove_unfinished(output_dir)
            os.makedirs(tmp)
    with all_ranks_agree(what, explain):
        if rank() == 0:
            paddle.save(model.state_dict(), os.path.join(tmp, MODEL_NAME))
            for name, obj in stateful.items():
                paddle.save(obj.state_dict(), os.path.join(tmp, name))
            trainer_state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
            for name, config in (configs or {}).items():
                with open(os.path.join(tmp, name), "w") as handle:
                    json.dump(config, handle, indent=2, sort_keys=True)
        paddle.save(rank_state, os.path.join(tmp, f"rank_state_{rank()}.pdparams"))
        for name in _written_by_this_rank(tmp):
            fsync_path(os.path.join(tmp, name))
    with all_ranks_agree(what, explain):
        if rank() == 0:
            write_manifest(tmp, world_size())  # all ranks' files exist: the manifest makes the checkpoint complete
            fsync_path(tmp)
            if os.path.isdir(final):
                delete_checkpoint(final)
            os.replace(tmp, final)
            fsync_path(output_dir)
            rotate_checkpoints(output_dir, save_total_limit, keep=keep)
    logger.info("saved %s", final)
    return final


def _written_by_this_rank(folder: str) -> List[str]:
    """The files of a checkpoint being written that this rank wrote: its rank state (rank 0: all others too)."""
    others = [name for name in os.listdir(folder) if not _RANK_STATE_RE.match(name)] if rank() == 0 else []
    return others + [f"rank_state_{rank()}.pdparams"]


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what saving it writes, about."""
    if isinstance(state, paddle.Tensor):
        return int(np.prod(state.shape)) * state.element_size()
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def estimated_checkpoint_bytes(model: paddle.nn.Layer, ema: Any = None) -> int:
    """A checkpoint's size before the optimizers hold state: the weights, two AdamW moments per trainable
    float32 weight, and the EMA of the VAE's weights."""
    weights = tensor_bytes(model.state_dict())
    trainable = sum(int(np.prod(p.shape)) * 4 for p in model.parameters() if not p.stop_gradient)
    vae = sum(int(np.prod(p.shape)) * 4 for p in model.vae.parameters()) if ema is not None else 0
    return weights + 2 * trainable + vae


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int], keep: Optional[str] = None) -> None:
    """Keep the newest `save_total_limit` checkpoints, plus the one named by `keep`; delete the others."""
    if not save_total_limit or save_total_limit <= 0:
        return
    keep = os.path.abspath(keep) if keep else None
    found = [path for _, path in list_checkpoints(output_dir)]
    for path in found[:-save_total_limit]:
        if os.path.abspath(path) != keep:
            delete_checkpoint(path)
            logger.info("deleted old checkpoint %s (--save_total_limit %d)", path, save_total_limit)


def delete_checkpoint(path: str) -> None:
    """Rename first (atomic), then delete: a kill mid-way leaves a `.old` folder, never a half-deleted checkpoint."""
    doomed = path + ".old"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def unfinished_checkpoints(output_dir: str) -> List[str]:
    """`.tmp` and `.old` folders left by a process killed while saving or deleting a checkpoint."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return [os.path.join(output_dir, name) for name in sorted(names) if _UNFINISHED_RE.match(name)]


def remove_unfinished(output_dir: str) -> None:
    """Delete `.tmp` and `.old` folders left by a process killed while saving or deleting a checkpoint."""
    for path in unfinished_checkpoints(output_dir):
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed unfinished %s", os.path.basename(path))


def set_aside_later(output_dir: str, resume: Optional[str]) -> List[str]:
    """Rolling back is a branch: before the first step, move the checkpoints of OUTPUT_DIR that do not belong
    to the branch resumed from `resume` (and their lines of eval_metrics.jsonl) into OUTPUT_DIR/abandoned/,
    so that `latest`, rotation, the best-checkpoint bookkeeping and the next saves see only the new branch:
    - `resume` is one of OUTPUT_DIR's checkpoints: those newer than it, to `<when>-after-checkpoint-N/`;
    - `resume` is elsewhere (another run's folder, an abandoned branch): all of OUTPUT_DIR's, to
      `<when>-before-resuming-<its name>/`.
    Nothing is deleted: a moved checkpoint still resumes or exports by its path. Rank 0 moves; all ranks call
    it (an agreement: a failure ends every rank). Returns the moved checkpoints' new paths."""
    moved: List[str] = []
    with all_ranks_agree("setting aside the later checkpoints"):
        if resume and rank() == 0:
            moved = _set_aside(output_dir, resume)
    return moved


def is_checkpoint_of(output_dir: str, checkpoint: str, step: Optional[int] = None) -> bool:
    """Whether `checkpoint` is one of OUTPUT_DIR's complete checkpoints (with `step`: OUTPUT_DIR/checkpoint-`step`
    itself, decided without listing the folder). Compared after realpath."""
    real = os.path.realpath(checkpoint)
    candidates = list_checkpoints(output_dir) if step is None else [(step, checkpoint_path(output_dir, step))]
    return any(os.path.realpath(path) == real for _, path in candidates)


def _set_aside(output_dir: str, resume: str) -> List[str]:
    found = list_checkpoints(output_dir)
    step = checkpoint_step(resume)
    if is_checkpoint_of(output_dir, resume):
        later = [path for found_step, path in found if step is not None and found_step > step]
        name, after = f"after-{PREFIX}-{step}", step
    else:
        later = [path for _, path in found]
        name, after = f"before-resuming-{os.path.basename(os.path.normpath(resume))}", None
    if not later:
        return []
    branch = _new_branch_folder(output_dir, name)
    moved = []
    for path in later:  # one atomic rename each: a kill mid-way leaves every checkpoint whole
        moved.append(os.path.join(branch, os.path.basename(path)))
        os.replace(path, moved[-1])
    _move_eval_lines(output_dir, branch, after)
    logger.warning("resuming from %s, which is not the newest checkpoint of %s: moved the abandoned branch's %s "
                   "to %s (delete it when no longer needed)", resume, output_dir,
                   ", ".join(os.path.basename(path) for path in later), branch)
    return moved


def _new_branch_folder(output_dir: str, name: str) -> str:
    """OUTPUT_DIR/abandoned/<date>-<time>-`name`, made; `-2`, `-3`... appended if two rollbacks share a second."""
    base = os.path.join(output_dir, ABANDONED_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")
    branch, count = base, 1
    while os.path.lexists(branch):
        count += 1
        branch = f"{base}-{count}"
    os.makedirs(branch)
    return branch


def checkpoint_step(checkpoint: str) -> Optional[int]:
    """The step a checkpoint folder was saved at (its trainer_state.json), or None if unreadable."""
    try:
        return int(read_json(os.path.join(checkpoint, TRAINER_STATE_NAME))["global_step"])
    except (OSError, ValueError, KeyError):
        match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(checkpoint)))
        return int(match.group(1)) if match else None


def _move_eval_lines(output_dir: str, branch: str, after: Optional[int]) -> None:
    """The evaluations of steps after `after` (all of them if None) belong to the abandoned branch: move them
    next to its checkpoints. A line that cannot be read (half-written by a killed run) stays where it is."""
    path = os.path.join(output_dir, EVAL_METRICS_NAME)
    if not os.path.isfile(path):
        return
    kept: List[str] = []
    later: List[str] = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                step = eval_line_step(line)
                moves = step is not None and (after is None or step > after)
                (later if moves else kept).append(line if line.endswith("\n") else line + "\n")
    if not later:
        return
    with open(os.path.join(branch, EVAL_METRICS_NAME), "w") as handle:
        handle.writelines(later)
    with open(path + ".tmp", "w") as handle:
        handle.writelines(kept)
    os.replace(path + ".tmp", path)


def eval_line_step(line: str) -> Optional[int]:
    """The step of one line of eval_metrics.jsonl, None if the line cannot be read."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def load_model_state(path: str, model: paddle.nn.Layer) -> None:
    """Load the weights into `model`, cast to its current dtypes (an O2 checkpoint holds float16 weights,
    and the Trainer loads them before the model is decorated for O2)."""
    state = paddle.load(os.path.join(path, MODEL_NAME))
    current = model.state_dict()
    state = {k: v.astype(current[k].dtype) if k in current and v.dtype != current[k].dtype else v
             for k, v in state.items()}
    missing, unexpected = model.set_state_dict(state)
    if missing or unexpected:
        raise RuntimeError(f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")


def load_stateful(path: str, stateful: Dict[str, Any]) -> None:
    """Restore optimizers, schedulers and registered extras saved by `save_checkpoint`."""
    for name, obj in stateful.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} missing: cannot resume exactly")
        state = paddle.load(file)
        # Optimizers and schedulers use set_state_dict; GradScaler and EMAModel use load_state_dict.
        if hasattr(obj, "set_state_dict"):
            obj.set_state_dict(state)
        else:
            obj.load_state_dict(state)
        if isinstance(obj, paddle.optimizer.lr.LRScheduler):
            # The saved `last_lr` was computed from the saved run's peak rate; recompute it from this run's
            # (same value when unchanged), so a --learning_rate given on resume applies from the first step.
            obj.last_lr = obj.get_lr()


def load_rank_state(path: str) -> Dict[str, Any]:
    """This rank's RNG and data position. Saved by another number of ranks, the data position is dropped (the
    stream starts again: its order depends on the world size) and a rank without its own file is seeded from
    rank r % saved's state and its rank; one warning (rank 0) says so."""
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
    """A checkpoint's model_state.pdparams, float32: an O2 (half-precision) run saves the roundings of its
    weights there and their float32 master copies in optimizer.pdopt / disc_optimizer.pdopt, which are taken
    instead (matched by parameter name, which paddle.save keeps)."""
    state = paddle.load(file)
    half = [key for key, value in state.items() if getattr(value, "dtype", None) in HALF_DTYPES]
    if not half:
        return state
    masters: Dict[str, Any] = {}
    for name in ("optimizer.pdopt", "disc_optimizer.pdopt"):
        optimizer_file = os.path.join(os.path.dirname(file), name)
        if os.path.isfile(optimizer_file):
            masters.update(paddle.load(optimizer_file).get("master_weights", {}))
    restored = {key: masters[state[key].name] for key in half if state[key].name in masters}
    unrestored = sorted(set(half) - set(restored))
    if unrestored:
        logger.warning("%s: %d half-precision weights have no float32 master copy (e.g. %s); they are used as "
                       "saved", file, len(unrestored), unrestored[:3])
    return {**state, **restored}


def checkpoint_vae_config(path: Optional[str]) -> Optional[str]:
    """The vae_config.json of the checkpoint folder `path` (or of the folder of a file in it), if there is one."""
    if not path:
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config = os.path.join(folder, VAE_CONFIG_NAME)
    return config if os.path.isfile(config) else None


def checkpoint_export_config(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The export_config.json of the checkpoint folder `path` (or of the folder of a file in it), if there is one."""
    if not path:
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config = os.path.join(folder, EXPORT_CONFIG_NAME)
    return read_json(config) if os.path.isfile(config) else None


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)


def read_json(path: str) -> Dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)
