"""Our flags: the dataclasses both entry points share, what each field means, and its default.

The flag layer reads top-down, one direction of imports: argument_parser.py (`parse_arguments`: the parser,
--recipe, `validate`) imports this module (the fields) and flag_checks.py (the combinations refused, which
imports neither). Four dataclasses,
parsed together, so that `train_vae_trainer.py` and `train_vae_no_trainer.py` accept exactly the same
flags with the same meaning:

- `ModelArguments`: which VAE to train, the discriminator, the LPIPS weights.
- `DataArguments`: the filelists and image preprocessing (and the held-out images).
- `LossArguments`: the weights and kinds of every loss term.
- `VAETrainingArguments`: PaddleNLP's `TrainingArguments` with defaults suited to VAE training, plus our
  own run-time options (EMA, image logging, discriminator LR). Which inherited flags are honoured, and
  the reference scripts' aliases, is `flag_policy.py`; how fields become flags and --help groups,
  `argument_parser.py`.

Also the helpers a field's declaration and its checks use: `in_group` (its --help group), `literal_choices`
and `strip_optional` (a field's Literal values).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, get_args, get_origin

from paddlenlp.trainer import TrainingArguments
from paddlenlp.trainer.trainer_utils import SchedulerType

from .checkpoint import resume_requested
from .metrics import HIGHER_IS_BETTER
from .flag_policy import refuse_unsupported_flags
from .models.discriminator import NORM_TYPES
from .equivariance import DEFAULT_TRANSFORMS
from .recipes import RECIPES
from .watchdog import DEFAULT_STALL_TIMEOUT, STALL_EXIT_CODE

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


def in_group(group: str, help: str, **metadata: Any) -> Dict[str, Any]:
    """Field metadata placing a flag in a --help group other than its dataclass's."""
    return {"help": help, "group": group, **metadata}


def strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) is Union and type(None) in get_args(annotation):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def literal_choices(annotation: Any) -> Optional[Tuple[Any, ...]]:
    """The values of a (possibly Optional) Literal type, else None."""
    annotation = strip_optional(annotation)
    return get_args(annotation) if get_origin(annotation) is Literal else None


DEVICES = "cpu, gpu, gpu:N"
_DEVICE = re.compile(r"cpu|gpu(:\d+)?")


