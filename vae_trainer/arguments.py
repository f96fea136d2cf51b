"""Command-line arguments shared by both entry points, and the parser that turns them into dataclasses.

Four dataclasses, parsed together by `VAEArgumentParser` (PaddleNLP's `PdArgumentParser`), so that
`train_vae_trainer.py` and `train_vae_no_trainer.py` accept exactly the same flags with the same meaning:

- `ModelArguments`: which VAE to train, the discriminator, the LPIPS weights.
- `DataArguments`: the filelists and image preprocessing (and the held-out images).
- `LossArguments`: the weights and kinds of every loss term.
- `VAETrainingArguments`: PaddleNLP's `TrainingArguments` with defaults suited to VAE training, plus our
  own run-time options (EMA, image logging, discriminator LR).

Flags that work in both drivers only. Of PaddleNLP's ~90 inherited `TrainingArguments`, only those in
`PADDLENLP_FLAGS` are honoured by both drivers with the same meaning (each is read by our shared code:
optim.py, checkpoint.py, train_logging.py, evaluation.py, build.py; the Trainer's own loop adds nothing
the plain loop lacks). Any other inherited flag set to a non-default value, on the command line, in a
JSON args file or in code, is refused with a message (`refuse_unsupported_flags`), and is hidden from
`--help`.

`--help` groups flags by concern, in the order of `GROUPS`, before PaddleNLP's. A field's group is its
metadata "group", else its dataclass's `_group`, so fields added to a dataclass land in a group without
further work. Choice flags are typed `Literal[...]`: their choices show in `--help` and a bad value
fails at parse time (`VAEArgumentParser` turns a Literal into argparse `choices`). `ALIASES` accepts the
spellings of the ppdiffusers reference scripts (README "Flags from the ppdiffusers scripts").

`parse_arguments` applies a `--recipe` preset (recipes.py) to every Model/Loss field the user did not
give explicitly, then `validate`s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, get_args, get_origin, get_type_hints

from paddlenlp.trainer import PdArgumentParser, TrainingArguments
from paddlenlp.trainer.trainer_utils import SchedulerType

from .checkpoint import resume_requested
from .evaluation import HIGHER_IS_BETTER
from .models.discriminator import NORM_TYPES
from .recipes import RECIPES, apply_recipe, flags_given

# ---------------------------------------------------------------- typed choices
PixelLoss = Literal["l1", "l2"]
DiscLoss = Literal["hinge", "vanilla"]
GenLoss = Literal["hinge", "vanilla", "relative_hinge"]
PixelLossMask = Literal["none", "lowpass"]
LossBalancing = Literal["none", "gradnorm"]
GradnormScope = Literal["sample", "global"]
DiscType = Literal["patch", "vgg"]
DiscNorm = Literal[NORM_TYPES]
Recipe = Literal[tuple(RECIPES)]
SchedulerName = Literal[tuple(s.value for s in SchedulerType)]
EvalMetric = Literal[tuple(HIGHER_IS_BETTER)]
OptLevel = Literal["O1", "O2"]
Reporter = Literal["visualdl", "none"]

# ---------------------------------------------------------------- --help groups
GROUPS = {
    "data": "data: training images and preprocessing",
    "model": "model: the VAE to train",
    "loss": "loss: the VAE objective",
    "discriminator": "discriminator: the adversarial term and its network",
    "evaluation": "evaluation: held-out metrics during training",
    "training": "training: run-time options of both entry points",
}
PADDLENLP_GROUP = ("PaddleNLP TrainingArguments honoured identically by both entry points "
                   "(every other PaddleNLP flag is refused)")

# PaddleNLP TrainingArguments that both drivers honour with the same meaning.
PADDLENLP_FLAGS = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint",
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "max_steps",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "lr_scheduler_type", "warmup_steps", "warmup_ratio", "num_cycles", "lr_end", "power",
    "logging_dir", "logging_steps", "report_to", "disable_tqdm",
    "save_steps", "save_total_limit",
    "seed", "device", "dataloader_num_workers",
    "fp16", "bf16", "fp16_opt_level", "scale_loss", "recompute",
    "eval_steps", "metric_for_best_model",
})

# Why a well-known refused flag is refused, and what to use instead.
_EVALUATION_IS_OURS = ("evaluation is the same code in both drivers: use --eval_file_list with --eval_steps "
                       "(and --metric_for_best_model)")
_DATA_PARALLEL_ONLY = "only data parallelism is supported (paddle.distributed.launch); drop it"
REFUSAL_REASONS = {
    "num_train_epochs": "the training stream is infinite: set the run's length with --max_steps",
    "save_strategy": "checkpoints are saved every --save_steps optimizer steps (0: only at the end)",
    "logging_strategy": "scalars are logged every --logging_steps optimizer steps",
    "logging_first_step": "scalars are logged every --logging_steps optimizer steps",
    "optim": "the optimizer is AdamW in both drivers (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay)",
    "greater_is_better": "--metric_for_best_model decides it (psnr, ssim: higher is better; lpips, rfid: lower)",
    "to_static": "both drivers train in dynamic-graph mode",
    "amp_master_grad": "--fp16_opt_level O2 keeps float32 master weights in both optimizers",
    "no_cuda": "use --device cpu",
    "do_train": "both entry points always train; drop it",
    "do_eval": _EVALUATION_IS_OURS, "do_predict": _EVALUATION_IS_OURS, "evaluation_strategy": _EVALUATION_IS_OURS,
    "load_best_model_at_end": _EVALUATION_IS_OURS, "eval_accumulation_steps": _EVALUATION_IS_OURS,
    "max_evaluate_steps": _EVALUATION_IS_OURS, "prediction_loss_only": _EVALUATION_IS_OURS,
    "dataloader_drop_last": "training batches are always full (the stream is infinite)",
    "ignore_data_skip": "the data stream always resumes at its saved position",
    "run_name": "only VisualDL logs are written (--report_to visualdl|none)",
    "wandb_api_key": "only VisualDL logs are written (--report_to visualdl|none)",
    **{name: _DATA_PARALLEL_ONLY for name in (
        "sharding", "sharding_degree", "sharding_parallel_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "sep_parallel_degree", "data_parallel_config", "tensor_parallel_config",
        "pipeline_parallel_config", "sharding_parallel_config", "use_expert_parallel", "enable_auto_parallel")},
}

# The ppdiffusers reference scripts' spellings -> our flag (meanings checked against their sources; README).
ALIASES = {
    "per_device_train_batch_size": ("train_batch_size", "batch_size"),
    "max_steps": ("max_train_steps",),
    "weight_decay": ("adam_weight_decay",),
    "lr_scheduler_type": ("lr_scheduler",),
    "warmup_steps": ("lr_warmup_steps",),
    "dataloader_num_workers": ("num_workers",),
}


def _in(group: str, help: str) -> Dict[str, Any]:
    """Field metadata placing a flag in a --help group other than its dataclass's."""
    return {"help": help, "group": group}


