"""The flags refused at parse time, before anything is built, in both entry points.

`REFUSALS` is the one table of refusals, checked by `refuse` on the flags a user gave (a --recipe's values never
count) and on PaddleNLP's inherited flags by value; `check_sizes` checks sizes against the VAE's config file.
Importing this module stays free of Paddle (evaluation.py and scripts/eval_vae.py share the tiling checks).
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from .data.buckets import BUCKET_MULTIPLE, bucket_shapes

DEFAULT_TILE_SIZE = 512  # --eval_tile_size's default: the SD VAE's sample_size


def downsampling_factor(config: Mapping[str, Any]) -> int:
    """The encoder's downsampling factor, as the config's family says (models/family.py)."""
    from .models.families import family_for_config

    return family_for_config(config).geometry(config).factor


def vae_config(model_args) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(path, contents) of the config of the VAE the flags build: --vae_config_file, else the pretrained folder's or
    the --init_from_ckpt checkpoint's; (path or None, None) when there is none to read (a single file)."""
    from .checkpoint import checkpoint_vae_config

    path, derived = model_args.vae_config_file, derived_student_config(model_args)
    if derived:
        return f"the student of {model_args.teacher_model_name_or_path}", derived
    if path is None and model_args.pretrained_model_name_or_path:
        path = os.path.join(model_args.pretrained_model_name_or_path, model_args.subfolder or "", "config.json")
    elif path is None and model_args.init_from_ckpt:
        path = checkpoint_vae_config(model_args.init_from_ckpt)
    if path is None or not os.path.isfile(path):
        return path, None
    with open(path) as handle:
        return path, {key: value for key, value in json.load(handle).items() if value is not None}


def derived_student_config(model_args) -> Optional[Dict[str, Any]]:
    """A distillation's student config from its teacher's geometry (--student_width, --student_depth), when no flag
    gives the student (--vae_config_file, --pretrained_model_name_or_path, --init_from_ckpt); else None."""
    from .models.teacher import student_of

    given = model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt
    teacher = getattr(model_args, "teacher_model_name_or_path", None)
    return None if given or not teacher else student_of(teacher, model_args.teacher_subfolder,
                                                        model_args.student_width, model_args.student_depth)


def check_sizes(model_args, data_args) -> None:
    """--resolution, --input_size, bucket shapes and tiles against the VAE's config file (none: checked once built)."""
    from .models.families import check_reconstruction_shape

    path, config = vae_config(model_args)
    check_tiling_flags(model_args, data_args, config, path if config is not None else "no config file")
    if config is None:
        return
    resolution, factor = data_args.resolution, downsampling_factor(config)
    check_reconstruction_shape(config, model_args.input_size, resolution, path)
    if data_args.aspect_ratio_buckets and _family_of_flags(model_args).geometry(config).output_size:
        raise ValueError(f"--aspect_ratio_buckets: this VAE ({path}) decodes square images only; drop it")
    bad = _misfit_bucket(resolution, factor) if data_args.aspect_ratio_buckets else None
    if bad:
        fits = next(size for size in range(resolution + BUCKET_MULTIPLE, 64 * resolution, BUCKET_MULTIPLE)
                    if size % factor == 0 and not _misfit_bucket(size, factor))
        raise ValueError(f"--aspect_ratio_buckets at --resolution {resolution} makes buckets such as "
                         f"{bad[0]}x{bad[1]}, whose sides are not multiples of the VAE's downsampling factor {factor} "
                         f"({path}): use e.g. --resolution {fits}, or drop --aspect_ratio_buckets.")


def _misfit_bucket(resolution: int, factor: int) -> Optional[Tuple[int, int]]:
    return next((shape for shape in bucket_shapes(resolution) if shape[0] % factor or shape[1] % factor), None)


