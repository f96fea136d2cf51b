"""The frozen teacher of a distillation run (`Teacher`): a VAE of any family and the latents its diffusion pipelines
see, computed or read back from a cache on disk; it is held beside the trained networks, never in a
checkpoint or an EMA. `to_pipeline` / `from_pipeline` take latents to and from that space with a family's
normalisation's `pipeline` (mean, std) of shape [C, p, p], tiled over the latent positions with period p. The student
a teacher folder implies (`student_of`) and the check of a given one against its teacher (`check_student`)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any, Dict, Optional

import numpy as np
import paddle

from .families import family_for_config, family_of, image_channels
from .families.tiny import TINY, student_config


def _tiled(pattern: np.ndarray, latents: paddle.Tensor) -> paddle.Tensor:
    """[1, C, H, W]: the [C, p, p] pattern repeated over the H x W latent positions."""
    _, period, _ = pattern.shape
    height, width = latents.shape[-2:]
    reps = [1, -(-height // period), -(-width // period)]
    return paddle.to_tensor(np.tile(pattern, reps)[None, :, :height, :width].astype(np.float32))


def to_pipeline(latents: paddle.Tensor, mean: np.ndarray, std: np.ndarray) -> paddle.Tensor:
    """(z - mean) / std of NCHW latents z, in float32."""
    return (latents.astype("float32") - _tiled(mean, latents)) / _tiled(std, latents)


def from_pipeline(latents: paddle.Tensor, mean: np.ndarray, std: np.ndarray) -> paddle.Tensor:
    """The posterior-mode latents z of a pipeline's NCHW latents: latents * std + mean, in float32."""
    return latents.astype("float32") * _tiled(std, latents) + _tiled(mean, latents)


def load_teacher(path: str, subfolder: Optional[str] = None, cache_folder: Optional[str] = None) -> "Teacher":
    """The teacher VAE folder `path` (--teacher_model_name_or_path) as a frozen `Teacher`."""
    from .vae_loading import build_vae

    if not os.path.isfile(os.path.join(path, subfolder or "", "config.json")):
        raise FileNotFoundError(f"--teacher {path}: no VAE folder at {os.path.join(path, subfolder or '')} (a "
                                "config.json and weights; nothing is downloaded; a pipeline folder takes its subfolder "
                                "vae)")
    vae = build_vae(pretrained_model_name_or_path=path, subfolder=subfolder)
    if image_channels(vae) != 3:
        raise ValueError(f"--teacher {path}: a {family_of(vae).class_name} of RGBA images, and a distilled student "
                         "is trained and measured on RGB ones: distil a teacher of RGB images")
    return Teacher(vae, cache_folder, path)


class Teacher:
    """A frozen VAE in eval mode: `latents` of [-1, 1] NCHW images in its pipelines' normalised space (float32, no
    graph), read from and written to its cache folder if it has one, and `decode` of such latents to images."""

    def __init__(self, vae: paddle.nn.Layer, cache_folder: Optional[str] = None, source: str = ""):
        self.vae, self.family, self.source = vae, family_of(vae), source  # `source`: its folder, for the protocol
        for param in vae.parameters():
            param.stop_gradient = True
        vae.eval()
        self.mean, self.std = self.family.normalisation.pipeline(vae)  # raises for a family that has none
        self.latent_channels = int(self.mean.shape[0])
        # The latent cache (--cache_teacher_latents): the teacher's latents of each crop it saw, one .npy file per
        # crop named by a hash of the crop's float32 pixels (so a cached latent is exactly that crop's: a random crop
        # or flip that differs is a new entry), in a subfolder of `cache_folder` named by the teacher's weights and
        # config (another teacher never reads them), made here.
        self.cache = None
        if cache_folder:
            config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}  # (_use_default_values:
            digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())  # in any order)
            for name, tensor in sorted(vae.state_dict().items()):
                digest.update(name.encode() + tensor.numpy().tobytes())
            # and the normalisation applied: a change of it is another space
            for array in (self.family.class_name.encode(), self.mean, self.std):
                digest.update(array if isinstance(array, bytes) else array.tobytes())
            self.cache = os.path.join(cache_folder, digest.hexdigest()[:16])
            os.makedirs(self.cache, exist_ok=True)

    def latents(self, images: paddle.Tensor) -> paddle.Tensor:
        paths = []
        if self.cache is not None:
            paths = [os.path.join(self.cache, hashlib.sha256(str(image.shape).encode() + image.tobytes()).hexdigest()
                                  + ".npy") for image in images.astype("float32").numpy()]
        if paths and all(os.path.isfile(path) for path in paths):  # one missing: the batch is computed whole
            return paddle.to_tensor(np.stack([np.load(path) for path in paths]))
        with paddle.no_grad(), paddle.amp.auto_cast(enable=False):  # float32: the same latents under any precision
            latents = to_pipeline(self.family.encode(self.vae, images.astype("float32")).mode(), self.mean, self.std)
        # Each latent to its path, atomically (ranks and workers may write the same crop).
        for path, latent in zip(paths, latents.numpy() if paths else ()):
            partial = f"{path}.{uuid.uuid4().hex}.tmp"  # unique over ranks, nodes and workers
            with open(partial, "wb") as handle:
                np.save(handle, latent)
            os.replace(partial, path)
        return latents

    def decode(self, latents: paddle.Tensor) -> paddle.Tensor:
        with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
            return self.family.decode(self.vae, from_pipeline(latents, self.mean, self.std))


def student_of(teacher: str, subfolder: Optional[str], width: int, depth: int) -> Optional[Dict[str, Any]]:
    """`student_config` for the teacher VAE folder `teacher` (--teacher_model_name_or_path), None without its
    config.json (loading the teacher says what is missing)."""
    path = os.path.join(teacher, subfolder or "", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        config = json.load(handle)
    try:
        return student_config(family_for_config(config, path).geometry(config), width, depth)
    except ValueError as error:
        raise ValueError(f"--teacher_model_name_or_path {teacher}: {error}") from None


def check_student(student: paddle.nn.Layer, teacher: Teacher) -> None:
    """Refuse, before training, a student (--vae_config_file, --pretrained_model_name_or_path, --init_from_ckpt)
    that cannot live in `teacher`'s pipeline latents: another class, latent channels or factor, or a scale other
    than 1 (a pipeline would divide its latents by it). The class is refused with the flags too where they name a
    config (objectives/distillation.py); a single file's is known only once built."""
    family = family_of(student)
    if family is not TINY:  # the family of a distilled student
        raise ValueError(f"the student is a {family.class_name}: a distilled student is an {TINY.class_name}")
    mine, theirs = TINY.geometry(student.config), teacher.family.geometry(teacher.vae.config)
    if (mine.latent_channels, mine.factor) != (theirs.latent_channels, theirs.factor):
        raise ValueError(f"the student has {mine.latent_channels} latent channels at factor {mine.factor}, its "
                         f"teacher {theirs.latent_channels} at factor {theirs.factor}: give a student of the teacher's "
                         "geometry (or none: one is made from it)")
    if student.config.scaling_factor != 1.0:
        raise ValueError(f"the student's scaling_factor is {student.config.scaling_factor}: it lives in its teacher's "
                         "normalised latents, scale 1 (a pipeline divides its latents by it); set it to 1.0")
