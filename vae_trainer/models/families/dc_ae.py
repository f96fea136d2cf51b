"""SANA's DC-AE (`AutoencoderDC`, autoencoder_dc.py) as a family (family.py): a deterministic encoder (no posterior,
so no KL term), the layers training reads (`decoder.conv_out` is a DCUpBlock2d when `layers_per_block[0] == 0`),
its blocks as --recompute's segments, its own tiled passes, and its config checked key by key; SanaPipeline scales its
latents by the scaling factor (it decodes latents / scaling_factor)."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from ..autoencoder_dc import AutoencoderDC, DCUpBlock2d
from ..family import (Deterministic, Family, Geometry, Layer, Tensor, check_config_keys,
                      constructor_defaults, diffusers_tiling, holds_batch_norm)
from ..latent_normalisation import Scale
from ..rgba import ImageConvs

# Keys whose default is rarely the architecture's: a config must state them (diffusers would silently default).
ARCHITECTURE_KEYS = ("latent_channels", "encoder_block_types", "decoder_block_types", "encoder_block_out_channels",
                     "decoder_block_out_channels", "encoder_layers_per_block", "decoder_layers_per_block",
                     "encoder_qkv_multiscales", "decoder_qkv_multiscales", "upsample_block_type",
                     "downsample_block_type", "decoder_norm_types", "decoder_act_fns")
# Per-stage keys: a list holds one entry per stage of its side; a name (NAMED_KEYS) applies to all.
STAGE_KEYS = {"encoder": ("encoder_block_types", "encoder_layers_per_block", "encoder_qkv_multiscales"),
              "decoder": ("decoder_block_types", "decoder_layers_per_block", "decoder_qkv_multiscales",
                          "decoder_norm_types", "decoder_act_fns")}
NAMED_KEYS = ("encoder_block_types", "decoder_block_types", "decoder_norm_types", "decoder_act_fns")
SHORTCUTS = {"encoder": "encoder_out_shortcut", "decoder": "decoder_in_shortcut"}


class DCFamily(Family):
    network = AutoencoderDC
    normalisation = Scale()
    tiling = diffusers_tiling("AutoencoderDC")
    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        config = {**constructor_defaults(self), **config}
        return Geometry(2 ** (len(config["encoder_block_out_channels"]) - 1),
                        2 ** (len(config["decoder_block_out_channels"]) - 1), int(config["latent_channels"]),
                        "2 ** (stages - 1)", deterministic=True, channels=int(config["in_channels"]))

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        check_config_keys(config, self, where, required=ARCHITECTURE_KEYS)
        # One error naming the key: a per-stage value that is neither a list of one entry per stage of its side nor
        # (where one applies to all) a name, or a shortcut whose channel groups the latent channels do not divide
        # (diffusers would fail in the first forward; it also takes lists longer than the stages, which we refuse).
        merged = {**constructor_defaults(self), **config}
        for side, keys in STAGE_KEYS.items():
            widths = merged[f"{side}_block_out_channels"]
            for key in keys:
                value = merged[key]
                if isinstance(value, str) and key in NAMED_KEYS:
                    continue
                if not isinstance(value, (list, tuple)) or len(value) != len(widths):
                    raise ValueError(f"{where}: {key} is {value!r}, for the {len(widths)} stages of "
                                     f"{side}_block_out_channels {list(widths)}: give a list of one entry per stage"
                                     + (" (or one name for all)" if key in NAMED_KEYS else ""))
            if merged[SHORTCUTS[side]] and widths[-1] % merged["latent_channels"]:
                raise ValueError(f"{where}: {SHORTCUTS[side]} needs latent_channels ({merged['latent_channels']}) to "
                                 f"divide the last of {side}_block_out_channels ({widths[-1]})")
        try:
            return self.network.from_config(dict(config))
        except (KeyError, ValueError) as error:  # a block, norm or activation name the class does not know
            raise ValueError(f"{where}: {error}") from error

    def encode(self, vae: Layer, images: Tensor) -> Deterministic:
        return Deterministic(vae.encode(images).latent)

    def image_convs(self, vae: Layer) -> ImageConvs:
        """conv_in and conv_out, or the convs of the shortcut-free DCDownBlock2d / DCUpBlock2d standing for them when
        layers_per_block[0] == 0; a pixel-shuffled one writes factor ** 2 channels per image channel."""
        first, last = vae.encoder.conv_in, vae.decoder.conv_out
        shuffled = isinstance(last, DCUpBlock2d) and not last.interpolate
        return ImageConvs(getattr(first, "conv", first), getattr(last, "conv", last), {"in_channels": 4},
                          last_group=last.factor ** 2 if shuffled else 1)

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """Every block of the encoder's and decoder's stages (residual, EfficientViT, down- and upsampling), not
        the convs in and out nor the decoder's output norm, nor a block of a batch_norm stage (its statistics)."""
        return [(f"{coder}.{blocks}.{i}.{j}", layer)
                for coder, blocks in (("encoder", "down_blocks"), ("decoder", "up_blocks"))
                for i, stage in enumerate(getattr(getattr(vae, coder), blocks))
                for j, layer in enumerate(stage.children()) if not holds_batch_norm(layer)]


DC_AE = DCFamily()
