"""Qwen-Image 2.1's VAE in Paddle: diffusers' `AutoencoderKLQwenImage21` (0.42.1).

It is Wan 2.2's residual VAE (autoencoder_kl_wan.py) specialised to images: RGBA in and out (`in_channels` /
`out_channels` 4), z_dim 64, a wider decoder (`decoder_base_dim`), spatial factor 16 (`scale_factor_spatial`), the
pipeline's per-channel `latents_mean` / `latents_std` in the config. diffusers made every "causal 3D" conv a 2D conv
on the one frame (weights (O, I, kh, kw), no temporal taps) and dropped the feature cache, so the model takes one
frame and only one.

This file owns what differs from Wan because of that: the frame-folding conv (`QwenImage21CausalConv3d`), the
resampler (its `time_conv` is a 1x1 conv that one frame never reaches), the residual, mid, down and up blocks built
from them, the encoder and decoder, and `AutoencoderKLQwenImage21`. Parameter names and shapes are diffusers', so
ppdiffusers' `convert_pytorch_state_dict_to_paddle` reads a diffusers folder as it is and
`save_pretrained(dir, to_diffusers=True)` writes one diffusers loads (no `paddle.nn.Linear`: nothing is transposed).

Reused from autoencoder_kl_wan.py, because the math and parameters are the same: `WanRMSNorm` (narrow floats are
normalised in float32, as diffusers does), `WanAttentionBlock`, `AvgDown3D` / `DupUp3D` (the residual stages'
parameter-free shortcuts), `WanUpsample2x`, `patchify` / `unpatchify`, `DiagonalGaussianDistribution`, and
`CausalVideoVAE`'s encode / decode / forward, tiling (diffusers' blending; a tiled decode is clamped, as diffusers'
Qwen-Image 2.1 does), slicing and fine-tuning handles.

Input: images on [-1, 1], (N, in_channels, H, W) or one-frame clips (N, in_channels, 1, H, W); the posterior and the
decode keep the input's rank (4-D in, 4-D out). With in_channels 4 a 3-channel image cannot be encoded (conv_in's
weight has 4 input channels); add an alpha channel (1.0 on [-1, 1]: opaque), as the pipeline's RGBA conversion does.

What a trainer needs (methods, CausalVideoVAE's names):
    encode(x).latent_dist  DiagonalGaussianDistribution of the 2 * z_dim moments (`_encode(x)`: the moments)
    decode(z, clamp=False) the decoder's output before diffusers' clamp to [-1, 1] (clamp=True: clamped)
    decoder_last_layer()   decoder.conv_out.weight (out_channels, C, 3, 3)
    encoder_last_layer()   quant_conv, the 1x1 conv making mean and log-variance from encoder.conv_out's output
    encoder_side_modules() ("encoder", encoder), ("quant_conv", quant_conv); the rest is the decoder side
    checkpoint_segments()  every encoder down block, the encoder's mid block, every decoder up block, the decoder's mid
                           block: pure functions of their input, so recompute may re-run them in the backward
    video_only_weights()   the `time_conv` weight and bias of each temporal resampler, which no pass reaches
                           (no gradient: keep them out of weight decay to keep them as loaded)

Where this port knowingly differs from diffusers 0.42.1:
    - frames: diffusers encodes a clip of 2-4 frames as its first frame alone (its encoder takes frame 0, then
      4-frame chunks, which its convs refuse), and fails on 4-D input; here 4-D input is an image and any frame count
      but 1 is a ValueError.
    - attn_scales non-empty (no published config has one): diffusers' encoder calls its down-block attention with
      cache arguments the attention does not take (TypeError); here the attention runs.
    - `latent_dist.kl()` / `nll()` sum over every non-batch axis (autoencoder_kl_wan.DiagonalGaussianDistribution).
    - fresh weights use Paddle's default initialisers; loaded weights are what count.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import paddle
from paddle import nn
from ppdiffusers.configuration_utils import register_to_config
from ppdiffusers.models.activations import get_activation
from ppdiffusers.models.vae import DecoderOutput

from .autoencoder_kl_wan import (AvgDown3D, CausalVideoVAE, DiagonalGaussianDistribution, DupUp3D, VideoOnlyWeight,
                                 WanAttentionBlock, WanResample, WanRMSNorm, WanUpsample2x, _per_frame)

__all__ = ["AutoencoderKLQwenImage21", "DiagonalGaussianDistribution", "QWENIMAGE21_LATENTS_MEAN",
           "QWENIMAGE21_LATENTS_STD"]


def require_one_frame(x: paddle.Tensor, where: str) -> None:
    """Qwen-Image 2.1's layers fold away a frame axis of length 1; anything else is refused."""
    if x.ndim != 5 or x.shape[2] != 1:
        raise ValueError(f"{where}: Qwen-Image 2.1's VAE takes images, (N, C, H, W) or one-frame (N, C, 1, H, W); "
                         f"got shape {list(x.shape)}")