@dataclass
class ModelArguments:
    _group = "model"

    vae_config_file: Optional[str] = field(
        default=None,
        metadata={"help": "AutoencoderKL config JSON (ppdiffusers format) to train from scratch, e.g. configs/vae_tiny.json."},
    )
    pretrained_model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Pretrained VAE to fine-tune, local only: a ppdiffusers or PyTorch diffusers folder "
                          "(config.json + weights; a pipeline folder with --subfolder vae), or an original LDM/SD/SDXL "
                          "single-file checkpoint (.safetensors/.ckpt). A single file's config is inferred from its "
                          "tensors with SD's scaling_factor 0.18215; also give --vae_config_file (e.g. "
                          "configs/sdxl_vae.json, configs/flux_vae.json) to set it. With a folder, --vae_config_file "
                          "replaces the architecture (load what fits; see --ignore_keys)."},
    )
    subfolder: Optional[str] = field(
        default=None, metadata={"help": "Subfolder of --pretrained_model_name_or_path that holds the VAE, e.g. 'vae'."}
    )
    ignore_keys: Optional[List[str]] = field(
        default=None,
        metadata={"help": "Weight-name prefixes NOT loaded from --pretrained_model_name_or_path / --init_from_ckpt, "
                          "e.g. 'decoder.' to re-initialise the decoder (seeded by --seed)."},
    )
    init_from_ckpt: Optional[str] = field(
        default=None,
        metadata={"help": "Load VAE weights only (no optimizer, schedule or step) from a checkpoint-N folder (or its "
                          "model_state.pdparams) or a VAE weight file (diffusion_paddle_model.safetensors, "
                          "model_state.pdparams, diffusion_pytorch_model.safetensors/.bin). Without "
                          "--vae_config_file / --pretrained_model_name_or_path the checkpoint's vae_config.json is used."},
    )
    freeze_encoder: bool = field(
        default=False,
        metadata={"help": "Freeze the encoder and quant_conv (out of the optimizer, no graph): decoder-only "
                          "fine-tuning, the latent space stays bit-identical."},
    )
    input_size: Optional[List[int]] = field(
        default=None,
        metadata={"help": "H W: the encoder sees the image bilinearly downsized to HxW while the loss compares the "
                          "--resolution target (a super-resolving decoder; needs a decoder with more up blocks)."},
    )
    scaling_factor: Optional[str] = field(
        default=None,
        metadata={"help": "Latent scale written to the exported vae/config.json: 'keep' (the VAE's own scaling_factor "
                          "and shift_factor), 'measure' (from posterior statistics, see --latent_stats_num_images) or "
                          "a number. Default: keep when the encoder's weights are loaded (--pretrained_model_name_or_path, "
                          "or --init_from_ckpt of a run that kept or was given its factor) and not re-initialised by "
                          "--ignore_keys; measure otherwise."},
    )
    discriminator_path: Optional[str] = field(
        default=None,
        metadata=_in("discriminator", "Start the discriminator from an earlier run's OUTPUT_DIR/discriminator (or a "
                                      "checkpoint-N folder); its type and norm must match --disc_type/--disc_norm/"
                                      "--disc_num_layers/--disc_base_channels."),
    )
    disc_type: DiscType = field(
        default="patch",
        metadata=_in("discriminator", "'patch' (PatchGAN) or 'vgg' (frozen ImageNet VGG16 features from "
                                      "--lpips_weights with a trained conv head per stage; --disc_base_channels = head width)."),
    )
    disc_norm: DiscNorm = field(default="batch", metadata=_in("discriminator", "PatchGAN normalisation."))
    disc_num_layers: int = field(default=3, metadata=_in("discriminator", "Number of strided layers of the PatchGAN."))
    disc_base_channels: int = field(default=64, metadata=_in("discriminator", "Channels of the first PatchGAN layer."))
    lpips_weights: Optional[str] = field(
        default=None,
        metadata=_in("loss", "LPIPS VGG16 weights (.pdparams). Default: weights/lpips_vgg16.pdparams made by `make setup`."),
    )
    posterior_std: float = field(
        default=0.0,
        metadata={"help": "Constant variance: if > 0, ignore the encoder's log-variance and sample z = mean + "
                          "posterior_std * noise (pair with --kl_weight 0 and --latent_penalty_weight). 0: off."},
    )


