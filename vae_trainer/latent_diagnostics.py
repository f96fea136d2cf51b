"""How diffusable a latent space is: the diagnostics every evaluation reports beside reconstruction
(evaluation.py; scripts/eval_vae.py; formulas in docs/techniques.md, "Latent diagnostics").

With z the posterior mode of each image x (in [-1, 1]), and reconstructions clamped to [-1, 1]:
- `scale_equivariance_psnr`: PSNR (on [0, 1]) of decode(down2(z)) against down2(x), down2 the 0.5x
  antialiased bilinear downscale (equivariance.halved_pair);
- `rotation_equivariance_psnr`: PSNR of decode(rot90(z)) against rot90(x);
- `latent_high_frequency_share`: the share of the latents' spatial energy above half the Nyquist
  frequency: per image and channel, the mean is removed and |FFT2|^2 taken; the energy at radial
  frequencies sqrt(fx^2 + fy^2) > 0.25 cycles per latent sample, over the energy at all frequencies,
  summed over images and channels (and ranks) before dividing. White noise scores 1 - pi / 16 = 0.80,
  a smooth latent near 0, noise with no energy below half Nyquist 1.
A VAE whose decoder commutes with scaling and rotation scores the equivariance PSNRs of its plain
reconstructions; EQ-VAE fine-tuning (--equivariance_prob) raises them and lowers the high-frequency share.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import paddle

from .equivariance import Transform, halved_pair

HALF_NYQUIST = 0.25  # cycles per sample
DIAGNOSTICS = ("scale_equivariance_psnr", "rotation_equivariance_psnr", "latent_high_frequency_share")
DEFINITIONS = {
    "scale_equivariance_psnr": "PSNR on [0, 1] of decode(down2(z)) against down2(x), z the posterior mode, down2 "
                               "the 0.5x antialiased bilinear downscale (latent h x w -> h//2 x w//2)",
    "rotation_equivariance_psnr": "PSNR on [0, 1] of decode(rot90(z)) against rot90(x), z the posterior mode",
    "latent_high_frequency_share": "share of the posterior modes' spatial energy (|FFT2|^2 per image and channel, "
                                   f"mean removed) at radial frequencies above {HALF_NYQUIST} cycles/sample (half "
                                   "Nyquist), summed over images and channels before dividing",
}


def equivariance_pairs(decode: Callable[[paddle.Tensor], paddle.Tensor], images: paddle.Tensor,
                       latents: paddle.Tensor) -> Dict[str, Tuple[paddle.Tensor, paddle.Tensor]]:
    """{diagnostic: (decode(tau(z)), tau(x))} for the two equivariance PSNRs; one decode each."""
    rotation = Transform("rotate", quarter_turns=1)
    half_latents, half_images = halved_pair(latents, images)
    return {
        "scale_equivariance_psnr": (decode(half_latents), half_images),
        "rotation_equivariance_psnr": (decode(rotation.latent(latents, images.shape[2:])),
                                       rotation.images(images, latents.shape[2:])),
    }


def _high_frequency_mask(height: int, width: int) -> np.ndarray:
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.fftfreq(width)[None, :]
    return (np.sqrt(fx**2 + fy**2) > HALF_NYQUIST).astype(np.float32)


def spectrum_energies(latents: paddle.Tensor) -> Tuple[float, float]:
    """(energy above half Nyquist, all energy) of [B, C, h, w] latents, each channel's mean removed."""
    z = latents.astype("float32")
    z = z - z.mean(axis=[2, 3], keepdim=True)
    power = paddle.abs(paddle.fft.fft2(z)) ** 2
    mask = paddle.to_tensor(_high_frequency_mask(z.shape[2], z.shape[3]))
    return float((power * mask).sum()), float(power.sum())


def high_frequency_share(latents: paddle.Tensor) -> float:
    """`latent_high_frequency_share` of one batch of latents (0 for constant latents)."""
    high, total = spectrum_energies(latents)
    return high / total if total > 0 else 0.0
