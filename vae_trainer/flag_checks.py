"""Flags refused at parse time, before anything expensive is built, in both entry points.

Owns three kinds of check, which argument_parser.validate runs with its own (a VAE source, choices, the
techniques' values); it reads the parsed objects and never imports arguments.py, nor Paddle:

- `check_sizes`: --resolution, --input_size and the --aspect_ratio_buckets shapes against the VAE's
  downsampling factor, 2 ** (number of down blocks - 1) (8 for SD, SDXL, FLUX), read from the VAE's
  config file without building the VAE. A single-file checkpoint without --vae_config_file has no config
  to read: its sizes are checked when it is built (build.py, the same `check_reconstruction_shape`).
  Also --eval_tiled / --eval_tile_size (`check_tiling_flags`; evaluation.py applies `check_tile_size` again
  at each evaluation, with the built VAE's config).
- `check_evaluation`: the evaluation flags act only together (--eval_file_list with --eval_steps, the
  metric for the best checkpoint measured), and --per_device_eval_batch_size >= 1 (`check_eval_batch_size`,
  which evaluation.eval_batch_size and the scripts' --batch_size share).
- `refuse_idle_flags`: a flag the user gave that would silently do nothing with the other flags
  (`idle_rules`: --ema_decay without --use_ema, discriminator flags with --disc_weight 0, ...). Only flags
  the user gave count (a --recipe's values never do), and never a flag given its value that does nothing
  (`INERT_VALUES`: `--warmup_steps 0` with `--lr_scheduler_type constant`, as ppdiffusers' commands pass
  it); the message names the flag to drop or to add.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Set, Tuple

from .data.buckets import BUCKET_MULTIPLE, bucket_shapes

# Importing this module stays free of Paddle (eval_vae.py and the parse-time checks run before, or without, the
# rest): what needs Paddle, PaddleNLP or ppdiffusers is imported in the function that uses it.


# ---------------------------------------------------------------------------------------------- sizes
def vae_config_for_checks(model_args) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the AutoencoderKL config the run will build, where it comes from), read from JSON only; (None, why)
    when no config file states it (a single-file checkpoint) or the file is missing (the build reports it)."""
    from .checkpoint import checkpoint_vae_config

    path = model_args.vae_config_file
    if path is None and model_args.pretrained_model_name_or_path:
        folder = os.path.join(model_args.pretrained_model_name_or_path, model_args.subfolder or "")
        path = os.path.join(folder, "config.json") if os.path.isdir(folder) else None
    elif path is None and model_args.init_from_ckpt:
        path = checkpoint_vae_config(model_args.init_from_ckpt)
    if path is None or not os.path.isfile(path):
        return None, "no config file"
    with open(path) as handle:
        return _with_defaults(json.load(handle)), path


def _with_defaults(config: Dict[str, Any]) -> Dict[str, Any]:
    """The block lists AutoencoderKL uses when a config file leaves them out."""
    from ppdiffusers import AutoencoderKL

    parameters = inspect.signature(AutoencoderKL.__init__).parameters
    defaults = {name: parameters[name].default for name in ("down_block_types", "up_block_types")}
    return {**defaults, **{key: value for key, value in config.items() if value is not None}}


def downsampling_factor(config: Dict[str, Any]) -> int:
    """The encoder's downsampling factor: 2 ** (down blocks - 1)."""
    return 2 ** (len(config["down_block_types"]) - 1)


def check_sizes(model_args, data_args) -> None:
    """--resolution / --input_size / bucket shapes that the VAE's encoder and decoder can take."""
    from .models.vae import check_reconstruction_shape

    resolution = data_args.resolution
    if data_args.aspect_ratio_buckets:
        if model_args.input_size is not None:
            raise ValueError(
                "--aspect_ratio_buckets cannot be combined with --input_size: --input_size is one fixed encoder "
                "input size, while every bucket has its own shape. Drop one of them.")
        if resolution % BUCKET_MULTIPLE:
            raise ValueError(f"--aspect_ratio_buckets needs a --resolution that is a multiple of {BUCKET_MULTIPLE} "
                             f"(bucket sides are), got {resolution}")
    config, where = vae_config_for_checks(model_args)
    check_tiling_flags(model_args, data_args, config, where)  # --eval_tiled / --eval_tile_size
    if config is None:
        return
    check_reconstruction_shape(config, model_args.input_size, resolution, where)
    if data_args.aspect_ratio_buckets:
        _check_bucket_shapes(resolution, downsampling_factor(config), where)