def device_name(value: str) -> str:
    """--device: cpu, gpu (each process uses the GPU its launcher gave it) or gpu:N (a single process)."""
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {DEVICES})")
    return value


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
                          "single-file checkpoint (.safetensors/.ckpt). A single file's architecture is inferred from its "
                          "tensors and SD's scaling_factor 0.18215 assumed; for another VAE give its config with "
                          "--vae_config_file (configs/sdxl_vae.json, configs/flux_vae.json) or, for SDXL's, "
                          "--scaling_factor 0.13025. With a folder, --vae_config_file "
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
        metadata=in_group("discriminator", "Start the discriminator from an earlier run's OUTPUT_DIR/discriminator (or a "
                                      "checkpoint-N folder); its type and norm must match --disc_type/--disc_norm/"
                                      "--disc_num_layers/--disc_base_channels."),
    )
    disc_type: DiscType = field(
        default="patch",
        metadata=in_group("discriminator", "'patch' (PatchGAN) or 'vgg' (frozen ImageNet VGG16 features from "
                                      "--lpips_weights with a trained conv head per stage; --disc_base_channels = head width)."),
    )
    disc_norm: DiscNorm = field(default="batch", metadata=in_group("discriminator", "PatchGAN normalisation."))
    disc_num_layers: int = field(default=3, metadata=in_group("discriminator", "Number of strided layers of the PatchGAN."))
    disc_base_channels: int = field(default=64, metadata=in_group("discriminator", "Channels of the first PatchGAN layer."))
    lpips_weights: Optional[str] = field(
        default=None,
        metadata=in_group("loss", "LPIPS VGG16 weights (.pdparams). Default: weights/lpips_vgg16.pdparams made by `make setup`."),
    )
    vf_model_path: Optional[str] = field(
        default=None,
        metadata=in_group("loss", "VA-VAE: a DINOv2 (transformers folder, or timm / torch-hub .safetensors/.pth/.bin) whose "
                          "patch tokens the latents are aligned with (VF loss), and vf_alignment_cka is measured "
                          "against in evaluations. docs/techniques.md."),
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
        default=None, metadata=in_group("evaluation", "Held-out filelist or image folder for evaluation during training.")
    )
    eval_num_images: int = field(
        default=64, metadata=in_group("evaluation", "Number of held-out images evaluated per evaluation.")
    )
    latent_stats_num_images: Optional[int] = field(
        default=None,
        metadata={"help": "Images (from --eval_file_list, else --file_list) over which the latent statistics and a "
                          "measured scaling factor are computed at export (default: --eval_num_images; the last "
                          "evaluation is reused when it covered the same images with the same weights)."},
    )
    inception_weights: Optional[str] = field(
        default=None,
        metadata=in_group("evaluation", "FID InceptionV3 weights (.pdparams, scripts/convert_inception_weights.py) "
                                   "to add rFID to evaluations."),
    )
    eval_tiled: bool = field(
        default=False,
        metadata=in_group("evaluation", "Evaluations and the export's latent measurement encode and decode images larger "
                                   "than --eval_tile_size tile by tile (ppdiffusers' tiled VAE; for 1024 px and "
                                   "larger). Training is never tiled; the protocol says when tiling was used."),
    )
    eval_tile_size: Optional[int] = field(
        default=None,
        metadata=in_group("evaluation", "Tile size in pixels for --eval_tiled (default 512; a multiple of 4 x the VAE's "
                                   "downsampling factor); tiles overlap by a quarter, blended."),
    )