@dataclass
class DataArguments:
    _group = "data"

    file_list: Optional[str] = field(
        default=None,
        metadata={"help": "Training data: a .filelist.list (weighted sources), a .filelist (part files or tar shards), "
                          "a folder of images, or WebDataset tar shards (a .tar, a brace pattern like "
                          "shards/{00000..00999}.tar, or a 'pipe:COMMAND'). See README 'Preparing data'."},
    )
    resolution: int = field(default=256, metadata={"help": "Training crop size in pixels (and evaluation crop size)."})
    image_column: int = field(default=2, metadata={"help": "0-based tab-separated column that holds the base64 image."})
    random_flip: bool = field(default=True, metadata={"help": "Randomly flip training images horizontally."})
    random_crop: bool = field(default=True, metadata={"help": "Random crop for training (centre crop if false)."})
    min_image_size: int = field(default=32, metadata={"help": "Skip images whose shorter side is below this."})
    aspect_ratio_buckets: bool = field(
        default=False,
        metadata={"help": "Crop each training image to the bucket of nearest aspect ratio (1:2 to 2:1, about "
                          "resolution^2 pixels, sides multiples of 8; --resolution must be a multiple of 8) instead "
                          "of a square; every batch holds one shape."},
    )
    shuffle_buffer_size: int = field(
        default=1000,
        metadata={"help": "Training records shuffled together per loader worker; memory: this many encoded images."},
    )
    eval_file_list: Optional[str] = field(
        default=None, metadata=_in("evaluation", "Held-out filelist or image folder for evaluation during training.")
    )
    eval_num_images: int = field(
        default=64, metadata=_in("evaluation", "Number of held-out images evaluated per evaluation.")
    )
    latent_stats_num_images: Optional[int] = field(
        default=None,
        metadata={"help": "Images (from --eval_file_list, else --file_list) over which the latent statistics and a "
                          "measured scaling factor are computed at export (default: --eval_num_images; the last "
                          "evaluation is reused when it covered the same images with the same weights)."},
    )
    inception_weights: Optional[str] = field(
        default=None,
        metadata=_in("evaluation", "FID InceptionV3 weights (.pdparams, scripts/convert_inception_weights.py) "
                                   "to add rFID to evaluations."),
    )


