"""Every flag of both entry points, declared once: four dataclasses that argument_parser.py parses together.

A field is a flag: type (a `Literal` gives its choices), default, one line of --help, and its --help group
(its dataclass's `_group`, else training, unless `flag(..., group=...)`). Also the inherited PaddleNLP flags both
drivers honour, the ppdiffusers scripts' spellings, the --recipe presets and the refusals of PaddleNLP's flags; the
other refusals sit beside what they guard (argument_parser.REFUSALS gathers them).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from paddlenlp.trainer import TrainingArguments
from paddlenlp.trainer.trainer_utils import SchedulerType

from .checkpoint import resume_requested
from .distributed import world_size
from .objectives.equivariance import DEFAULT_TRANSFORMS
from .refusals import refuse
from .metrics import HIGHER_IS_BETTER
from .models.discriminator import NORM_TYPES
from .models.dinov2 import INPUT_CONVENTIONS
from .watchdog import DEFAULT_STALL_TIMEOUT, STALL_EXIT_CODE

# --recipe ldm: the LDM objective (taming-transformers' LPIPSWithDiscriminator), i.e. the flags' defaults, and LDM's
# GAN start too: its term at full weight at once (the default ramps it in: techniques.md, 14). Every recipe sets only
# the flags it lists; the others keep their defaults, LDM's, as it is.
RECIPES: Dict[str, Dict[str, Any]] = {
    "ldm": {"disc_weight_warmup_steps": 0},
    # Gradient-normalised branches + constant variance + low-pass pixel loss + VGG16-feature discriminator.
    "balanced": {
        "disc_type": "vgg", "posterior_std": 0.1, "loss_balancing": "gradnorm", "gradnorm_scope": "global",
        "disc_weight": 0.1,  # adversarial gradient norm, relative to pixel and LPIPS at 1.0
        "kl_weight": 0.0, "latent_penalty_weight": 1e-3, "pixel_loss_mask": "lowpass",
    },
    # Distilling a tiny autoencoder (--teacher_model_name_or_path: its default): the decoder learns from a
    # latent-conditioned PatchGAN at a fixed weight, a faint MSE between 8x8-pooled images and LPIPS at 0.1 (it won
    # the measurement of docs/distillation.md, "The recipe").
    "tiny": {"pixel_loss": "l2", "pixel_loss_pool": 8, "perceptual_weight": 0.1, "disc_weight": 0.1,
             "adaptive_disc_weight": False, "disc_start": 0, "disc_weight_warmup_steps": 0, "sample_posterior": False,
             "disc_replay_size": 50},
}


def flag(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field that is a flag (`metadata`: e.g. "group", its --help group; "parse", its value's check)."""
    value = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(**value, metadata={"help": help, **metadata})


def device_name(value: str) -> str:
    """--device: cpu, gpu (each process uses the GPU its launcher gave it) or gpu:N (a single process)."""
    if not isinstance(value, str) or not re.fullmatch(r"cpu|gpu(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from cpu, gpu, gpu:N)")
    return value


