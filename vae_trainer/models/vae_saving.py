"""Saving the VAE so that ppdiffusers and PyTorch diffusers both load it as it is (`save_vae`): one folder with
ppdiffusers' weights, PyTorch diffusers' (converted by ppdiffusers' `to_diffusers=True`, which transposes the attention
projections) and one config.json; ppdiffusers' alone for a VAE diffusers cannot describe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import List, Optional, Tuple

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL

from .flux2 import BatchNormStatistics, is_flux2
from .vae_loading import TORCH_WEIGHT_FILES, with_variants

logger = logging.getLogger("vae_trainer")
# AutoencoderKL config entries only ppdiffusers has: null (or block_out_channels) in a VAE diffusers can load,
# where diffusers would warn on every load that they "are not expected".
PPDIFFUSERS_ONLY_ENTRIES = ("down_block_out_channels", "up_block_out_channels")


def save_vae(vae: AutoencoderKL, out_dir: str, posterior_std: float = 0.0,
             bn_statistics: Optional[BatchNormStatistics] = None, **config_updates) -> bool:
    """Write `out_dir` for both libraries after updating config entries such as scaling_factor (`_exported_values`
    for the other arguments); returns whether the PyTorch file was written."""
    if config_updates:
        vae.register_to_config(**config_updates)
    for_diffusers = diffusers_can_load(vae)
    with _exported_values(vae, posterior_std, bn_statistics):
        vae.save_pretrained(out_dir, safe_serialization=True)
        if for_diffusers:  # second: its config.json (diffusers' spelling of the version key) is the one both read
            vae.save_pretrained(out_dir, safe_serialization=True, to_diffusers=True)
    if for_diffusers:
        path = os.path.join(out_dir, AutoencoderKL.config_name)
        with open(path) as handle:
            config = json.load(handle)
        for key in PPDIFFUSERS_ONLY_ENTRIES:
            if config.get(key) in (None, config.get("block_out_channels")):
                config.pop(key, None)
        with open(path, "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
            handle.write("\n")
        return True
    for name in with_variants(TORCH_WEIGHT_FILES):  # an earlier export's: diffusers would load it, silently
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
            logger.warning("%s: removed %s of an earlier export (it is not this VAE)", out_dir, name)
    logger.warning("%s: written for ppdiffusers only. PyTorch diffusers' AutoencoderKL builds the encoder and the "
                   "decoder from one list of widths, so this VAE (encoder %s, decoder %s) would load there "
                   "with freshly initialised layers and no error.", out_dir, *_widths(vae))
    return False


def diffusers_can_load(vae: AutoencoderKL) -> bool:
    """Can PyTorch diffusers hold this VAE? AutoencoderKL only with the same widths for encoder and decoder
    (AutoencoderKLFlux2 with any), both with one width per block (a super-resolving decoder has more up blocks)."""
    config, (encoder, decoder) = vae.config, _widths(vae)
    return ((is_flux2(vae) or encoder == decoder) and len(config.down_block_types) == len(encoder)
            and len(config.up_block_types) == len(decoder))


def _widths(vae: AutoencoderKL) -> Tuple[List[int], List[int]]:
    config = vae.config
    return (list(config.get("down_block_out_channels") or config.block_out_channels),
            list(config.get("up_block_out_channels") or config.get("decoder_block_out_channels")
                 or config.block_out_channels))


@contextlib.contextmanager
def _exported_values(vae: AutoencoderKL, posterior_std: float, bn_statistics: Optional[BatchNormStatistics]):
    """`vae` holding, while saving, the weights the export writes in place of its own: with --posterior_std, zero
    weights and bias log(std^2) for the log-variance outputs (training ignores them); FLUX.2: the bn statistics."""
    state, values = vae.state_dict(), {}
    if posterior_std and posterior_std > 0:
        prefix = "quant_conv." if vae.quant_conv is not None else "encoder.conv_out."  # FLUX has no quant_conv
        weight, bias = state[prefix + "weight"].numpy().copy(), state[prefix + "bias"].numpy().copy()
        weight[vae.config.latent_channels:], bias[vae.config.latent_channels:] = 0.0, 2.0 * math.log(posterior_std)
        values.update({prefix + "weight": weight, prefix + "bias": bias})
    if bn_statistics is not None:  # FLUX.2's
        values.update({"bn._mean": np.asarray(bn_statistics.running_mean, np.float32),
                       "bn._variance": np.asarray(bn_statistics.running_var, np.float32),
                       "bn.num_batches_tracked": np.asarray([bn_statistics.num_batches_tracked], np.int64)})
    own = {name: state[name].numpy().copy() for name in values}
    for name, value in values.items():
        state[name].set_value(paddle.to_tensor(value).astype(state[name].dtype))
    try:
        yield
    finally:
        for name, value in own.items():
            state[name].set_value(value)