@dataclass
class LossArguments:
    _group = "loss"

    pixel_loss: PixelLoss = field(default="l1", metadata={"help": "Pixel reconstruction loss."})
    perceptual_weight: float = field(default=1.0, metadata={"help": "Weight of the LPIPS term (0 disables LPIPS)."})
    kl_weight: float = field(default=1e-6, metadata={"help": "Weight of the KL term (LDM meaning, see README)."})
    disc_weight: float = field(
        default=0.5, metadata=in_group("discriminator", "Weight of the adversarial term (0 disables the GAN).")
    )
    disc_start: int = field(
        default=50001, metadata=in_group("discriminator", "Optimizer step at which the GAN terms switch on.")
    )
    disc_loss: DiscLoss = field(default="hinge", metadata=in_group("discriminator", "Discriminator loss."))
    adaptive_disc_weight: bool = field(
        default=True,
        metadata=in_group("discriminator", "Scale the GAN term by ||grad rec|| / ||grad gan|| at the decoder's last layer."),
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
        default=None, metadata=in_group("discriminator", "Generator's GAN loss (default: the same as --disc_loss).")
    )
    relative_hinge_margin: float = field(
        default=0.1, metadata=in_group("discriminator", "relative_hinge: loss = mean(relu(D(x) - D(x_hat) - margin)).")
    )
    lecam_weight: float = field(
        default=0.0, metadata=in_group("discriminator", "Weight of the LeCAM regulariser of the discriminator.")
    )
    lecam_decay: float = field(
        default=0.99, metadata=in_group("discriminator", "EMA decay of LeCAM's D(real) and D(fake) means.")
    )
    equivariance_prob: float = field(
        default=0.0,
        metadata={"help": "EQ-VAE: the probability that a micro-batch's pixel, LPIPS and adversarial terms compare "
                          "decode(tau(z)) with tau(x), tau a random scale or rotation (0 = off; EQ-VAE uses 0.5; the "
                          "KL stays on the clean latent). docs/techniques.md."},
    )
    equivariance_min_scale: float = field(
        default=0.25, metadata={"help": "EQ-VAE: the smallest downscale factor s, drawn from [s, 1)."}
    )
    equivariance_transforms: str = field(
        default=DEFAULT_TRANSFORMS,
        metadata={"help": "EQ-VAE: the transforms drawn from, comma-separated: scale, rotate (90/180/270 degrees)."},
    )
    vf_weight: float = field(
        default=0.5, metadata={"help": "VA-VAE: weight of the VF loss (0 = off: the model serves the diagnostic only)."}
    )
    distmat_margin: float = field(
        default=0.0, metadata={"help": "VA-VAE: margin m1 of the VF loss's distance-matrix term."}
    )
    cos_margin: float = field(default=0.0, metadata={"help": "VA-VAE: margin m2 of the VF loss's cosine term."})
    adaptive_vf: bool = field(
        default=True,
        metadata={"help": "VA-VAE: scale the VF loss by ||grad nll|| / ||grad vf|| at the encoder's last layer."},
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
    stall_timeout: float = field(
        default=DEFAULT_STALL_TIMEOUT,
        metadata=dict(help="Seconds without a finished training step, evaluation batch or save (on any rank, the "
                           "first batch's wait included) after which the run reports what each thread was doing and "
                           f"exits with {STALL_EXIT_CODE}, so the launcher stops it and a scheduler can requeue it. "
                           "0: off. Pick it above your slowest save or evaluation batch."),
    )
    device: str = field(
        default="gpu",
        metadata=dict(help="cpu, gpu (under paddle.distributed.launch each process uses the GPU it was given) or "
                           "gpu:N (one process on GPU N).", parse=device_name, metavar="{cpu,gpu,gpu:N}"),
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
        default=None, metadata=in_group("evaluation", "Evaluate every N optimizer steps and at the end (needs --eval_file_list).")
    )
    per_device_eval_batch_size: Optional[int] = field(
        default=None,
        metadata=dict(help="Batch per device of evaluations and of the export's latent measurement (default: "
                           "--per_device_train_batch_size, which fits at this --resolution; a step without "
                           "gradients needs less memory than a training step). Results do not depend on it."),
    )
    metric_for_best_model: Optional[EvalMetric] = field(
        default=None, metadata=in_group("evaluation", "Keep the checkpoint with the best value of this evaluation metric.")
    )
    disc_learning_rate: Optional[float] = field(
        default=None, metadata=in_group("discriminator", "Peak learning rate of the discriminator (default: --learning_rate).")
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
        _check_device(self.device)
        if self.stall_timeout and self.stall_timeout > 0:
            # PaddleNLP forms the process group here, holding Python's lock: the stall watchdog cannot run, and a rank
            # that never joins would be waited for forever. faulthandler's C thread ends this one (stacks, exit 1).
            faulthandler.dump_traceback_later(self.stall_timeout, exit=True, file=sys.__stderr__)  # (a real file)
        try:
            super().__post_init__()
        finally:
            faulthandler.cancel_dump_traceback_later()
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("--max_steps must be set: the training stream is infinite.")
        if self.overwrite_output_dir and resume_requested(self.resume_from_checkpoint):
            raise ValueError("--overwrite_output_dir deletes the checkpoints --resume_from_checkpoint would resume: "
                             "give one of them.")
        output_dir, logging_dir = os.path.abspath(self.output_dir), os.path.abspath(self.logging_dir)
        if os.path.commonpath([output_dir, logging_dir]) == logging_dir:
            raise ValueError(f"--logging_dir {self.logging_dir} is --output_dir or a folder that contains it: give a "
                             "folder of its own (default OUTPUT_DIR/logs; a relative path is inside --output_dir).")


def _check_device(device: str) -> None:
    """--device from a JSON file or code is checked like the flag; gpu:N would put every rank on one GPU."""
    try:
        device_name(device)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"--device: {error}") from None
    if device.startswith("gpu:") and int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1:
        raise ValueError(f"--device {device} would put every process on that one GPU: under the launcher use "
                         "--device gpu (each process takes the GPU the launcher gave it, see --gpus).")


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)