@dataclass
class LossArguments:
    _group = "loss"

    pixel_loss: PixelLoss = field(default="l1", metadata={"help": "Pixel reconstruction loss."})
    perceptual_weight: float = field(default=1.0, metadata={"help": "Weight of the LPIPS term (0 disables LPIPS)."})
    kl_weight: float = field(default=1e-6, metadata={"help": "Weight of the KL term (LDM meaning, see README)."})
    disc_weight: float = field(
        default=0.5, metadata=_in("discriminator", "Weight of the adversarial term (0 disables the GAN).")
    )
    disc_start: int = field(
        default=50001, metadata=_in("discriminator", "Optimizer step at which the GAN terms switch on.")
    )
    disc_loss: DiscLoss = field(default="hinge", metadata=_in("discriminator", "Discriminator loss."))
    adaptive_disc_weight: bool = field(
        default=True,
        metadata=_in("discriminator", "Scale the GAN term by ||grad rec|| / ||grad gan|| at the decoder's last layer."),
    )
    learn_logvar: bool = field(
        default=False, metadata={"help": "Learn the output log-variance of the LDM nll (optimized with the VAE)."}
    )
    logvar_init: float = field(default=0.0, metadata={"help": "Initial value of the output log-variance."})
    sample_posterior: bool = field(
        default=True, metadata={"help": "Decode a posterior sample (true) or the posterior mean (false) in training."}
    )
    recipe: Optional[Recipe] = field(
        default=None,
        metadata={"help": "Preset of the technique flags (see docs/techniques.md). "
                          "Flags given explicitly on the command line win over the recipe."},
    )
    pixel_weight: float = field(default=1.0, metadata={"help": "Weight of the pixel term."})
    pixel_loss_pool: int = field(
        default=1, metadata={"help": "Take the pixel loss between KxK area-downsampled images (1: full resolution)."}
    )
    pixel_loss_mask: PixelLossMask = field(
        default="none", metadata={"help": "'lowpass': apply the pixel loss only where the input image is smooth."}
    )
    pixel_loss_mask_threshold: float = field(
        default=0.5, metadata={"help": "Low-pass mask: keep pixels whose inverted, normalised edge energy is >= this."}
    )
    latent_penalty_weight: float = field(
        default=0.0, metadata={"help": "Weight of mean(z_mean^2), the latent-magnitude penalty (for --posterior_std)."}
    )
    loss_balancing: LossBalancing = field(
        default="none",
        metadata={"help": "'gradnorm': every branch's gradient into the reconstruction is rescaled to norm = its "
                          "weight (pixel_weight, perceptual_weight, disc_weight); replaces the adaptive weight."},
    )
    gradnorm_scope: GradnormScope = field(
        default="sample", metadata={"help": "gradnorm: normalise per 'sample' or over the 'global' batch (all ranks)."}
    )
    gen_loss: Optional[GenLoss] = field(
        default=None, metadata=_in("discriminator", "Generator's GAN loss (default: the same as --disc_loss).")
    )
    relative_hinge_margin: float = field(
        default=0.1, metadata=_in("discriminator", "relative_hinge: loss = mean(relu(D(x) - D(x_hat) - margin)).")
    )
    lecam_weight: float = field(
        default=0.0, metadata=_in("discriminator", "Weight of the LeCAM regulariser of the discriminator.")
    )
    lecam_decay: float = field(
        default=0.99, metadata=_in("discriminator", "EMA decay of LeCAM's D(real) and D(fake) means.")
    )