@dataclass
class ModelArguments:
    _group = "model"

    vae_config_file: Optional[str] = flag(None, "VAE config JSON to train from scratch (configs/*.json; its "
                                                "_class_name: any family of vae_trainer/models/families/, "
                                                "docs/fine-tuning.md).")
    rae_encoder_path: Optional[str] = flag(None, "An RAE from scratch: its frozen DINOv2 (transformers folder, "
                                                 "timm / torch-hub file); widths, patch and depth come from it.")
    noise_tau: Optional[float] = flag(None, "An RAE: training noise on the encoder's tokens, std ~ U(0, tau) "
                                            "per image (RAE: 0.8; default the config's noise_tau).")
    pretrained_model_name_or_path: Optional[str] = flag(
        None, "Local VAE to fine-tune: a ppdiffusers/diffusers folder, or an LDM single file (architecture inferred, "
              "SD's 0.18215 assumed; else --vae_config_file / --scaling_factor). docs/fine-tuning.md.")
    subfolder: Optional[str] = flag(None, "Subfolder of --pretrained_model_name_or_path holding the VAE ('vae').")
    ignore_keys: Optional[List[str]] = flag(None, "Weight-name prefixes not loaded (re-initialised), e.g. decoder.")
    init_from_ckpt: Optional[str] = flag(None, "VAE weights only, from a checkpoint-N or a weight file.")
    freeze_encoder: bool = flag(False, "Freeze the encoder (all that defines the latent): decoder-only fine-tuning.")
    expand_to_rgba: bool = flag(False, "Grow the loaded RGB VAE to RGBA (4 channels in and out) before training: at "
                                       "step 0 opaque images give the source's latents and RGB.")
    trainable_modules: Optional[List[str]] = flag(
        None, "Glob patterns of the VAE's parameter names that train, e.g. 'decoder.*' or 'encoder.conv_out.*' "
              "'decoder.conv_in.*'; every other weight stays as loaded (exported bit-identical).")
    input_size: Optional[List[int]] = flag(None, "H W: the encoder's input size (the loss sees --resolution).")
    scaling_factor: Optional[str] = flag(
        None, "Exported latent scale: keep, measure or a number. Default: keep when the encoder's weights are "
              "loaded (and not re-initialised by --ignore_keys), measure otherwise.")
    discriminator_path: Optional[str] = flag(None, "A trained discriminator to start from.", group="discriminator")
    disc_type: Literal["patch", "patchgan3d", "vgg", "dino"] = flag(
        "patch", "PatchGAN, a 3-D PatchGAN over clips, frozen VGG16 features, or RAE's heads on a frozen DINO ViT-S/8 "
                 "(2-D ones score a clip frame by frame).", group="discriminator")
    disc_backbone_path: Optional[str] = flag(None, "--disc_type dino: the DINO ViT-S/8 (dino_vits8 state dict or a "
                                                   "transformers ViTModel folder).", group="discriminator")
    disc_norm: Literal[NORM_TYPES] = flag("batch", "PatchGAN normalisation.", group="discriminator")
    disc_num_layers: int = flag(3, "Number of strided layers of the PatchGAN.", group="discriminator")
    disc_base_channels: int = flag(64, "Channels of the first PatchGAN layer.", group="discriminator")
    lpips_weights: Optional[str] = flag(None, "LPIPS VGG16 weights (.pdparams).", group="loss")
    vf_model_path: Optional[str] = flag(None, "VA-VAE: a DINOv2 to align the latents with.", group="loss")
    vf_input_convention: Literal[INPUT_CONVENTIONS] = flag(
        "imagenet", "VA-VAE: what DINOv2 sees, resized to 224 px: imagenet ([0, 1], ImageNet mean and std, as DINOv2 "
                    "was trained) or vavae (VA-VAE's: [-1, 1], not normalised). docs/techniques.md, 12.", group="loss")
    posterior_std: float = flag(0.0, "If > 0: sample z = mean + posterior_std * noise (constant variance).")
    teacher_model_name_or_path: Optional[str] = flag(
        None, "Distil a tiny student autoencoder from this VAE folder, in the normalised latent space its "
              "pipelines use; the student is OUTPUT_DIR/vae. docs/distillation.md.", group="distillation")
    teacher_subfolder: Optional[str] = flag(None, "Subfolder of the teacher holding its VAE ('vae').",
                                            group="distillation")
    cache_teacher_latents: Optional[str] = flag(None, "Folder keeping the teacher's latents of each crop seen, read "
                                                      "back when the same crop returns.", group="distillation")
    student_width: int = flag(64, "Channels of every stage of a student built from the teacher's geometry.",
                              group="distillation")
    student_depth: int = flag(3, "Blocks per stage of that student (TAESD: 3).", group="distillation")


