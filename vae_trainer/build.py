"""Everything both drivers build the same way from the parsed arguments, in the same order.

Order matters for "same seed, same numbers": seed -> VAE -> discriminator -> container -> LPIPS, and
then `seed_training` right before the first step, after which the two drivers draw random numbers
identically (posterior samples) and read identical data.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import paddle
from paddlenlp.trainer.trainer_utils import set_seed

from .distributed import broadcast_parameters, init_distributed, rank, world_size
from .models.autoencoder_gan import VAEWithDiscriminator
from .models.discriminator import build_discriminator, convert_batchnorm_to_sync
from .models.lpips import LPIPS
from .models.vae import build_vae

logger = logging.getLogger("vae_trainer")


@dataclass
class Components:
    model: VAEWithDiscriminator
    lpips: Optional[LPIPS]
    discriminator_config: Dict[str, Any]


def setup_runtime(training_args) -> None:
    """Device, process group, CPU threads and readable logs."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    device = training_args.device
    paddle.set_device("gpu" if device.startswith("gpu") and world_size() > 1 else device)
    init_distributed()
    if device == "cpu" and "FLAGS_paddle_num_threads" not in os.environ:
        # Paddle's CPU default is one thread; with several ranks on one machine, share the cores.
        threads = max(1, (os.cpu_count() or 1) // max(int(os.environ.get("PADDLE_LOCAL_SIZE", world_size())), 1))
        paddle.set_flags({"FLAGS_paddle_num_threads": threads}) if hasattr(paddle, "set_flags") else None


def build_components(model_args, loss_args, training_args) -> Components:
    """The VAE (+ discriminator + log-variance) container and the frozen LPIPS, identical on every rank."""
    set_seed(training_args.seed)
    vae = build_vae(model_args.vae_config_file, model_args.pretrained_model_name_or_path, model_args.subfolder)
    if training_args.recompute:
        vae.enable_gradient_checkpointing()
    disc_config = {
        "disc_type": model_args.disc_type,
        "norm": model_args.disc_norm,
        "num_layers": model_args.disc_num_layers,
        "base_channels": model_args.disc_base_channels,
    }
    discriminator = build_discriminator(**disc_config)
    if world_size() > 1 and model_args.disc_norm == "batch":
        discriminator = convert_batchnorm_to_sync(discriminator)
    model = VAEWithDiscriminator(vae, discriminator, loss_args.logvar_init, loss_args.learn_logvar)
    broadcast_parameters(model)
    lpips = LPIPS(model_args.lpips_weights) if loss_args.perceptual_weight > 0 else None
    return Components(model=model, lpips=lpips, discriminator_config=disc_config)


def seed_training(seed: int) -> None:
    """Seed the random streams used while training: different on every rank, reproducible from --seed.

    (Model initialisation used `seed` itself, identically on all ranks.) Data order and augmentation
    have their own per-rank, per-worker seeds in the dataset.
    """
    training_seed = seed + 1_000_003 * (rank() + 1)
    paddle.seed(training_seed)
    np.random.seed(training_seed % 2**32)
    random.seed(training_seed)