@dataclass
class VAETrainingArguments(TrainingArguments):
    """PaddleNLP's TrainingArguments with VAE-friendly defaults and our extra options."""

    _group = "training"

    output_dir: str = field(default="outputs/vae", metadata=dict(help="Where checkpoints, logs and the VAE go."))
    overwrite_output_dir: bool = field(
        default=False,
        metadata=dict(help="Start a new run in an --output_dir that holds an earlier run: delete its checkpoints, "
                            "logs and exports first. Without it (or --resume_from_checkpoint) such a start is refused."),
    )
    max_steps: int = field(
        default=-1, metadata=dict(help="Optimizer steps to train (required: the training stream is infinite).")
    )
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata=dict(help="'latest' (the newest complete checkpoint in --output_dir, if any) or a "
                                         "checkpoint-N folder: continue that run exactly.")
    )
    recompute: bool = field(
        default=False, metadata=dict(help="Gradient checkpointing of the VAE (less memory, more compute).")
    )
    learning_rate: float = field(default=1e-4, metadata=dict(help="Peak learning rate of the VAE optimizer."))
    adam_beta1: float = field(default=0.5, metadata=dict(help="AdamW beta1 (LDM uses 0.5)."))
    adam_beta2: float = field(default=0.9, metadata=dict(help="AdamW beta2 (LDM uses 0.9)."))
    weight_decay: float = field(
        default=0.0, metadata=dict(help="AdamW decoupled weight decay (not applied to biases and norm weights).")
    )
    max_grad_norm: float = field(default=1.0, metadata=dict(help="Global-norm gradient clipping (0 disables)."))
    lr_scheduler_type: SchedulerName = field(
        default="constant_with_warmup",
        metadata=dict(help="LR schedule of both optimizers (PaddleNLP's get_scheduler; warm-up --warmup_steps)."),
    )
    fp16_opt_level: OptLevel = field(
        default="O1", metadata=dict(help="O1: autocast with float32 weights; O2: half-precision weights with float32 "
                                          "master weights in both optimizers (GPU).")
    )
    logging_dir: Optional[str] = field(
        default=None,
        metadata=dict(help="VisualDL log folder; a relative path is inside --output_dir, as in the ppdiffusers "
                            "scripts (default: OUTPUT_DIR/logs)."),
    )
    logging_steps: int = field(default=10, metadata=dict(help="Log scalars every N optimizer steps."))
    save_steps: int = field(
        default=1000, metadata=dict(help="Save checkpoint-N every N optimizer steps (0: only at the end).")
    )
    report_to: Optional[List[Reporter]] = field(
        default_factory=lambda: ["visualdl"], metadata=dict(help="Write VisualDL logs, or none.")
    )
    eval_steps: Optional[int] = field(
        default=None, metadata=_in("evaluation", "Evaluate every N optimizer steps and at the end (needs --eval_file_list).")
    )
    metric_for_best_model: Optional[EvalMetric] = field(
        default=None, metadata=_in("evaluation", "Keep the checkpoint with the best value of this evaluation metric.")
    )
    disc_learning_rate: Optional[float] = field(
        default=None, metadata=_in("discriminator", "Peak learning rate of the discriminator (default: --learning_rate).")
    )
    scale_lr: bool = field(
        default=False,
        metadata={"help": "Multiply --learning_rate (and --disc_learning_rate) by the global batch: per-device batch x "
                          "gradient accumulation x processes (LDM's rule; the reference trainer's ngpu x batch_size)."},
    )
    image_logging_steps: int = field(
        default=200, metadata={"help": "Log a grid of inputs and reconstructions every N steps (0 disables)."}
    )
    num_logged_images: int = field(default=4, metadata={"help": "Images in each logged reconstruction grid."})
    use_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the VAE weights; export it as OUTPUT_DIR/vae."})
    ema_decay: float = field(
        default=0.9999, metadata={"help": "EMA decay; warm-up: min(ema_decay, (1 + t) / (10 + t)) at step t."}
    )
    max_consecutive_nonfinite_steps: int = field(
        default=5, metadata={"help": "Stop (after saving) when this many optimizer steps in a row are non-finite."}
    )
    max_consecutive_overflow_steps: int = field(
        default=25,
        metadata={"help": "fp16: stop (after saving) when one network's gradients overflow in this many optimizer "
                          "steps in a row (each such step is skipped and halves its loss scale; from --scale_loss "
                          "32768 down to --min_loss_scale 1 takes 15)."},
    )
    min_loss_scale: float = field(
        default=1.0, metadata={"help": "fp16: the dynamic loss scale is never lowered below this."}
    )

    def __post_init__(self):
        refuse_unsupported_flags(self)  # before PaddleNLP normalises the values it is compared on
        # A fixed place users and tests can find (not a dated folder), relative to --output_dir as in the
        # ppdiffusers scripts.
        self.logging_dir = os.path.join(self.output_dir, self.logging_dir or "logs")
        super().__post_init__()
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("--max_steps must be set: the training stream is infinite.")
        if self.overwrite_output_dir and resume_requested(self.resume_from_checkpoint):
            raise ValueError("--overwrite_output_dir deletes the checkpoints --resume_from_checkpoint would resume: "
                             "give one of them.")


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)