@dataclass
class DataArguments:
    _group = "data"

    file_list: Optional[str] = flag(None, "Training data: a filelist, an image folder or tar shards (docs/data.md).")
    resolution: int = flag(256, "Training crop size in pixels (and evaluation crop size).")
    image_column: int = flag(2, "0-based tab-separated column that holds the base64 image.")
    random_flip: bool = flag(True, "Randomly flip training images horizontally.")
    random_crop: bool = flag(True, "Random crop for training (centre crop if false).")
    min_image_size: int = flag(32, "Skip images whose shorter side is below this.")
    aspect_ratio_buckets: bool = flag(False, "Crop to the bucket of nearest aspect ratio (1:2 to 2:1, sides multiples "
                                             "of 8, about resolution^2 pixels), not a square; a batch holds one shape.")
    shuffle_buffer_size: int = flag(1000, "Training records shuffled together per loader worker.")
    num_frames: int = flag(1, "Frames per training clip (1: images). > 1: video files are read as clips of N frames, "
                              "a random window (Wan / Qwen-Image VAEs: 1 + 4k). docs/data.md, \"Clips\".")
    frame_stride: int = flag(1, "Take every K-th frame of a clip's window.")
    video_image_ratio: float = flag(0.0, "With clips: the share of training samples that are single frames (an "
                                         "image is a one-frame clip; Open-Sora 2.0: 0.2), so image quality is kept.")
    eval_file_list: Optional[str] = flag(None, "Held-out filelist or image folder.", group="evaluation")
    eval_num_images: int = flag(64, "Number of held-out images evaluated per evaluation.", group="evaluation")
    latent_stats_num_images: Optional[int] = flag(None, "Images of a measured scale (default: --eval_num_images).")
    inception_weights: Optional[str] = flag(None, "FID InceptionV3 weights: adds rFID.", group="evaluation")
    eval_tiled: bool = flag(False, "Tiled encode/decode of large images.", group="evaluation")
    eval_tile_size: Optional[int] = flag(None, "Tile size for --eval_tiled (default 512; a multiple of 4 x the "
                                         "downsampling factor); tiles overlap by a quarter.", group="evaluation")


