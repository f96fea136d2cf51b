"""Command-line arguments shared by both entry points.

Four dataclasses, parsed together by PaddleNLP's `PdArgumentParser`, so that `train_vae_trainer.py`
and `train_vae_no_trainer.py` accept exactly the same flags with the same meaning:

- `ModelArguments`: which VAE to train, the discriminator, the LPIPS weights.
- `DataArguments`: the filelists and image preprocessing.
- `LossArguments`: the weights and kinds of every loss term.
- `VAETrainingArguments`: PaddleNLP's `TrainingArguments` (output dir, batch size, LR, steps, saving,
  seed, device, report_to, fp16/bf16, recompute, ...) with defaults suited to VAE training plus
  our own run-time options (EMA, image logging, discriminator LR).

`parse_arguments` applies a `--recipe` preset (recipes.py) to every Model/Loss field the user did not
give explicitly, then `validate`s.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from paddlenlp.trainer import PdArgumentParser, TrainingArguments

from .recipes import apply_recipe, flags_given

DISC_LOSSES = ("hinge", "vanilla")
GEN_LOSSES = ("hinge", "vanilla", "relative_hinge")
PIXEL_LOSSES = ("l1", "l2")
PIXEL_LOSS_MASKS = ("none", "lowpass")
LOSS_BALANCING = ("none", "gradnorm")
GRADNORM_SCOPES = ("sample", "global")
DISC_TYPES = ("patch", "vgg")


@dataclass
class ModelArguments:
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
                          "a number. Default: keep when fine-tuning --pretrained_model_name_or_path with its encoder "
                          "loaded, measure otherwise."},
    )
    discriminator_path: Optional[str] = field(
        default=None,
        metadata={"help": "Start the discriminator from an earlier run's OUTPUT_DIR/discriminator (or a checkpoint-N "
                          "folder); its type and norm must match --disc_type/--disc_norm/--disc_num_layers/"
                          "--disc_base_channels."},
    )
    disc_type: str = field(
        default="patch",
        metadata={"help": "Discriminator type: 'patch' (PatchGAN) or 'vgg' (frozen ImageNet VGG16 features from "
                          "--lpips_weights with a trained conv head per stage; --disc_base_channels = head width)."},
    )
    disc_norm: str = field(
        default="batch", metadata={"help": "PatchGAN normalisation: batch, group, spectral_group or none."}
    )
    disc_num_layers: int = field(default=3, metadata={"help": "Number of strided layers of the PatchGAN."})
    disc_base_channels: int = field(default=64, metadata={"help": "Channels of the first PatchGAN layer."})
    lpips_weights: Optional[str] = field(
        default=None,
        metadata={"help": "LPIPS VGG16 weights (.pdparams). Default: weights/lpips_vgg16.pdparams made by `make setup`."},
    )
    posterior_std: float = field(
        default=0.0,
        metadata={"help": "Constant variance: if > 0, ignore the encoder's log-variance and sample z = mean + "
                          "posterior_std * noise (pair with --kl_weight 0 and --latent_penalty_weight). 0: off."},
    )


@dataclass
class DataArguments:
    file_list: Optional[str] = field(
        default=None, metadata={"help": "Training data: a .filelist.list (weighted filelists) or a single .filelist."}
    )
    resolution: int = field(default=256, metadata={"help": "Training crop size in pixels."})
    image_column: int = field(default=2, metadata={"help": "0-based tab-separated column that holds the base64 image."})
    random_flip: bool = field(default=True, metadata={"help": "Randomly flip training images horizontally."})
    random_crop: bool = field(default=True, metadata={"help": "Random crop for training (centre crop if false)."})
    min_image_size: int = field(default=32, metadata={"help": "Skip images whose shorter side is below this."})
    eval_file_list: Optional[str] = field(
        default=None, metadata={"help": "Held-out filelist or image folder for evaluation during training."}
    )
    eval_num_images: int = field(default=64, metadata={"help": "Number of held-out images evaluated per evaluation."})
    latent_stats_num_images: Optional[int] = field(
        default=None,
        metadata={"help": "Images (from --eval_file_list, else --file_list) over which the latent statistics and a "
                          "measured scaling factor are computed at export (default: --eval_num_images; the last "
                          "evaluation is reused when it covered the same images with the same weights)."},
    )
    inception_weights: Optional[str] = field(
        default=None,
        metadata={"help": "FID InceptionV3 weights (.pdparams, scripts/convert_inception_weights.py) to add rFID to evaluations."},
    )


@dataclass
class LossArguments:
    pixel_loss: str = field(default="l1", metadata={"help": "Pixel reconstruction loss: l1 or l2."})
    perceptual_weight: float = field(default=1.0, metadata={"help": "Weight of the LPIPS term (0 disables LPIPS)."})
    kl_weight: float = field(default=1e-6, metadata={"help": "Weight of the KL term (LDM meaning, see README)."})
    disc_weight: float = field(default=0.5, metadata={"help": "Weight of the adversarial term (0 disables the GAN)."})
    disc_start: int = field(default=50001, metadata={"help": "Optimizer step at which the GAN terms switch on."})
    disc_loss: str = field(default="hinge", metadata={"help": "Discriminator loss: hinge or vanilla."})
    adaptive_disc_weight: bool = field(
        default=True, metadata={"help": "Scale the GAN term by ||grad rec|| / ||grad gan|| at the decoder's last layer."}
    )
    learn_logvar: bool = field(
        default=False, metadata={"help": "Learn the output log-variance of the LDM nll (optimized with the VAE)."}
    )
    logvar_init: float = field(default=0.0, metadata={"help": "Initial value of the output log-variance."})
    sample_posterior: bool = field(
        default=True, metadata={"help": "Decode a posterior sample (true) or the posterior mean (false) in training."}
    )
    recipe: Optional[str] = field(
        default=None,
        metadata={"help": "Preset of the flags below: 'ldm' or 'balanced' (see docs/techniques.md). "
                          "Flags given explicitly on the command line win over the recipe."},
    )
    pixel_weight: float = field(default=1.0, metadata={"help": "Weight of the pixel term."})
    pixel_loss_pool: int = field(
        default=1, metadata={"help": "Take the pixel loss between KxK area-downsampled images (1: full resolution)."}
    )
    pixel_loss_mask: str = field(
        default="none", metadata={"help": "'lowpass': apply the pixel loss only where the input image is smooth."}
    )
    pixel_loss_mask_threshold: float = field(
        default=0.5, metadata={"help": "Low-pass mask: keep pixels whose inverted, normalised edge energy is >= this."}
    )
    latent_penalty_weight: float = field(
        default=0.0, metadata={"help": "Weight of mean(z_mean^2), the latent-magnitude penalty (for --posterior_std)."}
    )
    loss_balancing: str = field(
        default="none",
        metadata={"help": "'gradnorm': every branch's gradient into the reconstruction is rescaled to norm = its "
                          "weight (pixel_weight, perceptual_weight, disc_weight); replaces the adaptive weight."},
    )
    gradnorm_scope: str = field(
        default="sample", metadata={"help": "gradnorm: normalise per 'sample' or over the 'global' batch (all ranks)."}
    )
    gen_loss: Optional[str] = field(
        default=None,
        metadata={"help": "Generator's GAN loss: hinge, vanilla or relative_hinge (default: same as --disc_loss)."},
    )
    relative_hinge_margin: float = field(
        default=0.1, metadata={"help": "relative_hinge: loss = mean(relu(D(x) - D(x_hat) - margin))."}
    )
    lecam_weight: float = field(default=0.0, metadata={"help": "Weight of the LeCAM regulariser of the discriminator."})
    lecam_decay: float = field(default=0.99, metadata={"help": "EMA decay of LeCAM's D(real) and D(fake) means."})


@dataclass
class VAETrainingArguments(TrainingArguments):
    """PaddleNLP's TrainingArguments with VAE-friendly defaults and our extra options."""

    output_dir: str = field(default="outputs/vae", metadata={"help": "Where checkpoints, logs and the VAE go."})
    learning_rate: float = field(default=1e-4, metadata={"help": "Peak learning rate of the VAE optimizer."})
    adam_beta1: float = field(default=0.5, metadata={"help": "AdamW beta1 (LDM uses 0.5)."})
    adam_beta2: float = field(default=0.9, metadata={"help": "AdamW beta2 (LDM uses 0.9)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Global-norm gradient clipping (0 disables)."})
    lr_scheduler_type: str = field(
        default="constant_with_warmup",
        metadata={"help": "linear, cosine, constant, constant_with_warmup or polynomial (both optimizers)."},
    )
    logging_dir: Optional[str] = field(default=None, metadata={"help": "VisualDL log folder (default OUTPUT_DIR/logs)."})
    logging_steps: int = field(default=10, metadata={"help": "Log scalars every N optimizer steps."})
    save_steps: int = field(default=1000, metadata={"help": "Save checkpoint-N every N optimizer steps."})
    report_to: Optional[List[str]] = field(
        default_factory=lambda: ["visualdl"], metadata={"help": "'visualdl' or 'none'."}
    )
    disc_learning_rate: Optional[float] = field(
        default=None, metadata={"help": "Peak learning rate of the discriminator (default: --learning_rate)."}
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
        # Checked before PaddleNLP normalises them: our drivers implement data parallelism only.
        if self.sharding or max(self.tensor_parallel_degree, self.pipeline_parallel_degree, self.sep_parallel_degree) > 1:
            raise ValueError("only data parallelism is supported: drop --sharding and the *_parallel_degree flags.")
        if self.do_eval or str(self.evaluation_strategy) not in ("no", "IntervalStrategy.NO") or self.load_best_model_at_end:
            raise ValueError("evaluation is ours: use --eval_file_list with --eval_steps (and --metric_for_best_model), "
                             "not --do_eval / --evaluation_strategy / --load_best_model_at_end.")
        if self.logging_dir is None:  # a fixed place users and tests can find, not a dated folder
            self.logging_dir = os.path.join(self.output_dir, "logs")
        super().__post_init__()
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("--max_steps must be set: the training stream is infinite.")


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)