def _inherited_fields() -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def refuse_unsupported_flags(args: TrainingArguments) -> None:
    """Raise if any inherited PaddleNLP flag outside `PADDLENLP_FLAGS` differs from PaddleNLP's default."""
    refused = [name for name, f in _inherited_fields().items()
               if name not in PADDLENLP_FLAGS and getattr(args, name) != _default(f)]
    if not refused:
        return
    lines = [f"--{name}: {REFUSAL_REASONS.get(name, 'not honoured the same way by both entry points')}"
             for name in refused]
    raise ValueError("refused PaddleNLP flag(s); train_vae_trainer.py and train_vae_no_trainer.py honour only the "
                     "PaddleNLP flags listed under --help:\n  " + "\n  ".join(lines))


USAGE = ("%(prog)s --file_list FILE (--vae_config_file JSON | --pretrained_model_name_or_path DIR) --max_steps N "
         "[--output_dir DIR] [flags below] | %(prog)s ARGS.json")


class _FlagTarget:
    """Where PdArgumentParser adds one field's flags: an argparse group, plus the field's aliases."""

    def __init__(self, group: argparse._ArgumentGroup, name: str, aliases: Sequence[str]):
        self.group, self.name, self.aliases = group, name, aliases

    def add_argument(self, *names: str, **kwargs):
        if names == (f"--{self.name}",):
            names = names + tuple(f"--{alias}" for alias in self.aliases)
        return self.group.add_argument(*names, **kwargs)


class VAEArgumentParser(PdArgumentParser):
    """PdArgumentParser with --help groups by concern, Literal choices, reference aliases, hidden refused flags."""

    def __init__(self, dataclass_types=ALL_ARGUMENT_CLASSES, **kwargs):
        self._groups: Dict[str, argparse._ArgumentGroup] = {}
        kwargs.setdefault("usage", USAGE)
        super().__init__(dataclass_types, **kwargs)
        self.allow_abbrev = False  # an abbreviated flag would not be recognised as explicit by the recipes

    def _group(self, key: str) -> argparse._ArgumentGroup:
        if not self._groups:  # created in a fixed order, so --help lists them in that order
            for name, title in GROUPS.items():
                self._groups[name] = self.add_argument_group(title)
            self._groups["paddlenlp"] = self.add_argument_group(PADDLENLP_GROUP)
        return self._groups[key]

    def _add_dataclass_arguments(self, dtype) -> None:
        hints = get_type_hints(dtype)
        inherited = _inherited_fields() if issubclass(dtype, TrainingArguments) else {}
        for f in dataclasses.fields(dtype):
            if not f.init:
                continue
            metadata = dict(f.metadata)
            group = metadata.pop("group", None) or ("paddlenlp" if f.name in inherited
                                                     else getattr(dtype, "_group", "training"))
            if f.name in inherited and f.name not in PADDLENLP_FLAGS:
                metadata["help"] = argparse.SUPPRESS  # parsed (to refuse it with a reason), never advertised
            spec = copy.copy(f)
            spec.type, choices = _argparse_type(hints[f.name])
            if choices is not None:
                metadata["choices"] = list(choices)
            spec.metadata = types.MappingProxyType(metadata)
            self._parse_dataclass_field(_FlagTarget(self._group(group), f.name, ALIASES.get(f.name, ())), spec)


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) is Union and type(None) in get_args(annotation):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def _literal_choices(annotation: Any) -> Optional[Tuple[Any, ...]]:
    """The values of a (possibly Optional) Literal type, else None."""
    annotation = _strip_optional(annotation)
    return get_args(annotation) if get_origin(annotation) is Literal else None