@dataclass
class LossArguments:
    _group = "loss"

    pixel_loss: Literal["l1", "l2"] = flag("l1", "Pixel reconstruction loss.")
    perceptual_weight: float = flag(1.0, "Weight of the LPIPS term (0 disables LPIPS).")
    kl_weight: float = flag(1e-6, "Weight of the KL term (LDM meaning, see README).")
    disc_weight: float = flag(0.5, "Weight of the adversarial term (0 disables the GAN).", group="discriminator")
    disc_start: int = flag(50001, "Optimizer step at which the GAN terms switch on.", group="discriminator")
    disc_update_start: Optional[int] = flag(None, "Step at which the discriminator starts training, at or before "
                                                  "--disc_start (default: --disc_start).", group="discriminator")
    disc_weight_warmup_steps: int = flag(1000, "The GAN weight rises linearly from 0 to --disc_weight over this many "
                                               "steps from --disc_start, while a new discriminator learns (0: at once, "
                                               "LDM's). docs/techniques.md, 14.", group="discriminator")
    disc_loss: Literal["hinge", "vanilla"] = flag("hinge", "Discriminator loss.", group="discriminator")
    adaptive_disc_weight: bool = flag(True, "Scale the GAN term by ||grad rec|| / ||grad gan||.", group="discriminator")
    adaptive_disc_weight_max: Optional[float] = flag(None, "Clamp of that ratio, our (mean) loss units (default: LDM's "
                                                           "1e4 / pixel values; RAE: 1e4).", group="discriminator")
    learn_logvar: bool = flag(False, "Learn the output log-variance of the LDM nll (optimized with the VAE).")
    logvar_init: float = flag(0.0, "Initial value of the output log-variance.")
    sample_posterior: bool = flag(True, "Decode a posterior sample (true) or the posterior mean (false) in training.")
    recipe: Optional[Literal[tuple(RECIPES)]] = flag(None, "Preset of the technique flags; flags given win.")
    pixel_weight: float = flag(1.0, "Weight of the pixel term.")
    pixel_loss_pool: int = flag(1, "Take the pixel loss between KxK area-downsampled images (1: full resolution).")
    pixel_loss_mask: Literal["none", "lowpass"] = flag("none", "'lowpass': only where the image is smooth.")
    pixel_loss_mask_threshold: float = flag(0.5, "Low-pass mask: keep pixels whose smoothness is >= this.")
    latent_penalty_weight: float = flag(0.0, "Weight of mean(z_mean^2), the latent-magnitude penalty.")
    loss_balancing: Literal["none", "gradnorm"] = flag("none", "'gradnorm': each branch's gradient norm = its weight.")
    gradnorm_scope: Literal["sample", "global"] = flag("sample", "gradnorm: per sample or over the global batch.")
    gen_loss: Optional[Literal["hinge", "vanilla", "relative_hinge"]] = flag(
        None, "Generator's GAN loss (default: the same as --disc_loss).", group="discriminator")
    relative_hinge_margin: float = flag(0.1, "Margin of --gen_loss relative_hinge.", group="discriminator")
    lecam_weight: float = flag(0.0, "Weight of the LeCAM regulariser of the discriminator.", group="discriminator")
    disc_replay_size: int = flag(0, "Past reconstructions held per device and shown to the discriminator in place of "
                                    "new ones at random, half the time once full (0: off).", group="discriminator")
    lecam_decay: float = flag(0.99, "EMA decay of LeCAM's D(real) and D(fake) means.", group="discriminator")
    equivariance_prob: float = flag(0.0, "EQ-VAE: probability of a transformed micro-batch (0: off).")
    equivariance_min_scale: float = flag(0.25, "EQ-VAE: the smallest downscale factor s, drawn from [s, 1).")
    equivariance_transforms: str = flag(DEFAULT_TRANSFORMS, "EQ-VAE: comma-separated scale, rotate.")
    vf_weight: float = flag(0.5, "VA-VAE: weight of the VF loss (0 = off: the model serves the diagnostic only).")
    distmat_margin: float = flag(0.0, "VA-VAE: margin m1 of the VF loss's distance-matrix term.")
    cos_margin: float = flag(0.0, "VA-VAE: margin m2 of the VF loss's cosine term.")
    adaptive_vf: bool = flag(True, "VA-VAE: scale the VF loss by ||grad nll|| / ||grad vf||.")
    temporal_loss_weight: float = flag(0.0, "Clips: weight of the L1 between the frame differences of input and "
                                            "reconstruction (against flicker; 0: off).")
    latent_distill_weight: float = flag(1.0, "Distillation: weight of the student encoder's error against the "
                                             "teacher's latents (0: the encoder is not trained).", group="distillation")
    latent_distill_loss: Literal["l2", "l1"] = flag("l2", "Distillation: that error, MSE or L1.", group="distillation")
    lpips_num_frames: int = flag(0, "Clips: LPIPS on K frames of each clip, drawn from (seed, step, micro-batch) (0: "
                                    "every frame).")