def _buckets_fit(resolution: int, factor: int) -> bool:
    return all(width % factor == 0 and height % factor == 0 for width, height in bucket_shapes(resolution))


def _check_bucket_shapes(resolution: int, factor: int, where: str) -> None:
    if _buckets_fit(resolution, factor):
        return
    bad = next(shape for shape in bucket_shapes(resolution) if shape[0] % factor or shape[1] % factor)
    fits = next(r for r in range(resolution + BUCKET_MULTIPLE, 64 * resolution, BUCKET_MULTIPLE)
                if r % factor == 0 and _buckets_fit(r, factor))
    raise ValueError(
        f"--aspect_ratio_buckets at --resolution {resolution} makes buckets such as {bad[0]}x{bad[1]}, whose sides "
        f"are not multiples of the VAE's downsampling factor {factor} ({where}): use e.g. --resolution {fits}, or "
        "drop --aspect_ratio_buckets.")


# ------------------------------------------------------------------------ evaluation batch and tiling
# The rules evaluation.py applies at run time (eval_batch_size, check_tiling), here so that the flags are
# refused at parse time, before --overwrite_output_dir deletes anything, without importing evaluation.py.
DEFAULT_TILE_SIZE = 512  # --eval_tile_size's default: the SD VAE's sample_size (evaluation.Tiling)


def check_eval_batch_size(given: Optional[int], flag: str = "--per_device_eval_batch_size") -> None:
    """An evaluation batch the user gave (`flag`: --per_device_eval_batch_size, the scripts' --batch_size)."""
    if given is not None and given < 1:
        raise ValueError(f"{flag} must be >= 1, got {given}")


def check_tile_size(tile_size: int, config: Optional[Mapping[str, Any]], input_size: Optional[Sequence[int]] = None,
                    where: str = "the VAE's config") -> None:
    """Refuse tiling settings ppdiffusers' tiled encode/decode would get wrong: with --input_size (the tiles
    assume the decoder returns the encoder's input size) and tile sizes that are not a multiple of 4 x the
    downsampling factor (the tile starts, 75% of a tile apart, must fall on latent pixels in both passes, or
    the stitched output has the wrong size). `config` None: the VAE's factor is not known yet."""
    if input_size is not None:
        raise ValueError("--eval_tiled cannot be combined with --input_size: ppdiffusers' tiles assume the decoder "
                         "returns the size the encoder saw. Drop --eval_tiled.")
    if config is None:
        return
    multiple = 4 * downsampling_factor(config)
    if tile_size < multiple or tile_size % multiple:
        fits = max(multiple, round(tile_size / multiple) * multiple)
        raise ValueError(f"--eval_tile_size {tile_size} must be a multiple of {multiple} (4 x the VAE's "
                         f"downsampling factor {multiple // 4}, {where}) for ppdiffusers' tiled encode/decode to "
                         f"stitch the tiles back to the image's size: use e.g. --eval_tile_size {fits}")


def check_tiling_flags(model_args, data_args, config: Optional[Mapping[str, Any]], where: str) -> None:
    """--eval_tile_size needs --eval_tiled and is >= 1; `check_tile_size` (`config`: the VAE's, None if unknown)."""
    eval_tiled, tile_size = getattr(data_args, "eval_tiled", False), getattr(data_args, "eval_tile_size", None)
    if tile_size is not None and not eval_tiled:
        raise ValueError("--eval_tile_size does nothing without --eval_tiled: add --eval_tiled, or drop it")
    if tile_size is not None and tile_size < 1:
        raise ValueError(f"--eval_tile_size must be >= 1, got {tile_size}")
    if eval_tiled:
        check_tile_size(tile_size or DEFAULT_TILE_SIZE, config, model_args.input_size, where)


