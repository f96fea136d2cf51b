"""FLUX.2's VAE (diffusers' `AutoencoderKLFlux2`, also ERNIE-Image's; the class: autoencoder_kl_flux2.py) as a family
(family.py): AutoencoderKL's but for its config and its latent normalisation, the statistics its `bn` holds (kept or
measured at export). docs/fine-tuning.md has the details.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..autoencoder_kl_flux2 import AutoencoderKLFlux2
from ..family import Layer, constructor_defaults
from ..latent_normalisation import FLUX2_BN
from .kl import KLFamily, widths


class Flux2Family(KLFamily):
    network = AutoencoderKLFlux2
    encoder_prefixes = ("encoder.", "quant_conv.", "bn.")  # the bn statistics define the latent's normalisation
    normalisation = FLUX2_BN

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        """A fresh AutoencoderKLFlux2 whose config also holds (and exports) entries it does not take
        (`force_upcast`)."""
        accepted = constructor_defaults(self)  # every argument of its constructor has a default
        vae = AutoencoderKLFlux2.from_config({k: v for k, v in config.items() if k in accepted or k.startswith("_")})
        vae.register_to_config(**{k: v for k, v in config.items() if not k.startswith("_") and k not in vae.config})
        return vae

    def diffusers_problem(self, vae: Layer) -> Optional[str]:
        config = vae.config  # AutoencoderKLFlux2 takes the decoder's widths apart: one per block
        encoder, decoder = widths(vae)
        if len(config.down_block_types) == len(encoder) and len(config.up_block_types) == len(decoder):
            return None
        return (f"PyTorch diffusers' {self.class_name} builds one block per width, and this VAE has {len(encoder)} "
                f"encoder / {len(decoder)} decoder widths for {len(config.down_block_types)} / "
                f"{len(config.up_block_types)} blocks")


FLUX2 = Flux2Family()