@dataclass
class VAETrainingArguments(TrainingArguments):
    """PaddleNLP's TrainingArguments with VAE-friendly defaults and our extra options (--help group: training)."""

    output_dir: str = flag("outputs/vae", "Where checkpoints, logs and the VAE go.")
    overwrite_output_dir: bool = flag(False, "Start a new run in an --output_dir of an earlier run: delete its "
                                             "checkpoints, logs and exports first (else refused).")
    max_steps: int = flag(-1, "Optimizer steps to train (required: the training stream is infinite).")
    resume_from_checkpoint: Optional[str] = flag(
        None, "'latest' (the newest complete checkpoint, if any) or a checkpoint-N folder: continue exactly.")
    recompute: bool = flag(False, "Gradient checkpointing of the VAE (less memory, more compute).")
    stall_timeout: float = flag(
        DEFAULT_STALL_TIMEOUT, f"Seconds without a step, eval batch or save on any rank (start-up included): report, "
                               f"exit {STALL_EXIT_CODE}. 0: off. Pick it above your slowest save.")
    device: str = flag("gpu", "cpu, gpu (each launched process on its own GPU) or gpu:N (one process).",
                       parse=device_name, metavar="{cpu,gpu,gpu:N}")
    learning_rate: float = flag(1e-4, "Peak learning rate of the VAE optimizer.")
    adam_beta1: float = flag(0.5, "AdamW beta1 (LDM uses 0.5).")
    adam_beta2: float = flag(0.9, "AdamW beta2 (LDM uses 0.9).")
    weight_decay: float = flag(0.0, "AdamW decoupled weight decay (not applied to biases and norm weights).")
    max_grad_norm: float = flag(1.0, "Global-norm gradient clipping (0 disables).")
    lr_scheduler_type: Literal[tuple(s.value for s in SchedulerType)] = flag(
        "constant_with_warmup", "LR schedule of both optimizers (PaddleNLP's get_scheduler; warm-up --warmup_steps).")
    fp16_opt_level: Literal["O1", "O2"] = flag("O1", "O1: autocast; O2: half weights, float32 masters (GPU).")
    logging_dir: Optional[str] = flag(None, "VisualDL log folder, relative to --output_dir (default logs).")
    logging_steps: int = flag(10, "Log scalars every N optimizer steps.")
    save_steps: int = flag(1000, "Save checkpoint-N every N optimizer steps (0: only at the end).")
    report_to: Optional[List[Literal["visualdl", "none"]]] = flag(["visualdl"], "Write VisualDL logs, or none.")
    eval_steps: Optional[int] = flag(None, "Evaluate every N steps and at the end.", group="evaluation")
    per_device_eval_batch_size: Optional[int] = flag(
        None, "Evaluation and latent-measurement batch per device (default: training's); results do not depend on it.")
    metric_for_best_model: Optional[Literal[tuple(HIGHER_IS_BETTER)]] = flag(
        None, "Keep the checkpoint with the best value of this evaluation metric.", group="evaluation")
    disc_learning_rate: Optional[float] = flag(None, "Discriminator LR (default: the VAE's).", group="discriminator")
    scale_lr: bool = flag(False, "Multiply the learning rates by the global batch (LDM's rule).")
    image_logging_steps: int = flag(200, "Log a grid of inputs and reconstructions every N steps (0 disables).")
    num_logged_images: int = flag(4, "Images in each logged reconstruction grid.")
    use_ema: bool = flag(False, "Keep an EMA of the VAE weights; export it as OUTPUT_DIR/vae.")
    ema_decay: float = flag(0.9999, "EMA decay; warm-up: min(ema_decay, (1 + t) / (10 + t)) at step t.")
    max_consecutive_nonfinite_steps: int = flag(5, "Save and stop after N non-finite steps in a row.")
    max_consecutive_overflow_steps: int = flag(25, "fp16: save and stop after N overflowing steps in a row.")
    min_loss_scale: float = flag(1.0, "fp16: the dynamic loss scale is never lowered below this.")
    do_train: bool = flag(False, "Accepted and ignored (the ppdiffusers commands pass it): both entry points always "
                                 "train.")

    def __post_init__(self):
        # Refused by value (from code and JSON too), before PaddleNLP normalises the values compared.
        given = {name for name, default in UNSUPPORTED_FLAGS.items() if getattr(self, name) != default}
        unnamed = tuple(sorted(given - {name for names in INHERITED_REFUSALS for name in names}))
        rows = {**INHERITED_REFUSALS, unnamed: "not honoured the same way by both entry points"}
        refuse(self, given, tuple((names, lambda f: True, why) for names, why in rows.items()),
               header="refused PaddleNLP flag(s); both entry points honour only the PaddleNLP flags --help lists")
        self.logging_dir = os.path.join(self.output_dir, self.logging_dir or "logs")  # as in the ppdiffusers scripts
        try:
            device_name(self.device)  # from a JSON file or code, checked like the flag
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--device: {error}") from None
        if self.device.startswith("gpu:") and world_size() > 1:  # (the launcher's count: no process group yet)
            raise ValueError(f"--device {self.device} would put every process on that one GPU: under the launcher "
                             "use --device gpu (each process takes the GPU the launcher gave it, see --gpus).")
        if self.stall_timeout and self.stall_timeout > 0:
            # PaddleNLP forms the process group here, holding Python's lock so the stall watchdog cannot run:
            # faulthandler's C thread ends a rank that waits forever (stacks, exit 1).
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


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)

