"""HunyuanVideo 1.5's VAE (diffusers' `AutoencoderKLHunyuanVideo15`, autoencoder_kl_hunyuanvideo15.py) as a family
(family.py): a causal 3D VAE like Wan's (wan.py: images as one-frame clips, clips of 1 + 4k frames as they are), f16 x
4, 32 latent channels, whole clips in one pass (no feature cache); its pipelines scale the posterior mode by the
config's `scaling_factor` (latent_normalisation.Scale). Its encoder adds a channel-mean shortcut to the moments'
conv, so no weights give its posterior a constant std: --posterior_std is refused when it is built.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import numpy as np

from ..autoencoder_kl_hunyuanvideo15 import AutoencoderKLHunyuanVideo15
from ..family import TILE_OVERLAP, Geometry, Layer, constructor_defaults, diffusers_tiling, tiling_enabled
from ..latent_normalisation import Scale
from .wan import CausalVideoFamily


class HunyuanVideo15Family(CausalVideoFamily):
    network = AutoencoderKLHunyuanVideo15
    encoder_prefixes = ("encoder.",)
    normalisation = Scale()
    tiling = diffusers_tiling("AutoencoderKLHunyuanVideo15")

    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        config = {**constructor_defaults(self), **{k: v for k, v in config.items() if v is not None}}
        factor = int(config["spatial_compression_ratio"])
        return Geometry(factor, factor, int(config["latent_channels"]), "spatial_compression_ratio",
                        frames=int(config["temporal_compression_ratio"]), channels=int(config["in_channels"]))

    def tiled(self, vae: Layer, tile: int):
        """Its own enable_tiling: square `tile` px tiles and their latent tiles, overlapping by a quarter."""
        latent_tile = tile // vae.spatial_compression_ratio
        return tiling_enabled(vae, tile, tile, latent_tile, latent_tile, TILE_OVERLAP)

    def posterior_std_values(self, vae: Layer, posterior_std: float) -> Dict[str, np.ndarray]:
        if posterior_std and posterior_std > 0:
            raise ValueError(f"--posterior_std {posterior_std}: {self.class_name}'s encoder adds a channel-mean "
                             "shortcut to its moments, so no export can give its posterior that constant std: drop it")
        return {}


HUNYUAN_VIDEO15 = HunyuanVideo15Family()
