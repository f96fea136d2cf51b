"""The causal 3D VAEs of Wan 2.1 / 2.2 (`AutoencoderKLWan`) and Qwen-Image (`AutoencoderKLQwenImage`) as families
(family.py): an image is a one-frame clip. The family adds the frame axis to images going in ((N, C, H, W) ->
(N, C, 1, H, W)) and takes it off the posterior and the decode, so images have NCHW latents; clips (N, C, T, H, W)
go through as they are, with (N, C, T', h, w) latents.

- The loss sees the decoder's output before the clamp diffusers' decode applies (a clamp stops gradients).
- The latent scale is the config's per-channel `latents_mean` / `latents_std`, the pipelines'
  `(z - latents_mean) / latents_std`: kept from the source, or measured per channel (--scaling_factor measure); there
  is no scaling_factor, so a number for --scaling_factor is refused.
- --recompute: one-frame passes are cache-free (autoencoder_kl_wan.py), so the encoder's and decoder's blocks are
  re-run one by one; a clip's encoder and decoder are re-run chunk by chunk, the causal cache entering and leaving
  each chunk as tensors (`ChunkPass`), which gives the one-shot gradients exactly.
- --eval_tiled uses the classes' own (diffusers') tiling; --freeze_encoder freezes encoder and quant_conv.
- `video`: the trainer warns when the encoder trains. The temporal weights one frame never reaches
  (`video_only_weights`: the time_convs, the earlier-frame taps of every 3x3x3 causal conv) get no gradient, or an
  exactly zero one, so AdamW without weight decay, clipping and the EMA leave them bit-identical; weight decay and
  O2's half-precision weights would not, and flag_checks.py refuses them for these families.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from .autoencoder_kl_wan import AutoencoderKLWan, DiagonalGaussianDistribution
from .family import (Family, Geometry, Layer, Tensor, check_config_keys, constant_logvar_values,
                     tiling_enabled)

TILE_OVERLAP = 0.25  # diffusers' defaults: 256 px tiles, stride 192
TILING_STATE = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                "tile_sample_stride_width")
NORMALISATION = ("(z - latents_mean) / latents_std per channel, z the posterior mode (diffusers' Wan / Qwen-Image "
                 "pipelines)")


def diffusers_tiling(class_name: str, note: str = "") -> str:
    return (f"overlapping by {TILE_OVERLAP:.0%}, overlaps blended linearly ({class_name} tiled_encode / tiled_decode, "
            f"as diffusers'{note})")


class CausalVideoFamily(Family):
    """What AutoencoderKLWan and AutoencoderKLQwenImage share as families."""

    video = True
    encoder_prefixes = ("encoder.", "quant_conv.")
    scale_keys = ("latents_mean", "latents_std")
    scale_name = "latent normalisation (latents_mean / latents_std)"
    lists_view_statistics = False  # measured_record holds them, named for what they are
    patch_key: ClassVar[str] = ""  # the config key of a pixel patchify before the encoder (Wan 2.2's patch_size)

    # ---- config
    def geometry(self, config: Mapping[str, Any]) -> Geometry:
        """The architecture's factor: each stage boundary halves H and W, after any patchify."""
        config = {**self.defaults(), **{k: v for k, v in config.items() if v is not None}}
        factor = 2 ** (len(config["dim_mult"]) - 1) * int(config.get(self.patch_key) or 1)
        rule = "2 ** (len(dim_mult) - 1)" + (f" x {self.patch_key}" if config.get(self.patch_key) else "")
        return Geometry(factor, factor, int(config["z_dim"]), rule)

    def build(self, config: Mapping[str, Any], where: str) -> Layer:
        check_config_keys(config, self, where)
        geometry, merged = self.geometry(config), {**self.defaults(), **config}
        for key in self.scale_keys:  # diffusers' defaults are Wan 2.1's 16 values, whatever z_dim is
            if len(merged[key]) != geometry.latent_channels:
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

    def decoder_last_layer(self, vae: Layer) -> Tensor:
        return vae.decoder_last_layer()

    def encoder_last_layer(self, vae: Layer) -> Tensor:
        return vae.encoder_last_layer().weight  # quant_conv: it makes the moments

    def encoder_layers(self, vae: Layer) -> List[Layer]:
        return [layer for _, layer in vae.encoder_side_modules()]

    def recompute_segments(self, vae: Layer) -> List[Tuple[str, Layer]]:
        """The encoder's and decoder's blocks (pure functions of their input on the one-frame path) and their chunk
        passes over clips (pure functions of the chunk and the cache tensors it is given)."""
        return vae.checkpoint_segments()

    def tiled(self, vae: Layer, tile: int):
        return tiling_enabled(vae, tile, TILE_OVERLAP, TILING_STATE)

    def pipeline_normalisation(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """The Wan / Qwen-Image pipelines' (z - latents_mean) / latents_std per channel, for `encode`'s NCHW image
        latents (a clip's NCTHW latents need a frame axis: [:, None])."""
        shape = [vae.config.z_dim, 1, 1]
        return tuple(np.asarray(vae.config[key], np.float32).reshape(shape) for key in self.scale_keys)

    def normalised_view(self, vae: Layer, posterior) -> Optional[Tensor]:
        return posterior.mode().astype("float32")  # what the pipelines normalise (sample_mode="argmax")

    def protocol_items(self, measured_view: bool) -> Tuple[Tuple[str, str], ...]:
        if not measured_view:
            return ()
        return (("latent normalisation statistics", "per channel of the posterior mode (what the Wan / Qwen-Image "
                 "pipelines normalise by latents_mean / latents_std), population mean and std over all images and "
                 "positions"),)

    # ---- the latent scale: latents_mean / latents_std, of the posterior modes
    def measured_scale(self, config: Mapping[str, Any], stats) -> Dict[str, Any]:
        if stats.patchified_mode_mean is None:
            raise ValueError("measuring latents_mean / latents_std needs the posterior modes' statistics")
        return {"latents_mean": list(stats.patchified_mode_mean),
                "latents_std": [float(np.sqrt(v)) for v in stats.patchified_mode_var]}

    def scale_record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        values = {key: list(updates.get(key, vae.config[key])) for key in self.scale_keys}
        return {"class": self.class_name, "latent_normalisation": {**values, "normalisation": NORMALISATION}}

    def scale_text(self, record: Mapping[str, Any]) -> str:
        return f"latents_mean / latents_std of {len(record['latent_normalisation']['latents_mean'])} channels"

    def measured_record(self, stats) -> Dict[str, Any]:
        return {"statistic": "per channel of the posterior mode, population mean and std over all images and "
                             "positions (what latents_mean / latents_std hold)",
                "mode_mean": stats.patchified_mode_mean,
                "mode_std": [float(np.sqrt(v)) for v in stats.patchified_mode_var or []],
                "latent_mean": stats.latent_mean, "latent_std": stats.latent_std}

    # ---- the export
    def exported_values(self, vae: Layer, posterior_std: float, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """With --posterior_std, quant_conv's log-variance outputs set to that constant (training ignored them)."""
        if not posterior_std or posterior_std <= 0:
            return {}
        return constant_logvar_values(vae, "quant_conv.", vae.config.z_dim, posterior_std)


class WanFamily(CausalVideoFamily):
    class_name = "AutoencoderKLWan"
    network = AutoencoderKLWan
    patch_key = "patch_size"
    retired_keys = ("clip_output",)  # Wan2.2-TI2V-5B's vae/ has it (diffusers 0.35); 0.42 always clamps the decode
    tiling_method = diffusers_tiling("AutoencoderKLWan", "; Wan 2.2's encoder tiles count 2x2-patchified pixels")

    def owns(self, config: Mapping[str, Any]) -> bool:
        return "z_dim" in config and "input_channels" not in config


class QwenImageFamily(CausalVideoFamily):
    class_name = "AutoencoderKLQwenImage"
    network = AutoencoderKLQwenImage
    tiling_method = diffusers_tiling("AutoencoderKLQwenImage")

    def owns(self, config: Mapping[str, Any]) -> bool:
        return "z_dim" in config and "input_channels" in config


WAN = WanFamily()
QWEN_IMAGE = QwenImageFamily()
