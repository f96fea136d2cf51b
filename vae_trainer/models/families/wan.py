"""The causal 3D VAEs of Wan 2.1 / 2.2 (`AutoencoderKLWan`) and Qwen-Image (`AutoencoderKLQwenImage`) as families
(family.py): an image is a one-frame clip. The family adds the frame axis to images going in ((N, C, H, W) ->
(N, C, 1, H, W)) and takes it off the posterior and the decode, so images have NCHW latents; clips (N, C, T, H, W)
go through as they are, with (N, C, T', h, w) latents.

- The loss sees the decoder's output before the clamp diffusers' decode applies (a clamp stops gradients).
- The latent normalisation is the config's per-channel `latents_mean` / `latents_std`
  (latent_normalisation.PerChannel), the pipelines' `(z - latents_mean) / latents_std`: kept from the source, or
  measured per channel (--scaling_factor measure); there is no scaling_factor, so a number for --scaling_factor is
  refused.
- --recompute: one-frame passes are cache-free (autoencoder_kl_wan.py), so the encoder's and decoder's blocks are
  re-run one by one; a clip's encoder and decoder are re-run chunk by chunk, the causal cache entering and leaving
  each chunk as tensors (`ChunkPass`), which gives the one-shot gradients exactly.
- --eval_tiled uses the classes' own (diffusers') tiling; --freeze_encoder freezes encoder and quant_conv.
- `Geometry.frames` 4 (clips of 1 + 4k frames): the trainer warns when the encoder trains. The temporal weights one
  frame never reaches (`video_only_weights`: the time_convs, the earlier-frame taps of every 3x3x3 causal conv) get
  no gradient, or an exactly zero one, so AdamW without weight decay, clipping and the EMA leave them bit-identical;
  weight decay and O2's half-precision weights would not, and those are refused for these families.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from ..autoencoder_kl_wan import AutoencoderKLWan, DiagonalGaussianDistribution
from ..family import (Family, Geometry, Layer, Tensor, check_config_keys, constant_logvar_values,
                      constructor_defaults, diffusers_tiling)
from ..latent_normalisation import PerChannel
from ..rgba import ImageConvs


class CausalVideoFamily(Family):
    """What the causal 3D VAEs (Wan, Qwen-Image, and with their own configs LTX-2 and HunyuanVideo 1.5) share."""

    encoder_prefixes = ("encoder.", "quant_conv.")
    normalisation = PerChannel()
    retired_keys: ClassVar[Tuple[str, ...]] = ()  # config keys diffusers 0.42.1's class no longer takes and ignores
    frames: ClassVar[int] = 4  # its temporal factor: clips of 1 + 4k frames
    patch_key: ClassVar[str] = ""  # the config key of a pixel patchify before the encoder (Wan 2.2's patch_size)
    image_channel_keys: ClassVar[Tuple[str, ...]] = ("in_channels", "out_channels")  # Wan 2.2's: patchified
    moments_conv: ClassVar[str] = "quant_conv."  # the state-dict prefix of the conv making the moments

    # ---- config
    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The architecture's factor: each stage boundary halves H and W, after any patchify."""
        config = {**constructor_defaults(self), **{k: v for k, v in config.items() if v is not None}}
        factor = 2 ** (len(config["dim_mult"]) - 1) * int(config.get(self.patch_key) or 1)
        rule = "2 ** (len(dim_mult) - 1)" + (f" x {self.patch_key}" if config.get(self.patch_key) else "")
        patchified = int(config.get("in_channels", config.get("input_channels", 3)))  # Wan 2.2's: p * p per channel
        channels = patchified // int(config.get(self.patch_key) or 1) ** 2
        return Geometry(factor, factor, int(config["z_dim"]), rule, frames=self.frames, channels=channels)

    def build(self, config: Mapping[str, Any], where: str, fresh: bool = False,
              encoder_path: Optional[str] = None) -> Layer:
        check_config_keys(config, self, where, retired=self.retired_keys)
        geometry, merged = self.geometry(config), {**constructor_defaults(self), **config}
        for key in PerChannel.keys:  # diffusers' defaults are Wan 2.1's 16 values, whatever z_dim is
            if key in merged and len(merged[key]) != geometry.latent_channels:
                raise ValueError(f"{where}: {key} has {len(merged[key])} values for z_dim {geometry.latent_channels} "
                                 "latent channels: state one per channel (the source VAE's config.json)")
        vae = self.network.from_config(dict(config))
        if vae.spatial_compression_ratio != geometry.factor:  # diffusers' tiling trusts the stated factor
            raise ValueError(f"{where}: the architecture downsamples by {geometry.factor} (dim_mult, patch_size) but "
                             f"the config makes {self.class_name}'s spatial factor {vae.spatial_compression_ratio}")
        return vae

    # ---- the network, on images (one-frame clips) and clips
    def encode(self, vae: Layer, images: Tensor) -> DiagonalGaussianDistribution:
        # _encode: the moments of our port's (untiled or tiled) encode, without the output wrapper to unpack
        if images.ndim == 5:
            return DiagonalGaussianDistribution(vae._encode(images))
        return DiagonalGaussianDistribution(vae._encode(images.unsqueeze(2)).squeeze(2))

    def decode(self, vae: Layer, latents: Tensor) -> Tensor:
        if latents.ndim == 5:
            return vae.decode(latents, clamp=False).sample
        return vae.decode(latents.unsqueeze(2), clamp=False).sample.squeeze(2)

    def last_layers(self, vae: Layer) -> Tuple[Tensor, Optional[Tensor]]:
        moments = vae.encoder_last_layer()  # the conv making the moments (LTX-2's: a causal conv holding it)
        return vae.decoder_last_layer(), getattr(moments, "conv", moments).weight

    def image_convs(self, vae: Layer) -> ImageConvs:
        """encoder.conv_in and decoder.conv_out (the conv a causal conv holds, HunyuanVideo 1.5's and LTX-2's), on the
        p * p channels of each image channel's patches (Wan 2.2, LTX-2); the config's counts of RGB channels (Wan
        2.2's: of patch channels) grown by 4 / 3."""
        group = int(vae.config.get(self.patch_key) or 1) ** 2
        first, last = vae.encoder.conv_in, vae.decoder.conv_out
        return ImageConvs(getattr(first, "conv", first), getattr(last, "conv", last),
                          {key: int(vae.config[key]) // 3 * 4 for key in self.image_channel_keys}, group, group)

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """The encoder's and decoder's blocks (pure functions of their input on the one-frame path) and their chunk
        passes over clips (pure functions of the chunk and the cache tensors it is given)."""
        return vae.checkpoint_segments()

    def posterior_std_values(self, vae: Layer, posterior_std: float) -> Dict[str, np.ndarray]:
        channels = self.geometry(vae.config).latent_channels
        return constant_logvar_values(vae, self.moments_conv, channels, posterior_std)


class WanFamily(CausalVideoFamily):
    network = AutoencoderKLWan
    patch_key = "patch_size"
    retired_keys = ("clip_output",)  # Wan2.2-TI2V-5B's vae/ has it (diffusers 0.35); 0.42 always clamps the decode
    tiling = diffusers_tiling("AutoencoderKLWan", "; Wan 2.2's encoder tiles count 2x2-patchified pixels")


class QwenImageFamily(CausalVideoFamily):
    network = AutoencoderKLQwenImage
    tiling = diffusers_tiling("AutoencoderKLQwenImage")
    image_channel_keys = ("input_channels",)  # in and out


WAN = WanFamily()
QWEN_IMAGE = QwenImageFamily()