def check_eval_batch_size(given: Optional[int], flag: str = "--per_device_eval_batch_size") -> None:
    """An evaluation batch the user gave (`flag`: --per_device_eval_batch_size, the scripts' --batch_size)."""
    if given is not None and given < 1:
        raise ValueError(f"{flag} must be >= 1, got {given}")


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
    multiple = 4 * downsampling_factor(config)  # the tile starts must fall on latent pixels
    if tile_size < multiple or tile_size % multiple:
        fits = max(multiple, round(tile_size / multiple) * multiple)
        raise ValueError(f"--eval_tile_size {tile_size} must be a multiple of {multiple} (4 x the VAE's "
                         f"downsampling factor {multiple // 4}, {where}) for the tiled encode/decode to "
                         f"stitch the tiles back to the image's size: use e.g. --eval_tile_size {fits}")


def check_tiling_flags(model_args, data_args, config: Optional[Mapping[str, Any]], where: str) -> None:
    """--eval_tile_size needs --eval_tiled and is >= 1; `check_tile_size` (`config`: the VAE's, None if unknown)."""
    eval_tiled, tile_size = data_args.eval_tiled, data_args.eval_tile_size
    if tile_size is not None and not eval_tiled:
        raise ValueError("--eval_tile_size does nothing without --eval_tiled: add --eval_tiled, or drop it")
    if tile_size is not None and tile_size < 1:
        raise ValueError(f"--eval_tile_size must be >= 1, got {tile_size}")
    if eval_tiled:
        check_tile_size(tile_size or DEFAULT_TILE_SIZE, config, model_args.input_size, where)


def flag_values(arguments: Sequence[Any]) -> SimpleNamespace:
    """Every flag of the argument dataclasses as an attribute, plus the facts the rows read from several flags
    (raises on a bad --scaling_factor)."""
    from .models.latent_scale import reinitialises_encoder, scaling_factor_mode
    from .models.lpips import DEFAULT_LPIPS_WEIGHTS
    from .models.teacher import STUDENT

    f = SimpleNamespace(**{field.name: getattr(a, field.name) for a in arguments for field in dataclasses.fields(a)})
    f.measures_scale = scaling_factor_mode(f) == "measure"
    f.evaluates = bool(f.eval_file_list) and bool(f.eval_steps)  # as evaluation.TrainingEvaluator.enabled
    f.loads_weights = bool(f.pretrained_model_name_or_path or f.init_from_ckpt)
    f.metric = (f.metric_for_best_model or "").replace("eval_", "")
    f.lpips_missing = not os.path.isfile(f.lpips_weights or DEFAULT_LPIPS_WEIGHTS)
    f.scheduler = getattr(f.lr_scheduler_type, "value", f.lr_scheduler_type)  # PaddleNLP makes it a SchedulerType
    f.visualdl = bool({"visualdl", "all"} & set(f.report_to or []))
    f.family = _family_of_flags(f)
    path, config = vae_config(f)
    f.geometry = f.family.geometry(config or {})
    f.deterministic, f.frozen_latent, f.video = f.geometry.deterministic, not f.geometry.encoder_trains, f.geometry.frames
    f.reinitialises_encoder = reinitialises_encoder(f.ignore_keys, f.family)
    f.family_known = config is not None or os.path.isfile(f.pretrained_model_name_or_path or "")
    f.single_frames = f.num_frames == 1 or f.video_image_ratio == 1
    f.distils, f.student = bool(f.teacher_model_name_or_path), f.family is STUDENT
    return f


def _family_of_flags(f):
    """The family (models/family.py) of the VAE the flags build: its config's, else AutoencoderKL's (a single file)."""
    from .models.families import family_for_config
    from .models.families.kl import KL

    path, config = vae_config(f)
    return KL if config is None else family_for_config(config, path)


SINGLE_FRAMES = "it applies to clips, and every sample is one frame (--num_frames 1, or --video_image_ratio 1): "
FAMILY = "{family}"  # in a refusal's reason: the class of the VAE the flags give (its family's), named by `refuse`
FRAMES, FRAME_COUNTS = "{frames}", "{frame_counts}"  # and its temporal factor k, the first clip lengths 1 + k n
FROZEN_LATENT = f"the latent is {FAMILY}'s frozen representation encoder's tokens (DINOv2's), which no flag trains"

