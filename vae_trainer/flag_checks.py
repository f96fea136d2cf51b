"""What the parse-time refusals read (`flag_values`: every flag, and the facts several rows need, such as the VAE's
family from its config file), and the checks of sizes against that config (`check_sizes`, the tiling checks). The
rows themselves live beside what they guard (refusals.py). Importing this module stays free of Paddle (evaluation.py
and scripts/eval_vae.py share the tiling checks).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .data.buckets import BUCKET_MULTIPLE, bucket_shapes

DEFAULT_TILE_SIZE = 512  # --eval_tile_size's default: the SD VAE's sample_size


def vae_config(model_args) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(path, contents) of the config of the VAE the flags build: --vae_config_file, else the pretrained folder's or
    the --init_from_ckpt checkpoint's; (path or None, None) when there is none to read (a single file)."""
    from .checkpoint import checkpoint_vae_config, read_json

    path, derived = model_args.vae_config_file, derived_student_config(model_args)
    if derived:
        return f"the student of {model_args.teacher_model_name_or_path}", derived
    if path is None and model_args.pretrained_model_name_or_path:
        path = os.path.join(model_args.pretrained_model_name_or_path, model_args.subfolder or "", "config.json")
    elif path is None and model_args.init_from_ckpt:
        path = checkpoint_vae_config(model_args.init_from_ckpt)
    elif path is not None and os.path.isdir(path):  # a VAE folder as --vae_config_file: its config.json (build_vae's)
        path = os.path.join(path, "config.json")
    if path is None or not os.path.isfile(path):
        return path, None
    return path, {key: value for key, value in read_json(path).items() if value is not None}


def derived_student_config(model_args) -> Optional[Dict[str, Any]]:
    """A distillation's student config from its teacher's geometry (--student_width, --student_depth), when no flag
    gives the student (--vae_config_file, --pretrained_model_name_or_path, --init_from_ckpt); else None."""
    from .models.teacher import student_of

    given = model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt
    teacher = getattr(model_args, "teacher_model_name_or_path", None)
    return None if given or not teacher else student_of(teacher, model_args.teacher_subfolder,
                                                        model_args.student_width, model_args.student_depth)


def check_sizes(f: SimpleNamespace) -> None:
    """--resolution, --input_size, bucket shapes and tiles (`f`: `flag_values`) against the VAE's config file (none:
    checked once built)."""
    from .models.families import check_reconstruction_shape

    check_tiling_flags(f, f.config, f.config_path)  # (which names the path only with a config)
    if f.config is None:
        return
    resolution, factor = f.resolution, f.geometry.factor
    check_reconstruction_shape(f.config, f.input_size, resolution, f.config_path)
    if f.aspect_ratio_buckets and f.geometry.output_size:
        raise ValueError(f"--aspect_ratio_buckets: this VAE ({f.config_path}) decodes square images only; drop it")
    bad = _misfit_bucket(resolution, factor) if f.aspect_ratio_buckets else None
    if bad:
        fits = next(size for size in range(resolution + BUCKET_MULTIPLE, 64 * resolution, BUCKET_MULTIPLE)
                    if size % factor == 0 and not _misfit_bucket(size, factor))
        raise ValueError(f"--aspect_ratio_buckets at --resolution {resolution} makes buckets such as "
                         f"{bad[0]}x{bad[1]}, whose sides are not multiples of the VAE's downsampling factor {factor} "
                         f"({f.config_path}): use e.g. --resolution {fits}, or drop --aspect_ratio_buckets.")


def _misfit_bucket(resolution: int, factor: int) -> Optional[Tuple[int, int]]:
    return next((shape for shape in bucket_shapes(resolution) if shape[0] % factor or shape[1] % factor), None)


def check_tile_size(tile_size: int, config: Optional[Mapping[str, Any]], input_size: Optional[Sequence[int]] = None,
                    where: str = "the VAE's config") -> None:
    """Tiles ppdiffusers' tiled encode/decode gets right (`config` None: the VAE's factor is not known yet)."""
    if input_size is not None:
        raise ValueError("--eval_tiled cannot be combined with --input_size: ppdiffusers' tiles assume the decoder "
                         "returns the size the encoder saw. Drop --eval_tiled.")
    if config is None:
        return
    from .models.families import family_for_config

    family = family_for_config(config, where)
    if not family.tiling:
        raise ValueError(f"--eval_tiled: {family.class_name} has no tiled encode/decode here; drop --eval_tiled")
    multiple = 4 * family.geometry(config).factor  # the tile starts must fall on latent pixels
    if tile_size < multiple or tile_size % multiple:
        fits = max(multiple, round(tile_size / multiple) * multiple)
        raise ValueError(f"--eval_tile_size {tile_size} must be a multiple of {multiple} (4 x the VAE's "
                         f"downsampling factor {multiple // 4}, {where}) for the tiled encode/decode to "
                         f"stitch the tiles back to the image's size: use e.g. --eval_tile_size {fits}")


def check_tiling_flags(args, config: Optional[Mapping[str, Any]], where: str) -> None:
    """--eval_tile_size needs --eval_tiled and is >= 1; `check_tile_size` (`config`: the VAE's, None if unknown)."""
    eval_tiled, tile_size = args.eval_tiled, args.eval_tile_size
    if tile_size is not None and not eval_tiled:
        raise ValueError("--eval_tile_size does nothing without --eval_tiled: add --eval_tiled, or drop it")
    if tile_size is not None and tile_size < 1:
        raise ValueError(f"--eval_tile_size must be >= 1, got {tile_size}")
    if eval_tiled:
        check_tile_size(tile_size or DEFAULT_TILE_SIZE, config, args.input_size, where)


def flag_values(arguments: Sequence[Any]) -> SimpleNamespace:
    """Every flag of the argument dataclasses as an attribute, plus the facts the rows read from several flags
    (raises on a bad --scaling_factor): the VAE's config (`config`, `config_path`: `vae_config`) and `family`, its
    config's, else the KL family's (a single file)."""
    from .models.families import family_for_config
    from .models.families.kl import KL
    from .models.families.tiny import TINY as STUDENT
    from .models.latent_scale import scaling_factor_mode
    from .models.lpips import DEFAULT_LPIPS_WEIGHTS

    f = SimpleNamespace(**{field.name: getattr(a, field.name) for a in arguments for field in dataclasses.fields(a)})
    f.measures_scale = scaling_factor_mode(f) == "measure"
    f.evaluates = bool(f.eval_file_list) and bool(f.eval_steps)  # as evaluation.TrainingEvaluator.enabled
    f.loads_weights = bool(f.pretrained_model_name_or_path or f.init_from_ckpt)
    f.lpips_missing = not os.path.isfile(f.lpips_weights or DEFAULT_LPIPS_WEIGHTS)
    f.scheduler = getattr(f.lr_scheduler_type, "value", f.lr_scheduler_type)  # PaddleNLP makes it a SchedulerType
    f.visualdl = bool({"visualdl", "all"} & set(f.report_to or []))
    f.config_path, f.config = vae_config(f)
    f.family = KL if f.config is None else family_for_config(f.config, f.config_path)
    f.geometry = f.family.geometry(f.config or {})
    f.deterministic, f.frozen_latent = f.geometry.deterministic, not f.geometry.encoder_trains
    f.video = f.geometry.frames  # a video VAE's temporal factor, 0 for an image VAE
    f.family_known = f.config is not None or os.path.isfile(f.pretrained_model_name_or_path or "")
    f.single_frames = f.num_frames == 1 or f.video_image_ratio == 1
    f.distils, f.student = bool(f.teacher_model_name_or_path), f.family is STUDENT
    return f

