"""Qwen-Image 2.1's VAE (diffusers' `AutoencoderKLQwenImage21`, autoencoder_kl_qwenimage21.py) as a family
(family.py): Wan's layout (wan.py) on RGBA images, 4 channels in and out (`Geometry.channels`), one frame only, z_dim
64, f16, its latent normalisation the config's per-channel `latents_mean` / `latents_std` (PerChannel). Its config
keys are Wan's: a config without `_class_name` is this family's when it takes 4 channels (families/__init__.py).
"""

from __future__ import annotations

from ..autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21
from ..family import diffusers_tiling
from .wan import WanFamily


class QwenImage21Family(WanFamily):
    network = AutoencoderKLQwenImage21
    frames = 0  # images only: its encoder has no temporal layers
    tiling = diffusers_tiling("AutoencoderKLQwenImage21")


QWEN_IMAGE21 = QwenImage21Family()
