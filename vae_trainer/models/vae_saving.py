"""Saving the VAE so that ppdiffusers and PyTorch diffusers both load it as it is.

Owns `save_vae`: one folder with ppdiffusers' `diffusion_paddle_model.safetensors`, PyTorch diffusers'
`diffusion_pytorch_model.safetensors` (converted by ppdiffusers' `to_diffusers=True`: the attention
projections are transposed, so a Paddle file must never just be renamed) and a `config.json` both read;
and the --posterior_std export fix (`constant_posterior_std`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

from ppdiffusers import AutoencoderKL

from .vae import posterior_layer


def save_vae(vae: AutoencoderKL, out_dir: str, posterior_std: float = 0.0, **config_updates) -> None:
    """Write `out_dir` loadable as it is by `ppdiffusers.AutoencoderKL.from_pretrained(out_dir)` (which reads
    diffusion_paddle_model.safetensors) and by PyTorch `diffusers.AutoencoderKL.from_pretrained(out_dir)`
    (diffusion_pytorch_model.safetensors), after updating config entries such as scaling_factor.
    With `posterior_std` > 0 the saved encoder's log-variance outputs give that std (see
    `constant_posterior_std`)."""
    if config_updates:
        vae.register_to_config(**config_updates)
    with constant_posterior_std(vae, posterior_std):
        vae.save_pretrained(out_dir, safe_serialization=True)
        # Second: its config.json (diffusers' spelling of the version key) is the one both libraries read.
        vae.save_pretrained(out_dir, safe_serialization=True, to_diffusers=True)


@contextlib.contextmanager
def constant_posterior_std(vae: AutoencoderKL, std: float) -> Iterator[None]:
    """Temporarily make the posterior's std equal `std` everywhere: the log-variance half of
    `posterior_layer` gets zero weights and bias log(std^2). Training with --posterior_std ignores those
    outputs (they receive no gradient), so an export without this would sample with their random scale."""
    if not std or std <= 0:
        yield
        return
    layer, channels = posterior_layer(vae), vae.config.latent_channels
    weight, bias = layer.weight.numpy(), layer.bias.numpy()
    constant_weight, constant_bias = weight.copy(), bias.copy()
    constant_weight[channels:] = 0
    constant_bias[channels:] = 2.0 * math.log(std)
    layer.weight.set_value(constant_weight)
    layer.bias.set_value(constant_bias)
    try:
        yield
    finally:
        layer.weight.set_value(weight)
        layer.bias.set_value(bias)