# PaddleNLP TrainingArguments that both drivers honour with the same meaning (read by our shared code): these, and
# each one VAETrainingArguments declares again with its own default and --help (--do_train: accepted and ignored).
PADDLENLP_FLAGS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "adam_epsilon", "warmup_steps", "warmup_ratio",
    "num_cycles", "lr_end", "power", "disable_tqdm", "save_total_limit", "seed", "dataloader_num_workers", "fp16",
    "bf16", "scale_loss",
} | {f.name for f in dataclasses.fields(TrainingArguments) if f.name in VAETrainingArguments.__annotations__})
# The refusals of PaddleNLP flags: flags -> why and what to do instead, checked by value in VAETrainingArguments
# (refusals.refuse). Flags that both drivers do not honour, refused for any value but PaddleNLP's default (any other
# inherited flag outside PADDLENLP_FLAGS is too: "not honoured the same way").
INHERITED_REFUSALS = {
    ("num_train_epochs",): "the training stream is infinite: set the run's length with --max_steps",
    ("save_strategy",): "checkpoints are saved every --save_steps optimizer steps (0: at the end)",
    ("logging_strategy", "logging_first_step"): "scalars are logged every --logging_steps steps",
    ("optim",): "the optimizer is AdamW in both drivers (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay)",
    ("greater_is_better",): "--metric_for_best_model decides it (psnr, ssim: higher is better; lpips, rfid: lower)",
    ("to_static",): "both drivers train in dynamic-graph mode",
    ("amp_master_grad",): "--fp16_opt_level O2 keeps float32 master weights in both optimizers",
    ("no_cuda",): "use --device cpu",
    ("do_eval", "do_predict", "evaluation_strategy", "load_best_model_at_end", "eval_accumulation_steps",
     "max_evaluate_steps", "prediction_loss_only"):
        "evaluation is the same code in both drivers: use --eval_file_list with --eval_steps (and "
        "--metric_for_best_model)",
    ("dataloader_drop_last",): "training batches are always full (the stream is infinite)",
    ("ignore_data_skip",): "the data stream always resumes at its saved position",
    ("run_name", "wandb_api_key"): "only VisualDL logs are written (--report_to visualdl|none)",
    ("sharding", "sharding_degree", "sharding_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
     "sep_parallel_degree", "data_parallel_config", "tensor_parallel_config", "pipeline_parallel_config",
     "sharding_parallel_config", "use_expert_parallel", "enable_auto_parallel"):
        "only data parallelism is supported (paddle.distributed.launch); drop it",
}
# Every other PaddleNLP flag -> its default (parsed, hidden in --help, refused for any other value).
UNSUPPORTED_FLAGS = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                     for f in dataclasses.fields(TrainingArguments) if f.init and f.name not in PADDLENLP_FLAGS}
# The ppdiffusers reference scripts' spellings -> our flag (README "Flags from the ppdiffusers scripts").
ALIASES = {"per_device_train_batch_size": ("train_batch_size", "batch_size"), "max_steps": ("max_train_steps",),
           "weight_decay": ("adam_weight_decay",), "lr_scheduler_type": ("lr_scheduler",),
           "warmup_steps": ("lr_warmup_steps",), "dataloader_num_workers": ("num_workers",),
           "recompute": ("gradient_checkpointing",)}  # recompute: diffusers' / ppdiffusers' trainers' name