def validate(model_args: ModelArguments, data_args: DataArguments, loss_args: LossArguments) -> None:
    """Reject contradictory or unknown choices before anything expensive is built."""
    _validate_vae_source(model_args)
    if data_args.file_list is None:
        raise ValueError("--file_list is required (a .filelist.list or .filelist).")
    if loss_args.pixel_loss not in PIXEL_LOSSES:
        raise ValueError(f"--pixel_loss must be one of {PIXEL_LOSSES}, got {loss_args.pixel_loss!r}")
    if loss_args.disc_loss not in DISC_LOSSES:
        raise ValueError(f"--disc_loss must be one of {DISC_LOSSES}, got {loss_args.disc_loss!r}")
    _validate_techniques(model_args, loss_args)


def _validate_vae_source(model_args: ModelArguments) -> None:
    """Which VAE, loaded how (models/vae.py): the fine-tuning flags of docs and README "Fine-tune"."""
    if not (model_args.vae_config_file or model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("Give the VAE: --vae_config_file (train from scratch) and/or --pretrained_model_name_or_path "
                         "(fine-tune), or --init_from_ckpt CHECKPOINT_DIR.")
    if model_args.ignore_keys and not (model_args.pretrained_model_name_or_path or model_args.init_from_ckpt):
        raise ValueError("--ignore_keys needs --pretrained_model_name_or_path or --init_from_ckpt (weights to skip).")
    if model_args.input_size is not None and (len(model_args.input_size) != 2 or min(model_args.input_size) < 1):
        raise ValueError(f"--input_size takes two positive numbers H W, got {model_args.input_size}")
    from .latent_scale import scaling_factor_mode

    scaling_factor_mode(model_args)  # raises on a bad --scaling_factor


def _check_choice(flag: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"--{flag} must be one of {choices}, got {value!r}")


def _validate_techniques(model_args: ModelArguments, loss_args: LossArguments) -> None:
    """The options of docs/techniques.md."""
    _check_choice("disc_type", model_args.disc_type, DISC_TYPES)
    _check_choice("pixel_loss_mask", loss_args.pixel_loss_mask, PIXEL_LOSS_MASKS)
    _check_choice("loss_balancing", loss_args.loss_balancing, LOSS_BALANCING)
    _check_choice("gradnorm_scope", loss_args.gradnorm_scope, GRADNORM_SCOPES)
    if loss_args.gen_loss is not None:
        _check_choice("gen_loss", loss_args.gen_loss, GEN_LOSSES)
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
    parser = PdArgumentParser(ALL_ARGUMENT_CLASSES)
    parser.allow_abbrev = False  # an abbreviated flag would not be recognised as explicit by the recipes
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
