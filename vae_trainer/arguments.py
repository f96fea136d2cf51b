"""Command-line arguments shared by both entry points.

Four dataclasses, parsed together by PaddleNLP's `PdArgumentParser`, so that `train_vae_trainer.py`
and `train_vae_no_trainer.py` accept exactly the same flags with the same meaning:

- `ModelArguments`: which VAE to train, the discriminator, the LPIPS weights.
- `DataArguments`: the filelists and image preprocessing.
- `LossArguments`: the weights and kinds of every loss term.
- `VAETrainingArguments`: PaddleNLP's `TrainingArguments` (output dir, batch size, LR, steps, saving,
  seed, device, report_to, fp16/bf16, recompute, ...) with defaults suited to VAE training plus
  our own run-time options (EMA, image logging, discriminator LR).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from paddlenlp.trainer import PdArgumentParser, TrainingArguments

DISC_LOSSES = ("hinge", "vanilla")
PIXEL_LOSSES = ("l1", "l2")


@dataclass
class ModelArguments:
    vae_config_file: Optional[str] = field(
        default=None,
        metadata={"help": "AutoencoderKL config JSON (ppdiffusers format) to train from scratch, e.g. configs/vae_tiny.json."},
    )
    pretrained_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local folder of a pretrained AutoencoderKL (or a pipeline with --subfolder vae)."}
    )
    subfolder: Optional[str] = field(
        default=None, metadata={"help": "Subfolder of --pretrained_model_name_or_path that holds the VAE, e.g. 'vae'."}
    )
    disc_type: str = field(default="patch", metadata={"help": "Discriminator type: 'patch' (PatchGAN)."})
    disc_norm: str = field(
        default="batch", metadata={"help": "PatchGAN normalisation: batch, group, spectral_group or none."}
    )
    disc_num_layers: int = field(default=3, metadata={"help": "Number of strided layers of the PatchGAN."})
    disc_base_channels: int = field(default=64, metadata={"help": "Channels of the first PatchGAN layer."})
    lpips_weights: Optional[str] = field(
        default=None,
        metadata={"help": "LPIPS VGG16 weights (.pdparams). Default: weights/lpips_vgg16.pdparams made by `make setup`."},
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
    image_logging_steps: int = field(
        default=200, metadata={"help": "Log a grid of inputs and reconstructions every N steps (0 disables)."}
    )
    num_logged_images: int = field(default=4, metadata={"help": "Images in each logged reconstruction grid."})

    def __post_init__(self):
        if self.logging_dir is None:  # a fixed place users and tests can find, not a dated folder
            self.logging_dir = os.path.join(self.output_dir, "logs")
        super().__post_init__()
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("--max_steps must be set: the training stream is infinite.")


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, LossArguments, VAETrainingArguments)


def validate(model_args: ModelArguments, data_args: DataArguments, loss_args: LossArguments) -> None:
    """Reject contradictory or unknown choices before anything expensive is built."""
    if (model_args.vae_config_file is None) == (model_args.pretrained_model_name_or_path is None):
        raise ValueError("Give exactly one of --vae_config_file and --pretrained_model_name_or_path.")
    if data_args.file_list is None:
        raise ValueError("--file_list is required (a .filelist.list or .filelist).")
    if loss_args.pixel_loss not in PIXEL_LOSSES:
        raise ValueError(f"--pixel_loss must be one of {PIXEL_LOSSES}, got {loss_args.pixel_loss!r}")
    if loss_args.disc_loss not in DISC_LOSSES:
        raise ValueError(f"--disc_loss must be one of {DISC_LOSSES}, got {loss_args.disc_loss!r}")


def parse_arguments(
    argv: Optional[Sequence[str]] = None,
) -> Tuple[ModelArguments, DataArguments, LossArguments, VAETrainingArguments]:
    """Parse flags (or a single .json file of them) into the four argument dataclasses."""
    parser = PdArgumentParser(ALL_ARGUMENT_CLASSES)
    if argv is not None and len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, loss_args, training_args = parser.parse_json_file(json_file=argv[0])
    else:
        model_args, data_args, loss_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    validate(model_args, data_args, loss_args)
    return model_args, data_args, loss_args, training_args
