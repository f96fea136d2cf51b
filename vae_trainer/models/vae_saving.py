"""Saving the VAE so that ppdiffusers and PyTorch diffusers both load it as it is.

Owns `save_vae`: one folder with ppdiffusers' `diffusion_paddle_model.safetensors`, PyTorch diffusers'
`diffusion_pytorch_model.safetensors` (converted by ppdiffusers' `to_diffusers=True`: the attention
projections are transposed, so a Paddle file must never just be renamed) and a `config.json` both read
(ppdiffusers only for a VAE PyTorch diffusers cannot describe, `diffusers_can_load`); and the
--posterior_std export fix (`constant_posterior_std`). FLUX.2's VAE (flux2.py) is saved as diffusers'
AutoencoderKLFlux2, with the bn statistics latent_scale.py decided (`exported_bn_statistics`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Iterator, List, Optional

from ppdiffusers import AutoencoderKL

from .flux2 import BatchNormStatistics, bn_statistics, is_flux2, set_bn_statistics
from .vae import posterior_layer
from .vae_loading import TORCH_WEIGHT_FILES, with_variants

logger = logging.getLogger("vae_trainer")


def save_vae(vae: AutoencoderKL, out_dir: str, posterior_std: float = 0.0,
             bn_statistics: Optional[BatchNormStatistics] = None, **config_updates) -> bool:
    """Write `out_dir` loadable as it is by `ppdiffusers.AutoencoderKL.from_pretrained(out_dir)` (which reads
    diffusion_paddle_model.safetensors) and by PyTorch `diffusers.AutoencoderKL.from_pretrained(out_dir)`
    (diffusion_pytorch_model.safetensors), after updating config entries such as scaling_factor.
    With `posterior_std` > 0 the saved encoder's log-variance outputs give that std (see
    `constant_posterior_std`). `bn_statistics`: the latent normalisation FLUX.2's VAE is saved with (its own
    when None). A VAE that PyTorch diffusers cannot describe (`diffusers_can_load`) is
    written for ppdiffusers only, with a warning. Returns whether the PyTorch file was written."""
    if config_updates:
        vae.register_to_config(**config_updates)
    for_diffusers = diffusers_can_load(vae)
    with constant_posterior_std(vae, posterior_std), exported_bn_statistics(vae, bn_statistics):
        vae.save_pretrained(out_dir, safe_serialization=True)
        if for_diffusers:
            # Second: its config.json (diffusers' spelling of the version key) is the one both libraries read.
            vae.save_pretrained(out_dir, safe_serialization=True, to_diffusers=True)
            _drop_ppdiffusers_only_entries(out_dir)
    if not for_diffusers:
        _remove_pytorch_weights(out_dir)
        logger.warning("%s: written for ppdiffusers only. PyTorch diffusers' AutoencoderKL builds the encoder and the "
                       "decoder from one list of widths, so this VAE (encoder %s, decoder %s) would load there "
                       "with freshly initialised layers and no error.", out_dir, encoder_widths(vae),
                       decoder_widths(vae))
    return for_diffusers


# AutoencoderKL config entries only ppdiffusers has. In a VAE that diffusers can load they are null (or repeat
# block_out_channels), and diffusers would warn on every load that they "are not expected ... verify your config.json".
PPDIFFUSERS_ONLY_ENTRIES = ("down_block_out_channels", "up_block_out_channels")


def _drop_ppdiffusers_only_entries(out_dir: str) -> None:
    path = os.path.join(out_dir, AutoencoderKL.config_name)
    with open(path) as handle:
        config = json.load(handle)
    for key in PPDIFFUSERS_ONLY_ENTRIES:
        if config.get(key) in (None, config.get("block_out_channels")):
            config.pop(key, None)
    with open(path, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")


def _remove_pytorch_weights(out_dir: str) -> None:
    """A PyTorch weight file left in `out_dir` by an earlier export (e.g. scripts/export_vae.py run twice into one
    folder) would be loaded by diffusers, silently, beside this ppdiffusers-only VAE: remove it."""
    for name in with_variants(TORCH_WEIGHT_FILES):
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
            logger.warning("%s: removed %s of an earlier export (it is not this VAE)", out_dir, name)


def encoder_widths(vae: AutoencoderKL) -> List[int]:
    config = vae.config
    return list(config.get("down_block_out_channels") or config.block_out_channels)


def decoder_widths(vae: AutoencoderKL) -> List[int]:
    config = vae.config
    return list(config.get("up_block_out_channels") or config.get("decoder_block_out_channels")
                or config.block_out_channels)


def diffusers_can_load(vae: AutoencoderKL) -> bool:
    """Can PyTorch diffusers hold this VAE? AutoencoderKL only with the same widths for encoder and decoder
    (it has no down/up_block_out_channels), AutoencoderKLFlux2 with any (decoder_block_out_channels); both with
    one width per down block and per up block (a super-resolving decoder, --input_size, has more up blocks)."""
    config = vae.config
    widths, decoder = encoder_widths(vae), decoder_widths(vae)
    same_widths = is_flux2(vae) or widths == decoder
    return same_widths and len(config.down_block_types) == len(widths) and len(config.up_block_types) == len(decoder)


@contextlib.contextmanager
def exported_bn_statistics(vae: AutoencoderKL, statistics: Optional[BatchNormStatistics]) -> Iterator[None]:
    """Temporarily give FLUX.2's bn the `statistics` to save (the VAE keeps its own afterwards: the EMA and
    the raw export each save theirs)."""
    if statistics is None:
        yield
        return
    if not is_flux2(vae):
        raise ValueError("bn statistics are FLUX.2's VAE's latent normalisation; this VAE has none")
    own = bn_statistics(vae)
    set_bn_statistics(vae, statistics)
    try:
        yield
    finally:
        set_bn_statistics(vae, own)


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
