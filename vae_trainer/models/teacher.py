"""The frozen teacher of a distillation run: its latents taken to and from the latent space a diffusion pipeline sees
(`to_pipeline` / `from_pipeline`, with a family's `pipeline_normalisation` (mean, std) of shape [C, p, p], tiled over
the latent positions with period p), which is the space the student autoencoder learns."""

from __future__ import annotations

import numpy as np
import paddle


def _tiled(pattern: np.ndarray, latents: paddle.Tensor) -> paddle.Tensor:
    """[1, C, H, W]: the [C, p, p] pattern repeated over the H x W latent positions."""
    _, period, _ = pattern.shape
    height, width = latents.shape[-2:]
    reps = [1, -(-height // period), -(-width // period)]
    return paddle.to_tensor(np.tile(pattern, reps)[None, :, :height, :width].astype(np.float32))


def to_pipeline(latents: paddle.Tensor, mean: np.ndarray, std: np.ndarray) -> paddle.Tensor:
    """(z - mean) / std of NCHW latents z, in float32."""
    return (latents.astype("float32") - _tiled(mean, latents)) / _tiled(std, latents)


def from_pipeline(latents: paddle.Tensor, mean: np.ndarray, std: np.ndarray) -> paddle.Tensor:
    """The posterior-mode latents z of a pipeline's NCHW latents: latents * std + mean, in float32."""
    return latents.astype("float32") * _tiled(std, latents) + _tiled(mean, latents)
