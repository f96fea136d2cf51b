"""What a checkpoint holds, how it is written safely, found again, loaded and rotated; the final export.

`OUTPUT_DIR/checkpoint-N/` (the same layout from both drivers, so either can resume the other's run):

    model_state.pdparams       VAE + discriminator + output log-variance (VAEWithDiscriminator)
    optimizer.pdopt            VAE optimizer          scheduler.pdparams       VAE LR schedule
    disc_optimizer.pdopt       discriminator optimizer  disc_scheduler.pdparams  its LR schedule
    <name>.pdparams            any further state a driver registers (e.g. EMA weights)
    trainer_state.json         PaddleNLP TrainerState (global_step, best metric, log history)
    rank_state_R.pdparams      per rank: RNG states (paddle, numpy, random) and the data position

Names follow the PaddleNLP Trainer's. Every rank writes into `checkpoint-N.tmp/`; once all have
finished, rank 0 renames it to `checkpoint-N` (an atomic rename), so a process killed mid-save leaves at
most a `.tmp` folder, which `latest` never picks and the next save removes. Assumes OUTPUT_DIR is on a
file system that all ranks share (one node, or a shared mount across nodes).

At the end, `export_final` writes `OUTPUT_DIR/vae/` (ppdiffusers `save_pretrained`, loadable with
`AutoencoderKL.from_pretrained`) and `OUTPUT_DIR/discriminator/`.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle
import paddle.distributed as dist

from .distributed import assert_parameters_in_sync, rank, world_size

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"
MODEL_NAME = "model_state.pdparams"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def list_checkpoints(output_dir: str) -> List[Tuple[int, str]]:
    """Complete checkpoints in `output_dir` as (step, path), oldest first. `.tmp` folders are ignored."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isfile(os.path.join(output_dir, name, TRAINER_STATE_NAME)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def resolve_resume(output_dir: str, resume_from_checkpoint: Optional[str]) -> Optional[str]:
    """Turn --resume_from_checkpoint (None, 'latest' or a path) into a checkpoint folder or None."""
    if resume_from_checkpoint in (None, "", "none", "None", "false", "False"):
        return None
    if resume_from_checkpoint in ("latest", "true", "True"):
        found = list_checkpoints(output_dir)
        if not found:
            logger.warning("--resume_from_checkpoint latest: no checkpoint in %s, starting from scratch", output_dir)
            return None
        return found[-1][1]
    if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
        raise FileNotFoundError(f"--resume_from_checkpoint {resume_from_checkpoint}: not a complete checkpoint folder")
    return resume_from_checkpoint


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def rng_state() -> Dict[str, Any]:
    return {"paddle": paddle.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    paddle.set_rng_state(state["paddle"])
    np.random.set_state(state["numpy"])
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
) -> str:
    """Write checkpoint-`step` atomically from all ranks; return its path.

    `stateful` maps a file name (e.g. "optimizer.pdopt") to anything with `state_dict()`; rank 0 writes
    those, the model and `trainer_state` (a PaddleNLP TrainerState). Every rank writes its `rank_state`.
    `keep` names a checkpoint that rotation must not delete (the best one).
    """
    final, tmp = checkpoint_path(output_dir, step), checkpoint_path(output_dir, step) + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if rank() == 0:
        paddle.save(model.state_dict(), os.path.join(tmp, MODEL_NAME))
        for name, obj in stateful.items():
            paddle.save(obj.state_dict(), os.path.join(tmp, name))
        trainer_state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
    paddle.save(rank_state, os.path.join(tmp, f"rank_state_{rank()}.pdparams"))
    _barrier()
    if rank() == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        rotate_checkpoints(output_dir, save_total_limit, keep=keep)
    _barrier()
    logger.info("saved %s", final)
    return final


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int], keep: Optional[str] = None) -> None:
    """Delete the oldest checkpoints beyond `save_total_limit`, never the one named by `keep`."""
    if not save_total_limit or save_total_limit <= 0:
        return
    found = [path for _, path in list_checkpoints(output_dir)]
    keep = os.path.abspath(keep) if keep else None
    removable = [p for p in found if os.path.abspath(p) != keep]
    excess = len(found) - save_total_limit
    for path in removable[: max(excess, 0)]:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted old checkpoint %s (--save_total_limit %d)", path, save_total_limit)


def load_model_state(path: str, model: paddle.nn.Layer) -> None:
    missing, unexpected = model.set_state_dict(paddle.load(os.path.join(path, MODEL_NAME)))
    if missing or unexpected:
        raise RuntimeError(f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")


def load_stateful(path: str, stateful: Dict[str, Any]) -> None:
    """Restore optimizers, schedulers and registered extras saved by `save_checkpoint`."""
    for name, obj in stateful.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} missing: cannot resume exactly")
        obj.set_state_dict(paddle.load(file))


def load_rank_state(path: str) -> Dict[str, Any]:
    """This rank's RNG and data position. Resuming needs the same number of ranks as the save."""
    file = os.path.join(path, f"rank_state_{rank()}.pdparams")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} missing: was the checkpoint written with a different number of ranks?")
    return paddle.load(file)


def export_final(output_dir: str, vae, discriminator: paddle.nn.Layer, discriminator_config: Dict[str, Any],
                 vae_config_updates: Optional[Dict[str, Any]] = None) -> Tuple[str, str]:
    """Write OUTPUT_DIR/vae (ppdiffusers format) and OUTPUT_DIR/discriminator on rank 0."""
    from .models.discriminator import save_discriminator
    from .models.vae import save_vae

    vae_dir, disc_dir = os.path.join(output_dir, "vae"), os.path.join(output_dir, "discriminator")
    if rank() == 0:
        save_vae(vae, vae_dir, **(vae_config_updates or {}))
        save_discriminator(discriminator, discriminator_config, disc_dir)
    _barrier()
    return vae_dir, disc_dir