def _argparse_type(annotation: Any) -> Tuple[Any, Optional[Tuple[Any, ...]]]:
    """(type for PdArgumentParser, choices): Literal[...] and List[Literal[...]] become their value type + choices."""
    choices = _literal_choices(annotation)
    if choices is not None:
        return type(choices[0]), choices
    inner = _strip_optional(annotation)
    if get_origin(inner) is list and _literal_choices(get_args(inner)[0]) is not None:
        choices = _literal_choices(get_args(inner)[0])
        return List[type(choices[0])], choices
    return annotation, None


def validate(model_args: ModelArguments, data_args: DataArguments, loss_args: LossArguments) -> None:
    """Reject contradictory or unknown choices before anything expensive is built."""
    _validate_vae_source(model_args)
    if data_args.file_list is None:
        raise ValueError("--file_list is required (a folder of images, WebDataset tar shards, a .filelist or a .filelist.list).")
    for arguments in (model_args, data_args, loss_args):
        _check_choices(arguments)
    _validate_techniques(model_args, loss_args)


def _validate_vae_source(model_args: ModelArguments) -> None:
    """Which VAE, loaded how (models/vae_loading.py): the fine-tuning flags of docs and README "Fine-tune"."""
    if not (model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("Give the VAE: --vae_config_file (train from scratch) and/or --pretrained_model_name_or_path "
                         "(fine-tune), or --init_from_ckpt CHECKPOINT_DIR.")
    if model_args.ignore_keys and not (model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("--ignore_keys needs --pretrained_model_name_or_path or --init_from_ckpt (weights to skip).")
    if model_args.input_size is not None and (len(model_args.input_size) != 2 or min(model_args.input_size) < 1):
        raise ValueError(f"--input_size takes two positive numbers H W, got {model_args.input_size}")
    from .latent_scale import scaling_factor_mode

    scaling_factor_mode(model_args)  # raises on a bad --scaling_factor


def _check_choices(arguments: Any) -> None:
    """Literal-typed fields hold one of their values (the parser checks flags; this covers code and recipes)."""
    hints = get_type_hints(type(arguments))
    for f in dataclasses.fields(arguments):
        choices = _literal_choices(hints[f.name])
        value = getattr(arguments, f.name)
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"--{f.name} must be one of {choices}, got {value!r}")


def _validate_techniques(model_args: ModelArguments, loss_args: LossArguments) -> None:
    """The options of docs/techniques.md."""
    if loss_args.pixel_loss_pool < 1:
        raise ValueError("--pixel_loss_pool must be >= 1")
    if model_args.posterior_std < 0:
        raise ValueError("--posterior_std must be >= 0 (0 keeps the encoder's variance)")
    if loss_args.loss_balancing == "gradnorm" and loss_args.learn_logvar:
        raise ValueError("--learn_logvar has no effect under --loss_balancing gradnorm (the nll is not used)")


def parse_arguments(
    argv: Optional[Sequence[str]] = None,
) -> Tuple[ModelArguments, DataArguments, LossArguments, VAETrainingArguments]:
    """Parse flags (or a single .json file of them) into the four argument dataclasses."""
    parser = VAEArgumentParser()
    if argv is not None and len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, loss_args, training_args = parser.parse_json_file(json_file=argv[0])
        with open(argv[0]) as handle:
            explicit = set(json.load(handle))
    else:
        model_args, data_args, loss_args, training_args = parser.parse_args_into_dataclasses(args=argv)
        explicit = flags_given(sys.argv[1:] if argv is None else argv)
    apply_recipe((model_args, data_args, loss_args, training_args), explicit)
    validate(model_args, data_args, loss_args)
    return model_args, data_args, loss_args, training_args
