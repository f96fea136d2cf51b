"""How diffusable a latent space is: the latent diagnostics every evaluation reports beside reconstruction
(`DEFINITIONS`, stated in the protocol; formulas and reading in docs/techniques.md, "Latent diagnostics"):
two equivariance PSNRs (decode(tau(z)) against tau(x), tau a 0.5x downscale or a quarter turn) and the share of
the latents' spatial energy above half the Nyquist frequency."""

from __future__ import annotations

from typing import Callable

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
                       latents: paddle.Tensor) -> dict[str, tuple[paddle.Tensor, paddle.Tensor]]:
    """{diagnostic: (decode(tau(z)), tau(x))} for the two equivariance PSNRs; one decode each."""
    rotation = Transform("rotate", quarter_turns=1)
    half_latents, half_images = halved_pair(latents, images)
    return {
        "scale_equivariance_psnr": (decode(half_latents), half_images),
        "rotation_equivariance_psnr": (decode(rotation.latent(latents, images.shape[2:])),
                                       rotation.images(images, latents.shape[2:])),
    }


def spectrum_energies(latents: paddle.Tensor) -> tuple[float, float]:
    """(energy above half Nyquist, all energy) of [B, C, h, w] latents, each channel's mean removed."""
    z = latents.astype("float32")
    z = z - z.mean(axis=[2, 3], keepdim=True)
    power = paddle.abs(paddle.fft.fft2(z)) ** 2
    fy, fx = np.fft.fftfreq(z.shape[2])[:, None], np.fft.fftfreq(z.shape[3])[None, :]
    mask = paddle.to_tensor((np.sqrt(fx**2 + fy**2) > HALF_NYQUIST).astype(np.float32))
    return float((power * mask).sum()), float(power.sum())


def high_frequency_share(latents: paddle.Tensor) -> float:
    """`latent_high_frequency_share` of one batch of latents (0 for constant latents)."""
    high, total = spectrum_energies(latents)
    return high / total if total > 0 else 0.0