# ----------------------------------------------------------------------------------------- evaluation
def evaluates(data_args, training_args) -> bool:
    """Does the run evaluate during training (evaluation.TrainingEvaluator.enabled)?"""
    return bool(data_args.eval_file_list) and bool(training_args.eval_steps)


def check_evaluation(model_args, data_args, training_args) -> None:
    """Evaluation flags that only act together, and the evaluation batch."""
    from .models.lpips import DEFAULT_LPIPS_WEIGHTS

    check_eval_batch_size(getattr(training_args, "per_device_eval_batch_size", None))
    eval_steps = training_args.eval_steps
    if eval_steps is not None and eval_steps < 1:
        raise ValueError(f"--eval_steps must be >= 1, got {eval_steps} (leave it out to not evaluate)")
    if eval_steps and not data_args.eval_file_list:
        raise ValueError("--eval_steps needs --eval_file_list: the held-out images to evaluate on.")
    if data_args.eval_file_list and not eval_steps:
        raise ValueError("--eval_file_list without --eval_steps is never evaluated: add --eval_steps N (every N "
                         "steps and at the end; --eval_steps equal to --max_steps evaluates once, at the end).")
    metric = (training_args.metric_for_best_model or "").replace("eval_", "")
    if metric and not evaluates(data_args, training_args):
        raise ValueError(f"--metric_for_best_model {metric} needs evaluations: add --eval_file_list and --eval_steps.")
    if metric == "rfid" and not data_args.inception_weights:
        raise ValueError("--metric_for_best_model rfid needs --inception_weights: without them rFID is not measured.")
    if metric == "vf_alignment_cka" and not model_args.vf_model_path:
        raise ValueError("--metric_for_best_model vf_alignment_cka needs --vf_model_path: without it the alignment "
                         "is not measured.")
    lpips_weights = model_args.lpips_weights or DEFAULT_LPIPS_WEIGHTS
    if metric == "lpips" and not os.path.isfile(lpips_weights):
        raise ValueError(f"--metric_for_best_model lpips needs the LPIPS weights {lpips_weights} (make setup writes "
                         "them; or give --lpips_weights): without them LPIPS is not measured.")


# --------------------------------------------------------------------------------------- idle flags
@dataclass(frozen=True)
class Flags:
    """The four parsed argument objects, read by the rules below as one namespace."""

    model: Any
    data: Any
    loss: Any
    training: Any

    def classes(self) -> Tuple[type, ...]:
        """The dataclasses of the four objects (arguments.ALL_ARGUMENT_CLASSES, without importing it)."""
        return tuple(type(arguments) for arguments in (self.model, self.data, self.loss, self.training))

    def __getattr__(self, name: str) -> Any:
        for arguments in (self.model, self.data, self.loss, self.training):
            if hasattr(arguments, name):
                return getattr(arguments, name)
        raise AttributeError(name)


@dataclass(frozen=True)
class IdleRule:
    """`flags` do nothing when `idle(flags)` holds; `fix` says what to do instead."""

    flags: Tuple[str, ...]
    idle: Callable[[Flags], bool]
    fix: str


def _scheduler(f: Flags) -> str:
    """--lr_scheduler_type's name (PaddleNLP turns it into a SchedulerType enum)."""
    return getattr(f.lr_scheduler_type, "value", f.lr_scheduler_type)


def _logs_to_visualdl(f: Flags) -> bool:
    return bool({"visualdl", "all"} & set(f.report_to or []))


def _logs_images(f: Flags) -> bool:
    return _logs_to_visualdl(f) and (f.image_logging_steps > 0 or evaluates(f.data, f.training))


def _measures_latent_scale(f: Flags) -> bool:
    from .latent_scale import scaling_factor_mode

    return scaling_factor_mode(f.model) == "measure"


