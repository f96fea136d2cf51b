"""ppdiffusers' AutoencoderKL (SD, SDXL, FLUX.1) as a family (family.py): the protocol's posterior and layers, and
--recompute's segments, ppdiffusers' tiled passes, its config and what its export writes (--posterior_std); its
latent normalisation is a scaling factor (and FLUX.1's shift, SDXL-style latents_mean / latents_std)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL

from ..family import TILE_OVERLAP, Family, Geometry, Layer, constant_logvar_values, constructor_defaults, tiling_enabled
from ..latent_normalisation import Scale
from ..rgba import ImageConvs


class KLFamily(Family):
    network = AutoencoderKL
    encoder_prefixes = ("encoder.", "quant_conv.")
    normalisation = Scale(("scaling_factor", "shift_factor", "latents_mean", "latents_std"))
    tiling = (f"overlapping by {TILE_OVERLAP:.0%}, overlaps blended linearly (ppdiffusers tiled_encode / "
              "tiled_decode)")
    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        config = {**constructor_defaults(self), **{k: v for k, v in config.items() if v is not None}}
        return Geometry(2 ** (len(config["down_block_types"]) - 1), 2 ** (len(config["up_block_types"]) - 1),
                        int(config["latent_channels"]), "2 ** (down blocks - 1)", channels=int(config["in_channels"]))

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        """An AutoencoderKL whose saved config rebuilds it (the encoder's widths stated)."""
        config = dict(config)
        widths, down_blocks = config.get("block_out_channels") or [], config.get("down_block_types") or []
        if config.get("down_block_out_channels") is None and widths and len(widths) != len(down_blocks):
            raise ValueError(  # e.g. the reference trainer's config.json
                f"{where}: {len(down_blocks)} down blocks but block_out_channels {widths} (the decoder's widths, "
                "written over the encoder's by ppdiffusers when saving a VAE with up_block_out_channels). Add "
                "\"down_block_out_channels\": [the encoder's widths, e.g. those of the --vae_config_file it was "
                "trained from] to that config.json.")
        if config.get("up_block_out_channels") is not None and config.get("down_block_out_channels") is None:
            config["down_block_out_channels"] = list(config.get("block_out_channels",
                                                                constructor_defaults(self)["block_out_channels"]))
        return self.network.from_config(config)

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """Every resnet, attention, down- and upsampler of the encoder's and decoder's blocks (not the convs in and
        out, so that the adaptive GAN weight's gradient never enters a segment)."""
        out = []
        for coder_name, blocks in (("encoder", "down_blocks"), ("decoder", "up_blocks")):
            coder = getattr(vae, coder_name)
            named_blocks = [(f"{blocks}.{i}", block) for i, block in enumerate(getattr(coder, blocks))]
            for block_name, block in named_blocks + [("mid_block", coder.mid_block)]:
                for kind in ("resnets", "attentions", "downsamplers", "upsamplers"):
                    for i, layer in enumerate(getattr(block, kind, None) or []):
                        if layer is not None:
                            out.append((f"{coder_name}.{block_name}.{kind}.{i}", layer))
        return out

    @contextlib.contextmanager
    def tiled(self, vae: Layer, tile: int):
        stand_ins = [name for name in ("quant_conv", "post_quant_conv") if getattr(vae, name, None) is None]  # FLUX's
        try:
            for name in stand_ins:  # the tiled passes call them and read `.weight.dtype` (not a parameter here)
                owner = vae.encoder if name == "quant_conv" else vae.decoder
                setattr(vae, name, paddle.nn.Identity())
                getattr(vae, name).weight = SimpleNamespace(dtype=owner.conv_in.weight.dtype)
            with tiling_enabled(vae):  # ppdiffusers' enable_tiling sets use_tiling; the tile_* below restored too
                vae.tile_sample_min_size, vae.tile_overlap_factor = tile, TILE_OVERLAP
                vae.tile_latent_min_size = tile // self.geometry(vae.config).factor
                yield
        finally:
            for name in stand_ins:
                delattr(vae, name)  # out of the sublayers, then back to the plain None attribute it was
                setattr(vae, name, None)

    def image_convs(self, vae: Layer) -> ImageConvs:
        return ImageConvs(vae.encoder.conv_in, vae.decoder.conv_out, {"in_channels": 4, "out_channels": 4})

    def posterior_std_values(self, vae: Layer, posterior_std: float) -> Dict[str, np.ndarray]:
        prefix = "quant_conv." if vae.quant_conv is not None else "encoder.conv_out."  # FLUX has no quant_conv
        return constant_logvar_values(vae, prefix, vae.config.latent_channels, posterior_std)

    def diffusers_problem(self, vae: Layer) -> Optional[str]:
        """diffusers' AutoencoderKL builds encoder and decoder from one list of widths, one per block."""
        encoder, decoder = widths(vae)
        config = vae.config
        if encoder == decoder and len(config.down_block_types) == len(encoder) == len(config.up_block_types):
            return None
        return (f"PyTorch diffusers' AutoencoderKL builds the encoder and the decoder from one list of widths, so this "
                f"VAE (encoder {encoder}, decoder {decoder}) would load there with freshly initialised layers and no "
                "error")


def widths(vae: Layer) -> Tuple[List[int], List[int]]:
    """(the encoder's block widths, the decoder's)."""
    config = vae.config
    return (list(config.get("down_block_out_channels") or config.block_out_channels),
            list(config.get("up_block_out_channels") or config.get("decoder_block_out_channels")
                 or config.block_out_channels))


KL = KLFamily()