# ---- layers

class QwenImage21CausalConv3d(nn.Conv2D):
    """diffusers' image form of Wan's causal conv: a 2D conv on the single frame of (B, C, 1, H, W), zero-padded
    symmetrically in space. It is what Wan's causal conv computes on one frame with no cache (only the last temporal
    tap meets data), with that tap alone stored."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]],
                 stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int]] = 0) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        require_one_frame(x, type(self).__name__)
        return super().forward(x.squeeze(2)).unsqueeze(2)


class QwenImage21Resample(nn.Layer):
    """Spatial 2x up- or downsampling of the frame (`resample`: Wan's, same layers). The 3d modes also hold a 1x1
    `time_conv` (2C channels up, C down) that diffusers keeps from Wan's temporal resamplers: on the first frame
    Wan skips it, and a one-frame model never gets past the first, so it only has to be in the state dict."""

    MODES = WanResample.MODES

    def __init__(self, dim: int, mode: str, upsample_out_dim: Optional[int] = None) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"resample mode {mode!r}: one of {self.MODES}")
        self.dim = dim
        self.mode = mode
        out_dim = dim // 2 if upsample_out_dim is None else upsample_out_dim
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(WanUpsample2x(), nn.Conv2D(dim, out_dim, 3, padding=1))
        else:  # right / bottom zero pad then stride 2: the (H/2, W/2) grid diffusers uses
            self.resample = nn.Sequential(nn.Pad2D([0, 1, 0, 1]), nn.Conv2D(dim, dim, 3, stride=2))
        if mode == "upsample3d":
            self.time_conv = QwenImage21CausalConv3d(dim, dim * 2, 1)
        elif mode == "downsample3d":
            self.time_conv = QwenImage21CausalConv3d(dim, dim, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return _per_frame(self.resample, x)


class QwenImage21ResidualBlock(nn.Layer):
    """norm1 -> act -> conv1 -> norm2 -> act -> dropout -> conv2, plus the input (conv_shortcut when widths differ)."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        # vae_trainer.models' import gave Paddle's SiLU a finite backward below -88 (activations.py).
        self.nonlinearity = get_activation("silu")
        self.norm1 = WanRMSNorm(in_dim, images=False)
        self.conv1 = QwenImage21CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = WanRMSNorm(out_dim, images=False)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = QwenImage21CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = QwenImage21CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shortcut = self.conv_shortcut(x)
        x = self.conv1(self.nonlinearity(self.norm1(x)))
        x = self.dropout(self.nonlinearity(self.norm2(x)))
        return self.conv2(x) + shortcut


class QwenImage21MidBlock(nn.Layer):
    """resnets[0], then per layer an attention (Wan's) and a resnet."""

    def __init__(self, dim: int, dropout: float = 0.0, num_layers: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.resnets = nn.LayerList([QwenImage21ResidualBlock(dim, dim, dropout) for _ in range(num_layers + 1)])
        self.attentions = nn.LayerList([WanAttentionBlock(dim) for _ in range(num_layers)])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.resnets[0](x)
        for attention, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attention(x))
        return x


class QwenImage21ResidualDownBlock(nn.Layer):
    """An encoder stage (is_residual): resnets and a downsampler, plus the AvgDown3D shortcut of the stage's input. A
    temporal stage's shortcut pads the frame with a zero frame in front and averages the two, as diffusers does."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float, num_res_blocks: int,
                 temperal_downsample: bool = False, down_flag: bool = False) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown3D(in_dim, out_dim, factor_t=2 if temperal_downsample else 1,
                                      factor_s=2 if down_flag else 1)
        self.resnets = nn.LayerList([QwenImage21ResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout)
                                     for k in range(num_res_blocks)])
        mode = "downsample3d" if temperal_downsample else "downsample2d"
        self.downsampler = QwenImage21Resample(out_dim, mode=mode) if down_flag else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
        return x + shortcut


class QwenImage21ResidualUpBlock(nn.Layer):
    """A decoder stage (is_residual): resnets and an upsampler (to out_dim), plus the DupUp3D shortcut of its input,
    of which a temporal stage keeps the last of its two frames (diffusers' first chunk: one frame stays one)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float = 0.0,
                 temperal_upsample: bool = False, up_flag: bool = False) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.avg_shortcut = (DupUp3D(in_dim, out_dim, factor_t=2 if temperal_upsample else 1, factor_s=2)
                             if up_flag else None)
        self.resnets = nn.LayerList([QwenImage21ResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout)
                                     for k in range(num_res_blocks + 1)])
        mode = "upsample3d" if temperal_upsample else "upsample2d"
        self.upsampler = QwenImage21Resample(out_dim, mode=mode, upsample_out_dim=out_dim) if up_flag else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shortcut = self.avg_shortcut(x, first_chunk=True) if self.avg_shortcut is not None else None
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsampler is not None:
            x = self.upsampler(x)
        return x if shortcut is None else x + shortcut


