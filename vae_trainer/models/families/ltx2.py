"""LTX-2's video VAE (diffusers' `AutoencoderKLLTX2Video`, autoencoder_kl_ltx2.py) as a family (family.py): a causal
3D VAE like Wan's (wan.py: images as one-frame clips, clips of 1 + 8k frames as they are), patchified 4x4 before its
first conv, f32 x 8, whole clips in one pass (no feature cache). Its latent normalisation is held in its weights, the
`latents_mean` / `latents_std` buffers (latent_normalisation.LTX2_BUFFERS) with the config's scaling_factor.

The options the trainer cannot honour are refused when it is built: `timestep_conditioning` (its decoder needs a
timestep per sample, which the pipelines draw with noise mixed into the latents) and `decoder_inject_noise` (its
decoder draws noise from the global generator inside the forward). The published LTX-2 VAE has both off. It has no
tiled passes here (diffusers' are inference memory savers, not ported).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from ..autoencoder_kl_ltx2 import STRIDES, AutoencoderKLLTX2Video, _per_block
from ..family import Geometry, Layer, check_config_keys, constructor_defaults
from ..latent_normalisation import LTX2_BUFFERS
from .wan import CausalVideoFamily

UNHONOURED = {"timestep_conditioning": "its decoder then needs a timestep per sample, which the pipelines draw beside "
                                       "noise mixed into the latents and the trainer does not give",
              "decoder_inject_noise": "its decoder then draws noise inside the forward, from the global generator, "
                                      "which recompute and exact resume do not cover"}


class LTX2Family(CausalVideoFamily):
    network = AutoencoderKLLTX2Video
    encoder_prefixes = ("encoder.", "latents_mean", "latents_std")  # the buffers define the latent's normalisation
    normalisation = LTX2_BUFFERS
    moments_conv = "encoder.conv_out.conv."
    patch_key = "patch_size"  # 4x4, before the first conv (its config counts image channels, not patch channels)

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The encoder's factors: the patch, then the stride of each down block that scales; the decoder's: the
        patch, then the stride of each up block that scales."""
        config = {**constructor_defaults(self), **{k: v for k, v in config.items() if v is not None}}
        down, up = ([STRIDES[kind] for kind, on in zip(config[f"{side}sample_type"], _per_block(
            config[f"{coder}spatio_temporal_scaling"], len(config[f"{coder}layers_per_block"]) - 1)) if on]
            for side, coder in (("down", ""), ("up", "decoder_")))
        patch = int(config["patch_size"])
        # A reflect-padded conv at the latents' resolution needs sides of 2 (the published decoder's is reflect).
        reflect = "reflect" in (config["encoder_spatial_padding_mode"], config["decoder_spatial_padding_mode"])
        return Geometry(patch * math.prod(s[1] for s in down), patch * math.prod(s[1] for s in up),
                        int(config["latent_channels"]), "patch_size x the down blocks' strides",
                        frames=int(config["patch_size_t"]) * math.prod(s[0] for s in down),
                        channels=int(config["in_channels"]), min_latent_side=2 if reflect else 1)

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        check_config_keys(config, self, where)
        for key, why in UNHONOURED.items():
            if any(np.atleast_1d(config.get(key, False))):
                raise ValueError(f"{where}: {key} is set, and {why}: this trainer cannot train it (LTX-2's published "
                                 "VAE has it off)")
        return self.network.from_config(dict(config))


LTX2 = LTX2Family()