def discriminator_flags(classes: Sequence[type]) -> Tuple[str, ...]:
    """The flags of the --help group "discriminator" of the argument `classes` (but --disc_weight, which
    switches it on)."""
    return tuple(f.name for arguments in classes for f in dataclasses.fields(arguments)
                 if f.metadata.get("group", getattr(arguments, "_group", None)) == "discriminator"
                 and f.name != "disc_weight")


def _uses_scale(f: Flags) -> bool:
    from .equivariance import parse_transforms

    return "scale" in parse_transforms(f.equivariance_transforms)


def idle_rules(classes: Sequence[type]) -> Sequence[IdleRule]:
    """The rules for the flags of the argument `classes` (`Flags.classes`)."""
    return (
        IdleRule(discriminator_flags(classes), lambda f: f.disc_weight == 0,
                 "with --disc_weight 0 the discriminator never trains: drop it, or set --disc_weight > 0"),
        IdleRule(("disc_norm", "disc_num_layers"), lambda f: f.disc_type == "vgg",
                 "the VGG16 discriminator (--disc_type vgg) has no such setting: drop it"),
        IdleRule(("relative_hinge_margin",), lambda f: f.gen_loss != "relative_hinge",
                 "it is the margin of --gen_loss relative_hinge: add that, or drop it"),
        IdleRule(("lecam_decay",), lambda f: f.lecam_weight == 0, "add --lecam_weight > 0, or drop it"),
        IdleRule(("gradnorm_scope",), lambda f: f.loss_balancing != "gradnorm",
                 "add --loss_balancing gradnorm, or drop it"),
        IdleRule(("adaptive_disc_weight", "logvar_init"), lambda f: f.loss_balancing == "gradnorm",
                 "--loss_balancing gradnorm replaces the adaptive weight and the nll: drop it"),
        IdleRule(("pixel_loss_mask_threshold",), lambda f: f.pixel_loss_mask == "none",
                 "add --pixel_loss_mask lowpass, or drop it"),
        IdleRule(("equivariance_min_scale", "equivariance_transforms"), lambda f: f.equivariance_prob == 0,
                 "it shapes the transforms of --equivariance_prob, which is 0 (off): add --equivariance_prob 0.5, "
                 "or drop it"),
        IdleRule(("equivariance_min_scale",), lambda f: f.equivariance_prob > 0
                 and not _uses_scale(f),
                 "it is the range of the scale transform, which --equivariance_transforms leaves out: add scale "
                 "to it, or drop it"),
        IdleRule(("vf_weight", "distmat_margin", "cos_margin", "adaptive_vf"), lambda f: not f.vf_model_path,
                 "it shapes the VF loss of --vf_model_path, which is not given: add it, or drop it"),
        IdleRule(("distmat_margin", "cos_margin", "adaptive_vf"), lambda f: bool(f.vf_model_path) and f.vf_weight == 0,
                 "--vf_weight 0 turns the VF loss off: drop it, or give --vf_weight > 0"),
        IdleRule(("subfolder",), lambda f: not f.pretrained_model_name_or_path,
                 "it is a folder inside --pretrained_model_name_or_path: add that, or drop it"),
        IdleRule(("inception_weights",), lambda f: not evaluates(f.data, f.training),
                 "rFID is measured in evaluations: add --eval_file_list and --eval_steps, or drop it "
                 "(scripts/eval_vae.py --inception_weights measures a saved VAE)"),
        IdleRule(("latent_stats_num_images",), lambda f: not _measures_latent_scale(f),
                 "it counts the images of a measured scaling factor, and this run keeps or is given its "
                 "factor: add --scaling_factor measure, or drop it"),
        IdleRule(("eval_tiled", "eval_tile_size"), lambda f: not evaluates(f.data, f.training)
                 and not _measures_latent_scale(f),
                 "it tiles evaluations and the measurement of the scaling factor, and this run has neither: add "
                 "--eval_file_list and --eval_steps (or --scaling_factor measure), or drop it"),
        IdleRule(("ema_decay",), lambda f: not f.use_ema, "add --use_ema true, or drop it"),
        IdleRule(("num_logged_images",), lambda f: not _logs_images(f),
                 "no image grid is logged (it needs VisualDL logs, --report_to visualdl, and "
                 "--image_logging_steps > 0 or evaluation): drop it"),
        IdleRule(("image_logging_steps",), lambda f: f.image_logging_steps > 0 and not _logs_to_visualdl(f),
                 "images are logged to VisualDL only: drop it or --report_to none"),
        IdleRule(("logging_dir",), lambda f: not _logs_to_visualdl(f),
                 "it is the VisualDL log folder, and --report_to none writes none: drop one of them"),
        IdleRule(("fp16_opt_level",), lambda f: not (f.fp16 or f.bf16), "add --fp16 or --bf16, or drop it"),
        IdleRule(("scale_loss", "min_loss_scale", "max_consecutive_overflow_steps"), lambda f: not f.fp16,
                 "only --fp16 scales the loss (bf16 needs no scaling): add --fp16, or drop it"),
        IdleRule(("num_cycles",), lambda f: _scheduler(f) != "cosine",
                 "only --lr_scheduler_type cosine reads it: drop it"),
        IdleRule(("lr_end", "power"), lambda f: _scheduler(f) != "polynomial",
                 "only --lr_scheduler_type polynomial reads it: drop it"),
        IdleRule(("warmup_steps", "warmup_ratio"), lambda f: _scheduler(f) == "constant",
                 "--lr_scheduler_type constant has no warm-up (constant_with_warmup has): drop it"),
        IdleRule(("warmup_ratio",), lambda f: f.warmup_steps > 0, "--warmup_steps > 0 wins over it: drop one"),
    )