class QwenImage21UpBlock(nn.Layer):
    """A decoder stage (not is_residual): num_res_blocks + 1 resnets, then `upsamplers[0]` (halving the width) if
    any."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float = 0.0,
                 upsample_mode: Optional[str] = None) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.resnets = nn.LayerList([QwenImage21ResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout)
                                     for k in range(num_res_blocks + 1)])
        self.upsamplers = nn.LayerList([QwenImage21Resample(out_dim, mode=upsample_mode)]) if upsample_mode else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class QwenImage21Encoder3d(nn.Layer):
    """conv_in, down_blocks, mid_block, norm_out, act, conv_out (z_dim channels: the model asks for 2 * z_dim).

    is_residual (the published config): one QwenImage21ResidualDownBlock per stage. Otherwise down_blocks is flat
    (resnets, an attention after each resnet at the scales in attn_scales, a resampler between stages)."""

    def __init__(self, in_channels: int = 3, dim: int = 128, z_dim: int = 4, dim_mult: Sequence[int] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, attn_scales: Sequence[float] = (),
                 temperal_downsample: Sequence[bool] = (True, True, False), dropout: float = 0.0,
                 is_residual: bool = False) -> None:
        super().__init__()
        self.nonlinearity = get_activation("silu")
        dims = [dim * u for u in [1, *dim_mult]]
        last = len(dim_mult) - 1
        self.conv_in = QwenImage21CausalConv3d(in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.LayerList()
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if is_residual:
                self.down_blocks.append(QwenImage21ResidualDownBlock(
                    in_dim, out_dim, dropout, num_res_blocks,
                    temperal_downsample=temperal_downsample[i] if i != last else False, down_flag=i != last))
                continue
            for _ in range(num_res_blocks):
                self.down_blocks.append(QwenImage21ResidualBlock(in_dim, out_dim, dropout))
                if scale in attn_scales:
                    self.down_blocks.append(WanAttentionBlock(out_dim))
                in_dim = out_dim
            if i != last:
                mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
                self.down_blocks.append(QwenImage21Resample(out_dim, mode=mode))
                scale /= 2.0
        self.mid_block = QwenImage21MidBlock(dims[-1], dropout, num_layers=1)
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = QwenImage21CausalConv3d(dims[-1], z_dim, 3, padding=1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.conv_in(x)
        for layer in self.down_blocks:
            x = layer(x)
        x = self.mid_block(x)
        return self.conv_out(self.nonlinearity(self.norm_out(x)))


class QwenImage21Decoder3d(nn.Layer):
    """conv_in, mid_block, up_blocks, norm_out, act, conv_out (out_channels: the image, patchified if patch_size).

    Stages without is_residual halve their widths in the upsampler, so each stage after the first starts at half
    the width listed for it; residual ones keep theirs. attn_scales is taken and unused, as in diffusers: the
    decoder's only attention is the mid block's."""

    def __init__(self, dim: int = 128, z_dim: int = 4, dim_mult: Sequence[int] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, attn_scales: Sequence[float] = (),
                 temperal_upsample: Sequence[bool] = (False, True, True), dropout: float = 0.0,
                 out_channels: int = 3, is_residual: bool = False) -> None:
        super().__init__()
        self.nonlinearity = get_activation("silu")
        dims = [dim * u for u in [dim_mult[-1], *dim_mult[::-1]]]
        last = len(dim_mult) - 1
        self.conv_in = QwenImage21CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = QwenImage21MidBlock(dims[0], dropout, num_layers=1)
        self.up_blocks = nn.LayerList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != last
            if is_residual:
                self.up_blocks.append(QwenImage21ResidualUpBlock(
                    in_dim, out_dim, num_res_blocks, dropout, temperal_upsample=temperal_upsample[i] if up else False,
                    up_flag=up))
                continue
            mode = ("upsample3d" if temperal_upsample[i] else "upsample2d") if up else None
            self.up_blocks.append(QwenImage21UpBlock(in_dim // 2 if i > 0 else in_dim, out_dim, num_res_blocks,
                                                     dropout, upsample_mode=mode))
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = QwenImage21CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.mid_block(self.conv_in(x))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.nonlinearity(self.norm_out(x)))


# ---- the model

# The published per-channel statistics of the 64 latent channels (the posterior mode's; the pipeline normalises
# by them): diffusers' defaults.
QWENIMAGE21_LATENTS_MEAN = [
    0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732, 0.7562,
    -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464, -0.5236, 1.2826,
    3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555, 0.0746, -3.0751, -0.1076,
    1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729, -2.0595, 1.0960, -1.3260, -2.0211,
    -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632, 0.5547, -1.7121, -0.1562, 0.0304]
QWENIMAGE21_LATENTS_STD = [
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904, 2.8778, 3.7675,
    3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513, 3.9323, 3.4719,
    3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063, 5.1125, 3.5327, 4.7833,
    3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.0550, 5.5614, 4.2963, 4.4080, 3.4959,
    3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161]


class AutoencoderKLQwenImage21(CausalVideoVAE):
    """diffusers' AutoencoderKLQwenImage21 (0.42.1): same constructor, config keys, parameter names and outputs, on
    images (module docstring: input ranks and channels, the frame rule, the trainer's handles)."""

    @register_to_config
    def __init__(self, base_dim: int = 96, decoder_base_dim: Optional[int] = 144, z_dim: int = 64,
                 dim_mult: List[int] = [1, 2, 4, 8, 8], num_res_blocks: int = 2, attn_scales: List[float] = [],
                 temperal_downsample: List[bool] = [False, True, True, True], dropout: float = 0.0,
                 latents_mean: List[float] = QWENIMAGE21_LATENTS_MEAN,
                 latents_std: List[float] = QWENIMAGE21_LATENTS_STD, is_residual: bool = True, in_channels: int = 4,
                 out_channels: int = 4, patch_size: Optional[int] = None, scale_factor_temporal: Optional[int] = 8,
                 scale_factor_spatial: Optional[int] = 16) -> None:
        super().__init__()
        self.z_dim = z_dim
        self.temperal_downsample = list(temperal_downsample)
        self.temperal_upsample = list(temperal_downsample)[::-1]
        self.encoder = QwenImage21Encoder3d(in_channels=in_channels, dim=base_dim, z_dim=z_dim * 2, dim_mult=dim_mult,
                                            num_res_blocks=num_res_blocks, attn_scales=attn_scales,
                                            temperal_downsample=temperal_downsample, dropout=dropout,
                                            is_residual=is_residual)
        self.quant_conv = QwenImage21CausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = QwenImage21CausalConv3d(z_dim, z_dim, 1)
        self.decoder = QwenImage21Decoder3d(dim=base_dim if decoder_base_dim is None else decoder_base_dim,
                                            z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=num_res_blocks,
                                            attn_scales=attn_scales, temperal_upsample=self.temperal_upsample,
                                            dropout=dropout, out_channels=out_channels, is_residual=is_residual)
        # diffusers trusts the stated factor (tiling divides by it); the architecture's is 2 ** (len(dim_mult) - 1)
        # times patch_size.
        self.spatial_compression_ratio = scale_factor_spatial
        if patch_size is not None and scale_factor_spatial is not None and scale_factor_spatial % patch_size:
            raise ValueError(f"scale_factor_spatial ({scale_factor_spatial}) must be a multiple of patch_size "
                             f"({patch_size})")
        self._init_runtime_options()
        # No clips, so no chunk passes: CausalVideoVAE's clip path must never run here.
        self.encoder_pass = self.decoder_pass = None

    # -- one frame in, one frame through

    def run_encoder(self, x: paddle.Tensor, cached: Optional[bool] = None) -> paddle.Tensor:
        """The encoder on a (patchified) one-frame clip. There is no cache: `cached` is taken for CausalVideoVAE's
        signature and changes nothing (the one-frame path is the only path)."""
        require_one_frame(x, "encode")
        return self.encoder(x)

    def run_decoder(self, x: paddle.Tensor, cached: Optional[bool] = None) -> paddle.Tensor:
        """The decoder on post_quant_conv's output, one latent frame (`cached`: as run_encoder's)."""
        require_one_frame(x, "decode")
        return self.decoder(x)

    def _encode(self, x: paddle.Tensor) -> paddle.Tensor:
        """Mean and log-variance (2 * z_dim channels) of images (N, C, H, W) or (N, C, 1, H, W), the input's rank
        kept."""
        image = x.ndim == 4
        x = x.unsqueeze(2) if image else x
        require_one_frame(x, "encode")
        channels = self.config.in_channels // self.patch_size ** 2
        if x.shape[1] != channels:
            raise ValueError(f"encode: this VAE takes {channels}-channel images (in_channels {self.config.in_channels}"
                             f"{', patch_size %d' % self.patch_size if self.patch_size > 1 else ''}), got "
                             f"{x.shape[1]}" + ("; give RGB an alpha channel (1.0 = opaque on [-1, 1])"
                                                if (x.shape[1], channels) == (3, 4) else ""))
        moments = super()._encode(x)
        return moments.squeeze(2) if image else moments

    def _decode(self, z: paddle.Tensor, return_dict: bool = True, clamp: bool = True
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """Pixels of latents (N, z_dim, h, w) or (N, z_dim, 1, h, w), the rank kept; `clamp=False`: the decoder's
        output before diffusers' clamp to [-1, 1]."""
        image = z.ndim == 4
        out = super()._decode(z.unsqueeze(2) if image else z, clamp=clamp).sample
        out = out.squeeze(2) if image else out
        return DecoderOutput(sample=out) if return_dict else (out,)

    # -- what fine-tuning needs

    def video_only_weights(self) -> List[VideoOnlyWeight]:
        """The weights no pass of this model reaches: each temporal resampler's 1x1 time_conv (weight and bias)."""
        out = []
        for name, layer in self.named_sublayers():
            if isinstance(layer, QwenImage21Resample) and hasattr(layer, "time_conv"):
                out += [VideoOnlyWeight(f"{name}.time_conv.weight"), VideoOnlyWeight(f"{name}.time_conv.bias")]
        return out

    def checkpoint_segments(self) -> List[Tuple[str, Any]]:
        """(name, block) that gradient checkpointing may re-run in the backward: the encoder's down blocks and mid
        block, the decoder's mid block and up blocks, each a pure function of its input (no cache, no state)."""
        out = []
        for coder_name, blocks_name in (("encoder", "down_blocks"), ("decoder", "up_blocks")):
            coder = getattr(self, coder_name)
            out += [(f"{coder_name}.{blocks_name}.{i}", block) for i, block in enumerate(getattr(coder, blocks_name))]
            out.append((f"{coder_name}.mid_block", coder.mid_block))
        return out