# (flags, when they are refused given the other flags, why and what to do instead).
Rows = Tuple[Tuple[Tuple[str, ...], Callable[[Any], bool], str], ...]
REFUSALS: Rows = (
    # Values a flag cannot take, and flags that contradict or need others.
    (("ignore_keys",), lambda f: f.ignore_keys and not f.loads_weights,
     "it names weights not to load: add --pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("freeze_encoder", "trainable_modules"),
     lambda f: (f.freeze_encoder or f.trainable_modules) and not f.loads_weights and not f.distils,
     "it keeps weights as loaded, and a VAE trained from scratch has only random ones: add "
     "--pretrained_model_name_or_path or --init_from_ckpt, or drop it"),
    (("input_size",), lambda f: f.input_size is not None and (len(f.input_size) != 2 or min(f.input_size) < 1),
     "it takes two positive numbers H W"),
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.input_size is not None,
     "it cannot be combined with --input_size (one fixed encoder input; each bucket has its own shape): drop one"),
    (("aspect_ratio_buckets",), lambda f: f.aspect_ratio_buckets and f.resolution % BUCKET_MULTIPLE,
     f"it needs a --resolution that is a multiple of {BUCKET_MULTIPLE} (bucket sides are)"),
    (("ignore_keys",), lambda f: f.ignore_keys and f.frozen_latent and f.reinitialises_encoder,
     f"{FROZEN_LATENT}: re-initialised, it would stay random; leave the encoder's weights out of it"),
    (("rae_encoder_path",), lambda f: f.rae_encoder_path and (f.loads_weights or not f.vae_config_file),
     "it is the encoder of an RAE decoder trained from scratch (--vae_config_file): a VAE folder or a "
     "checkpoint holds its own encoder; drop it"),
    (("noise_tau",), lambda f: f.noise_tau is not None and f.noise_tau < 0, "it is a noise level: >= 0"),
    (("eval_steps",), lambda f: f.eval_steps is not None and f.eval_steps < 1,
     "it must be >= 1 (leave it out to not evaluate)"),
    (("eval_steps",), lambda f: f.eval_steps and not f.eval_file_list,
     "it needs --eval_file_list: the held-out images to evaluate on"),
    (("eval_file_list",), lambda f: f.eval_file_list and not f.eval_steps,
     "it is never evaluated without --eval_steps: add --eval_steps N (every N steps and at the end; --eval_steps "
     "equal to --max_steps evaluates once, at the end)"),
    (("metric_for_best_model",), lambda f: f.metric and not f.evaluates,
     "it needs evaluations: add --eval_file_list and --eval_steps"),
    (("metric_for_best_model",), lambda f: f.metric == "rfid" and not f.inception_weights,
     "rFID is measured only with --inception_weights: add them"),
    (("metric_for_best_model",), lambda f: f.metric == "lpips" and f.lpips_missing,
     "LPIPS needs its weights (--lpips_weights; default weights/lpips_vgg16.pdparams, from make setup): give them"),
    (("metric_for_best_model",), lambda f: f.metric == "vf_alignment_cka" and not f.vf_model_path,
     "the alignment is measured only with --vf_model_path: add it"),
    (("metric_for_best_model",), lambda f: f.metric == "flicker" and f.num_frames == 1,
     "flicker is measured on clips: add --num_frames N (> 1), or pick another metric"),
    (("subfolder",), lambda f: not f.pretrained_model_name_or_path,
     "it is a folder inside --pretrained_model_name_or_path: add that, or drop it"),
    (("inception_weights",), lambda f: not f.evaluates, "rFID is measured in evaluations: add --eval_file_list and "
     "--eval_steps, or drop it (scripts/eval_vae.py --inception_weights measures a saved VAE)"),
    (("latent_stats_num_images",), lambda f: not f.measures_scale, "it counts the images of a measured scaling "
     "factor, and this run keeps or is given its factor: add --scaling_factor measure, or drop it"),
    (("eval_tiled", "eval_tile_size"), lambda f: not f.evaluates and not f.measures_scale,
     "it tiles evaluations and the measurement of the scaling factor, and this run has neither: add "
     "--eval_file_list and --eval_steps (or --scaling_factor measure), or drop it"),
    (("ema_decay",), lambda f: not f.use_ema, "it does nothing without --use_ema true: add that, or drop it"),
    (("num_logged_images",), lambda f: not (f.visualdl and (f.image_logging_steps > 0 or f.evaluates)),
     "no image grid is logged (it needs VisualDL logs, --report_to visualdl, and --image_logging_steps > 0 or "
     "evaluation): drop it"),
    (("image_logging_steps",), lambda f: f.image_logging_steps > 0 and not f.visualdl,
     "images are logged to VisualDL only: drop it or --report_to none"),
    (("logging_dir",), lambda f: not f.visualdl,
     "it is the VisualDL log folder, and --report_to none writes none: drop one of them"),
    (("fp16_opt_level",), lambda f: not (f.fp16 or f.bf16), "it does nothing without --fp16 or --bf16: add one, or "
                                                             "drop it"),
    (("scale_loss", "min_loss_scale", "max_consecutive_overflow_steps"), lambda f: not f.fp16,
     "only --fp16 scales the loss (bf16 needs no scaling): add --fp16, or drop it"),
    (("num_cycles",), lambda f: f.scheduler != "cosine", "only --lr_scheduler_type cosine reads it: drop it"),
    (("lr_end", "power"), lambda f: f.scheduler != "polynomial",
     "only --lr_scheduler_type polynomial reads it: drop it"),
    (("warmup_steps", "warmup_ratio"), lambda f: f.scheduler == "constant",
     "--lr_scheduler_type constant has no warm-up (constant_with_warmup has): drop it"),
    (("warmup_ratio",), lambda f: f.warmup_steps > 0, "--warmup_steps > 0 wins over it: drop one"),
)

