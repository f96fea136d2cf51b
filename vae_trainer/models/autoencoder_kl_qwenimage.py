"""Qwen-Image's VAE in Paddle: diffusers' `AutoencoderKLQwenImage` (0.42.1).

This file owns only the class: its constructor, config keys (`input_channels` for both the input and the output,
no patchify, no `decoder_base_dim`, no residual stages) and its spatial factor (2 ** len(temperal_downsample)). Its
layers are Wan 2.1's, with the same math and parameter names, so they come from autoencoder_kl_wan.py, as do the
feature cache, the one-frame path, tiling and the fine-tuning lists; that file's docstring describes them all:

    decoder_last_layer()   decoder.conv_out.weight
    encoder_last_layer()   quant_conv
    ENCODER_SIDE           ("encoder", "quant_conv")
    video_only_weights()   encoder.down_blocks.{i}.time_conv.{weight,bias} (downsample3d stages),
                           decoder.up_blocks.{i}.upsamplers.0.time_conv.{weight,bias} (upsample3d stages), and
                           weight[:, :, :2] of every 3x3x3 causal conv (conv_in, conv_out, resnets' conv1 / conv2)

The one difference in behaviour from AutoencoderKLWan, kept because diffusers has it: a tiled decode is not clamped
to [-1, 1] (diffusers 0.42.1's AutoencoderKLQwenImage.tiled_decode returns the blended tiles as they are), while an
untiled one is.
"""

from __future__ import annotations

from typing import List

from ppdiffusers.configuration_utils import register_to_config

from .autoencoder_kl_wan import (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, CausalVideoVAE, WanCausalConv3d,
                                 WanDecoder3d, WanEncoder3d)


class AutoencoderKLQwenImage(CausalVideoVAE):
    """diffusers' AutoencoderKLQwenImage (0.42.1): same constructor, config keys, parameter names and outputs."""

    clamp_tiled_decode = False

    @register_to_config
    def __init__(self, base_dim: int = 96, z_dim: int = 16, dim_mult: List[int] = [1, 2, 4, 4],
                 num_res_blocks: int = 2, attn_scales: List[float] = [],
                 temperal_downsample: List[bool] = [False, True, True], dropout: float = 0.0,
                 input_channels: int = 3, latents_mean: List[float] = WAN21_LATENTS_MEAN,
                 latents_std: List[float] = WAN21_LATENTS_STD) -> None:
        super().__init__()
        self.z_dim = z_dim
        self.temperal_downsample = list(temperal_downsample)
        self.temperal_upsample = list(temperal_downsample)[::-1]
        self.encoder = WanEncoder3d(in_channels=input_channels, dim=base_dim, z_dim=z_dim * 2, dim_mult=dim_mult,
                                    num_res_blocks=num_res_blocks, attn_scales=attn_scales,
                                    temperal_downsample=temperal_downsample, dropout=dropout)
        self.quant_conv = WanCausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = WanCausalConv3d(z_dim, z_dim, 1)
        self.decoder = WanDecoder3d(dim=base_dim, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=num_res_blocks,
                                    attn_scales=attn_scales, temperal_upsample=self.temperal_upsample,
                                    dropout=dropout, out_channels=input_channels)
        # Each stage boundary halves H and W, temporal or not.
        self.spatial_compression_ratio = 2 ** len(self.temperal_downsample)
        self._init_runtime_options()