# The value with which a flag does nothing by itself. Such a value is never refused: with it, the flag cannot be
# "silently ignored" (it asks for nothing), and command lines copied from ppdiffusers pass e.g.
# `--lr_scheduler_type constant --warmup_steps 0`. Any other value of these flags stays refused where idle.
INERT_VALUES: Dict[str, Any] = {
    "warmup_steps": 0,        # no warm-up
    "warmup_ratio": 0.0,      # no warm-up
    "lecam_weight": 0.0,      # no LeCAM term (a discriminator flag, idle with --disc_weight 0)
    "vf_weight": 0.0,         # no VF loss
    "image_logging_steps": 0,  # no image grid
    "subfolder": "",          # the folder itself
    "eval_tiled": False,      # no tiling
}


def is_inert(flags: Flags, name: str) -> bool:
    """Does flag `name` hold its value that does nothing (`INERT_VALUES`)?"""
    return name in INERT_VALUES and getattr(flags, name) == INERT_VALUES[name]


def given_by_default_difference(objects: Iterable[Any]) -> Set[str]:
    """For arguments made in code (no command line): the fields whose value differs from a default instance's
    (for TrainingArguments one with the same --output_dir and --max_steps, as PaddleNLP rewrites fields)."""
    from paddlenlp.trainer import TrainingArguments

    given = set()
    for arguments in objects:
        if isinstance(arguments, TrainingArguments):
            reference = type(arguments)(output_dir=arguments.output_dir, max_steps=arguments.max_steps)
        else:
            reference = type(arguments)()
        given |= {f.name for f in dataclasses.fields(arguments)
                  if f.init and getattr(arguments, f.name) != getattr(reference, f.name)}
    return given


def canonical_names(names: Iterable[str]) -> Set[str]:
    """Flag names as typed (aliases of flag_policy.ALIASES included) -> field names."""
    from .flag_policy import ALIASES

    alias_of = {alias: name for name, aliases in ALIASES.items() for alias in aliases}
    return {alias_of.get(name, name) for name in names}


def refuse_idle_flags(flags: Flags, given: Set[str]) -> None:
    """Raise naming every flag in `given` that would do nothing with the other flags (`idle_rules`)."""
    idle = [f"--{name}: {rule.fix}" for rule in idle_rules(flags.classes()) for name in rule.flags
            if name in given and not is_inert(flags, name) and rule.idle(flags)]
    if idle:
        raise ValueError("flag(s) that would do nothing with the other flags:\n  " + "\n  ".join(dict.fromkeys(idle)))