# A flag given its value that does nothing is never refused as idle: ppdiffusers' commands pass e.g.
# `--lr_scheduler_type constant --warmup_steps 0`. Any other value of these flags stays refused where idle.
INERT_VALUES: Dict[str, Any] = {"warmup_steps": 0, "warmup_ratio": 0.0, "lecam_weight": 0.0, "image_logging_steps": 0,
                                "subfolder": "", "eval_tiled": False, "vf_weight": 0.0, "disc_weight_warmup_steps": 0,
                                "disc_replay_size": 0, "latent_distill_weight": 0.0}


def _shown(value: Any) -> str:
    """A flag's value as typed after it."""
    value = getattr(value, "value", value)  # an Enum
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def refuse(flags: Any, given: Set[str], rows: Rows, header: str = "", otherwise: Optional[str] = None) -> None:
    """Raise one ValueError naming each flag in `given` that one of `rows` refuses with the values of `flags`;
    `otherwise`: the reason for a given flag no row names."""
    family, frames, lines = getattr(flags, "family", None), getattr(flags, "video", 0) or 4, []
    for names, when, why in rows:
        why = why.replace(FAMILY, family.class_name if family else "this autoencoder").replace(FRAMES, str(frames))
        why = why.replace(FRAME_COUNTS, ", ".join(str(1 + frames * n) for n in range(1, 5)))
        for name in names:
            if name not in given or (name in INERT_VALUES and getattr(flags, name) == INERT_VALUES[name]):
                continue
            if when(flags):
                lines.append(f"--{name} {_shown(getattr(flags, name))}: {why}")
    if otherwise:
        named = {name for names, _, _ in rows for name in names}
        lines += [f"--{name} {_shown(getattr(flags, name))}: {otherwise}" for name in sorted(given - named)]
    if lines:
        raise ValueError("\n  ".join([header + ":"] + lines if header else lines))
