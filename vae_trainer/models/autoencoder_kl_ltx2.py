"""LTX-2's video VAE in Paddle: diffusers 0.42.1's `AutoencoderKLLTX2Video`.

This module owns the model and every block it is made of: the parameter-free per-pixel RMS norm, the causal 3D conv
whose causality is chosen at run time, the ResNet block (with its optional timestep modulation and noise
injection), the space-to-channel down- and channel-to-space upsamplers, the down / mid / up blocks, the 3D encoder
and decoder, the sinusoidal timestep embedder the decoder's modulation uses, and the 4x4 patchify.

The constructor, its defaults and config keys, and every parameter and buffer name are diffusers', so that
ppdiffusers' `convert_pytorch_state_dict_to_paddle` reads a diffusers `diffusion_pytorch_model.safetensors` (it
transposes the timestep embedders' Linear weights, the only Linears) and `save_pretrained(dir, to_diffusers=True)`
writes a folder diffusers loads with no missing or unexpected key. `latents_mean` / `latents_std` are persistable
buffers (LTX-2 keeps its latent statistics in the weights, not the config); nothing here applies them: a pipeline
does (`normalize_latents`).

Shapes. Input (N, 3, T, H, W) on [-1, 1]; an image is T = 1. Unlike Wan there is no feature cache: a clip goes
through the encoder and the decoder whole, and time is padded by repeating the first frame (causal) or the first and
the last (non-causal), never with zeros. With the published layout (patch 4, downsample types spatial, temporal,
spatiotemporal, spatiotemporal) a clip must have T = 1 + 8k frames and H, W multiples of 32; `latent_shape` gives
the exact rule of any config. diffusers' `spatial_compression_ratio` / `temporal_compression_ratio` default to
patch_size * 2 ** (number of scaling blocks), 64 and 16 for that layout, not its real 32 and 8 (LTX-2's own config
sets 32 and 8); they are kept as diffusers computes them, and `latent_shape` does not read them.

Causality: `encode(x, causal=None)` / `decode(z, causal=None)` take `causal or config's`, as diffusers does, so
`causal=False` cannot make a causal coder non-causal; the published LTX-2 VAE has a causal encoder and a non-causal
decoder (`decoder_causal` False; the constructor's default is True).

One frame: every causal conv of a one-frame input sees that frame repeated over its three temporal taps (causal and
non-causal alike), so it runs as a 2D conv with the taps summed: a third of the work and activation memory, equal to
the 3D conv within float rounding, each tap getting the same gradient (as in diffusers).

Decoding does not clamp, in diffusers either: `decode(z).sample` is the decoder's raw output, which is what a
training loss needs; `clamp=True` clips it to [-1, 1] for display. LTX-2's pipelines clamp only when they post-process
a video into pixels.

Options the trainer must watch (all ported, tested against diffusers):
    timestep_conditioning  the decoder is modulated by a timestep per sample (`decode(z, temb)`, required then);
                           LTX-2's pipelines pass `decode_timestep` (0.0 by default) after mixing the latents with
                           `decode_noise_scale` parts of noise. The published LTX-2 VAE has it off.
    decoder_inject_noise   ResNet blocks of the decoder add spatial Gaussian noise: one (H, W) draw after each of
                           their two convs, shared by every sample and frame, scaled per channel by the trainable
                           per_channel_scale1 / 2 (zero at first). It comes from the global RNG (diffusers never passes
                           a generator to it; `decode(..., generator=)` may here). The flags are listed encoder-side
                           first (the last one is the mid block's), as in diffusers. Such blocks are not pure functions
                           of their inputs, so `checkpoint_segments` leaves them out. Published: off.

Where this port knowingly differs from diffusers 0.42.1:
    - half precision: the per-pixel RMS norm and the shortcut's LayerNorm are computed in float32 and cast back
      (diffusers computes its RMS norm in the input's dtype, where x ** 2 overflows float16 above |x| = 256);
    - no spatial or temporal tiling and no framewise encode / decode (inference memory savers; `enable_tiling`
      raises); slicing is ported, with the timestep split per sample (diffusers' sliced decode with a timestep
      iterates over a 2-tuple instead of zipping, and fails);
    - ppdiffusers' `enable_gradient_checkpointing` is not wired: recompute goes through `checkpoint_segments`;
    - `latent_dist.kl()` / `nll()` sum over every non-batch axis (autoencoder_kl_wan's DiagonalGaussianDistribution);
    - fresh weights use Paddle's default initialisers; loaded weights are what count.
"""

from __future__ import annotations

import glob
import math
import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import paddle
import paddle.nn.functional as F
from paddle import nn
from ppdiffusers.configuration_utils import ConfigMixin, register_to_config
from ppdiffusers.models.activations import get_activation
from ppdiffusers.models.modeling_outputs import AutoencoderKLOutput
from ppdiffusers.models.modeling_utils import ModelMixin
from ppdiffusers.models.vae import DecoderOutput
from ppdiffusers.utils import randn_tensor

from .autoencoder_kl_hunyuanvideo15 import VideoOnlyChannels
from .autoencoder_kl_wan import DiagonalGaussianDistribution

HALF_DTYPES = (paddle.float16, paddle.bfloat16)
RMS_EPS = 1e-8  # diffusers' PerChannelRMSNorm default, the only one LTX-2 uses
TIMESTEP_FEATURES = 256  # width of the sinusoidal timestep features (PixArt-alpha's)
# Temporal, height and width strides of each downsample / upsample type.
STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2), "conv": (2, 2, 2)}
# diffusers' padding_mode names -> paddle.nn.functional.pad's.
PAD_MODES = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}

IntOrTriple = Union[int, Tuple[int, int, int]]
BoolOrSeq = Union[bool, Sequence[bool]]


def _triple(value: IntOrTriple) -> Tuple[int, int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value, value)


def _per_block(value: BoolOrSeq, count: int) -> Tuple[bool, ...]:
    """A flag given once for all blocks, or per block (diffusers accepts both)."""
    return (value,) * count if isinstance(value, bool) else tuple(value)


# ---------------------------------------------------------------------------------------------------- norms


class PerChannelRMSNorm(nn.Layer):
    """x / sqrt(mean over the channels of x ** 2 + eps), at every pixel and frame; no parameters. Half precision is
    normalised in float32 (see the module docstring)."""

    def __init__(self, channel_dim: int = 1, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.channel_dim = channel_dim
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        upcast = x.dtype in HALF_DTYPES
        values = x.astype("float32") if upcast else x
        out = values / paddle.sqrt(values.square().mean(axis=self.channel_dim, keepdim=True) + self.eps)
        return out.astype(x.dtype) if upcast else out


class ChannelLayerNorm(nn.LayerNorm):
    """diffusers' `nn.LayerNorm(C)` applied to (N, C, T, H, W) by moving the channels last and back (the shortcut's
    norm3). Half inputs are normalised in float32 with float32 weights."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        last = x.transpose([0, 2, 3, 4, 1])
        upcast = x.dtype in HALF_DTYPES
        weight, bias = self.weight, self.bias
        if upcast:
            last, weight, bias = last.astype("float32"), weight.astype("float32"), bias.astype("float32")
        out = F.layer_norm(last, self._normalized_shape, weight, bias, self._epsilon)
        return out.astype(x.dtype).transpose([0, 4, 1, 2, 3])


# ---------------------------------------------------------------------------------------------------- conv


class LTX2VideoCausalConv3d(nn.Layer):
    """A Conv3D (`conv`, diffusers' name) padded in space by its padding mode and in time by repeating frames:
    causal, the first frame k_t - 1 times in front; non-causal, the first and the last (k_t - 1) // 2 times each."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTriple = 3, stride: IntOrTriple = 1,
                 dilation: IntOrTriple = 1, groups: int = 1, spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        if spatial_padding_mode != "zeros" and spatial_padding_mode not in PAD_MODES:
            raise ValueError(f"spatial_padding_mode {spatial_padding_mode!r}: one of zeros, {', '.join(PAD_MODES)}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _triple(kernel_size)
        # An int dilation dilates time only, as in diffusers.
        dilation = tuple(dilation) if isinstance(dilation, (tuple, list)) else (dilation, 1, 1)
        self.spatial_pad = (self.kernel_size[1] // 2, self.kernel_size[2] // 2)
        self.spatial_padding_mode = spatial_padding_mode
        # Zeros are the conv's own padding; the other modes pad first (Paddle's Conv3D takes them only for an int
        # padding, which would pad time too).
        own_padding = [0, *self.spatial_pad] if spatial_padding_mode == "zeros" else 0
        self.conv = nn.Conv3D(in_channels, out_channels, self.kernel_size, stride=_triple(stride), padding=own_padding,
                              dilation=dilation, groups=groups)

    def forward(self, x: paddle.Tensor, causal: bool = True) -> paddle.Tensor:
        if x.shape[2] == 1 and self._one_frame_is_2d():
            return self._one_frame(x)
        return self.conv(self._pad_space(self._pad_time(x, causal)))

    def _pad_time(self, x: paddle.Tensor, causal: bool) -> paddle.Tensor:
        extra = self.kernel_size[0] - 1
        if extra == 0:
            return x
        if causal:
            return paddle.concat([x[:, :, :1].tile([1, 1, extra, 1, 1]), x], axis=2)
        side = extra // 2
        return paddle.concat([x[:, :, :1].tile([1, 1, side, 1, 1]), x, x[:, :, -1:].tile([1, 1, side, 1, 1])], axis=2)

    def _pad_space(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.spatial_padding_mode == "zeros" or not any(self.spatial_pad):
            return x
        ph, pw = self.spatial_pad
        return F.pad(x, [pw, pw, ph, ph, 0, 0], mode=PAD_MODES[self.spatial_padding_mode], data_format="NCDHW")

    def _one_frame_is_2d(self) -> bool:
        """One frame padded to k_t copies meets every tap once: true for an odd k_t (3 here) and no time dilation."""
        return self.kernel_size[0] % 2 == 1 and self.conv._dilation[0] == 1 and self.conv._groups == 1

    def _one_frame(self, x: paddle.Tensor) -> paddle.Tensor:
        """The conv of one frame repeated over the kernel's taps: a 2D conv with the taps summed."""
        conv = self.conv
        padding = conv._padding[1:] if self.spatial_padding_mode == "zeros" else 0
        frame = self._pad_space(x)[:, :, 0]
        out = F.conv2d(frame, conv.weight.sum(axis=2), conv.bias, stride=conv._stride[1:], padding=padding,
                       dilation=conv._dilation[1:])
        return out.unsqueeze(2)


# ---------------------------------------------------------------------------------------------------- reshapes


def space_time_to_channels(x: paddle.Tensor, stride: Sequence[int]) -> paddle.Tensor:
    """(N, C, T, H, W) -> (N, C * s_t * s_h * s_w, T / s_t, H / s_h, W / s_w), channel (c, t, h, w) ordered."""
    st, sh, sw = stride
    n, c, t, h, w = x.shape
    x = x.reshape([n, c, t // st, st, h // sh, sh, w // sw, sw]).transpose([0, 1, 3, 5, 7, 2, 4, 6])
    return x.reshape([n, c * st * sh * sw, t // st, h // sh, w // sw])


def channels_to_space_time(x: paddle.Tensor, stride: Sequence[int]) -> paddle.Tensor:
    """The inverse of `space_time_to_channels`."""
    st, sh, sw = stride
    n, c, t, h, w = x.shape
    c //= st * sh * sw
    x = x.reshape([n, c, st, sh, sw, t, h, w]).transpose([0, 1, 5, 2, 6, 3, 7, 4])
    return x.reshape([n, c, t * st, h * sh, w * sw])


def patchify(x: paddle.Tensor, patch_size: int, patch_size_t: int = 1) -> paddle.Tensor:
    """(N, C, T, H, W) pixels -> (N, C * p_t * p * p, T / p_t, H / p, W / p). Within a channel's patch block the
    column offset comes before the row offset (diffusers' order, unlike `space_time_to_channels`)."""
    p, pt = patch_size, patch_size_t
    n, c, t, h, w = x.shape
    x = x.reshape([n, c, t // pt, pt, h // p, p, w // p, p]).transpose([0, 1, 3, 7, 5, 2, 4, 6])
    return x.reshape([n, c * pt * p * p, t // pt, h // p, w // p])


def unpatchify(x: paddle.Tensor, patch_size: int, patch_size_t: int = 1) -> paddle.Tensor:
    """The inverse of `patchify`."""
    p, pt = patch_size, patch_size_t
    n, cpp, t, h, w = x.shape
    c = cpp // (pt * p * p)
    x = x.reshape([n, c, pt, p, p, t, h, w]).transpose([0, 1, 5, 2, 6, 4, 7, 3])
    return x.reshape([n, c, t * pt, h * p, w * p])


# ---------------------------------------------------------------------------------------------------- timesteps


def timestep_features(timesteps: paddle.Tensor, dim: int = TIMESTEP_FEATURES) -> paddle.Tensor:
    """diffusers' `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`: (N,) -> (N, dim),
    cosines then sines of t * 10000 ** (-k / (dim / 2)), in float32."""
    half = dim // 2
    frequencies = paddle.exp(-math.log(10000) * paddle.arange(half, dtype="float32") / half)
    angles = timesteps.astype("float32")[:, None] * frequencies[None, :]
    features = paddle.concat([paddle.cos(angles), paddle.sin(angles)], axis=-1)
    return F.pad(features, [0, 1]) if dim % 2 else features


class TimestepEmbedding(nn.Layer):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding with its defaults)."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.Silu()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample: paddle.Tensor) -> paddle.Tensor:
        return self.linear_2(self.act(self.linear_1(sample)))


class PixArtAlphaCombinedTimestepSizeEmbeddings(nn.Layer):
    """diffusers' embedder of that name as LTX-2 builds it (size_emb_dim 0, no additional conditions): sinusoidal
    features of the timestep, then `timestep_embedder`."""

    def __init__(self, embedding_dim: int, size_emb_dim: int = 0) -> None:
        super().__init__()
        self.outdim = size_emb_dim
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_FEATURES, embedding_dim)

    def forward(self, timestep: paddle.Tensor, hidden_dtype: Any = None) -> paddle.Tensor:
        features = timestep_features(timestep)
        return self.timestep_embedder(features.astype(hidden_dtype) if hidden_dtype is not None else features)


def _embedded_timestep(embedder: PixArtAlphaCombinedTimestepSizeEmbeddings, temb: paddle.Tensor,
                       hidden: paddle.Tensor) -> paddle.Tensor:
    """The embedding of one timestep per sample, shaped (N, D, 1, 1, 1) to broadcast over (T, H, W)."""
    embedded = embedder(temb.flatten(), hidden_dtype=hidden.dtype)
    return embedded.reshape([hidden.shape[0], -1, 1, 1, 1])


# ---------------------------------------------------------------------------------------------------- blocks


def spatial_noise(shape: Sequence[int], dtype: Any, generator: Optional[paddle.Generator] = None) -> paddle.Tensor:
    """The (H, W) standard normal draw a noise-injecting ResNet block adds (tests replace it to match diffusers'
    draws)."""
    return randn_tensor(list(shape), generator=generator, dtype=dtype)


class LTX2VideoResnetBlock3d(nn.Layer):
    """norm1 -> [modulation] -> act -> conv1 -> [noise] -> norm2 -> [modulation] -> act -> dropout -> conv2 ->
    [noise], plus the input (through norm3, a LayerNorm, and a 1x1x1 conv_shortcut when the widths differ).

    Modulation (timestep_conditioning): shift / scale pairs from the embedded timestep plus `scale_shift_table`.
    Noise (inject_noise): `spatial_noise` of the frame size times `per_channel_scale1` / `2`."""

    def __init__(self, in_channels: int, out_channels: Optional[int] = None, dropout: float = 0.0, eps: float = 1e-6,
                 elementwise_affine: bool = False, non_linearity: str = "swish", inject_noise: bool = False,
                 timestep_conditioning: bool = False, spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        out_channels = out_channels or in_channels
        self.nonlinearity = get_activation(non_linearity)
        self.norm1 = PerChannelRMSNorm()
        self.conv1 = LTX2VideoCausalConv3d(in_channels, out_channels, 3, spatial_padding_mode=spatial_padding_mode)
        self.norm2 = PerChannelRMSNorm()
        self.dropout = nn.Dropout(dropout)
        self.conv2 = LTX2VideoCausalConv3d(out_channels, out_channels, 3, spatial_padding_mode=spatial_padding_mode)
        self.norm3 = None
        self.conv_shortcut = None
        if in_channels != out_channels:
            self.norm3 = ChannelLayerNorm(in_channels, epsilon=eps)
            self.conv_shortcut = nn.Conv3D(in_channels, out_channels, 1)  # a plain conv: no time padding at 1x1x1
        self.per_channel_scale1 = None
        self.per_channel_scale2 = None
        if inject_noise:
            zeros = nn.initializer.Constant(0.0)
            self.per_channel_scale1 = self.create_parameter([in_channels, 1, 1], default_initializer=zeros)
            self.per_channel_scale2 = self.create_parameter([in_channels, 1, 1], default_initializer=zeros)
        self.scale_shift_table = None
        if timestep_conditioning:
            self.scale_shift_table = self.create_parameter(
                [4, in_channels], default_initializer=nn.initializer.Normal(0.0, in_channels ** -0.5))

    def forward(self, inputs: paddle.Tensor, temb: Optional[paddle.Tensor] = None,
                generator: Optional[paddle.Generator] = None, causal: bool = True) -> paddle.Tensor:
        shift_1, scale_1, shift_2, scale_2 = self._modulation(temb)
        x = self.norm1(inputs)
        if scale_1 is not None:
            x = x * (1 + scale_1) + shift_1
        x = self.conv1(self.nonlinearity(x), causal=causal)
        x = self._with_noise(x, self.per_channel_scale1, generator)
        x = self.norm2(x)
        if scale_2 is not None:
            x = x * (1 + scale_2) + shift_2
        x = self.conv2(self.dropout(self.nonlinearity(x)), causal=causal)
        x = self._with_noise(x, self.per_channel_scale2, generator)
        return x + self._shortcut(inputs)

    def _modulation(self, temb: Optional[paddle.Tensor]) -> Tuple[Optional[paddle.Tensor], ...]:
        """(shift_1, scale_1, shift_2, scale_2), each (N, C, 1, 1, 1), from temb (N, 4 * C, 1, 1, 1); Nones
        without timestep conditioning."""
        if self.scale_shift_table is None:
            return None, None, None, None
        if temb is None:
            raise ValueError("timestep_conditioning: the decoder needs a timestep (decode(z, temb))")
        n = temb.shape[0]
        table = self.scale_shift_table.reshape([1, 4, -1, 1, 1, 1])
        return tuple((temb.reshape([n, 4, -1, *temb.shape[2:]]) + table).unbind(axis=1))

    def _with_noise(self, x: paddle.Tensor, scale: Optional[paddle.Tensor],
                    generator: Optional[paddle.Generator]) -> paddle.Tensor:
        if scale is None:
            return x
        # One (H, W) draw, shared by every sample and frame; each channel scales it by its own weight.
        noise = spatial_noise(x.shape[-2:], x.dtype, generator)
        return x + (noise.unsqueeze(0) * scale).unsqueeze(0).unsqueeze(2)

    def _shortcut(self, inputs: paddle.Tensor) -> paddle.Tensor:
        if self.norm3 is not None:
            inputs = self.norm3(inputs)
        return self.conv_shortcut(inputs) if self.conv_shortcut is not None else inputs


class LTX2VideoDownsampler3d(nn.Layer):
    """Downsampling by `stride` (t, h, w) with a parameter-free shortcut: the stride's cells folded into channels
    and averaged in groups to the output width; the conv's output (out / cells channels) folded the same way is
    added. Time first gets stride_t - 1 copies of its first frame in front, so 1 + 2k frames become 1 + k."""

    def __init__(self, in_channels: int, out_channels: int, stride: IntOrTriple = 1,
                 spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        self.stride = _triple(stride)
        cells = self.stride[0] * self.stride[1] * self.stride[2]
        self.group_size = in_channels * cells // out_channels
        self.conv = LTX2VideoCausalConv3d(in_channels, out_channels // cells, 3,
                                          spatial_padding_mode=spatial_padding_mode)

    def forward(self, x: paddle.Tensor, causal: bool = True) -> paddle.Tensor:
        if self.stride[0] > 1:
            x = paddle.concat([x[:, :, :self.stride[0] - 1], x], axis=2)
        folded = space_time_to_channels(x, self.stride)
        n, c, t, h, w = folded.shape
        shortcut = folded.reshape([n, c // self.group_size, self.group_size, t, h, w]).mean(axis=2)
        return space_time_to_channels(self.conv(x, causal=causal), self.stride) + shortcut


class LTX2VideoUpsampler3d(nn.Layer):
    """Upsampling by `stride`: the conv makes cells / upscale_factor times the channels, unfolded into space and
    time; the first stride_t - 1 frames are dropped (k latent frames give 1 + stride_t * (k - 1)). `residual`: the
    input unfolded the same way, its channels tiled to the output width, is added."""

    def __init__(self, in_channels: int, out_channels: Optional[int] = None, stride: IntOrTriple = 1,
                 residual: bool = False, upscale_factor: int = 1, spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        self.stride = _triple(stride)
        self.residual = residual
        self.upscale_factor = upscale_factor
        cells = self.stride[0] * self.stride[1] * self.stride[2]
        out_channels = (out_channels or in_channels) * cells // upscale_factor
        self.conv = LTX2VideoCausalConv3d(in_channels, out_channels, 3, spatial_padding_mode=spatial_padding_mode)

    def forward(self, x: paddle.Tensor, causal: bool = True) -> paddle.Tensor:
        drop = self.stride[0] - 1
        out = channels_to_space_time(self.conv(x, causal=causal), self.stride)[:, :, drop:]
        if not self.residual:
            return out
        cells = self.stride[0] * self.stride[1] * self.stride[2]
        shortcut = channels_to_space_time(x, self.stride).tile([1, cells // self.upscale_factor, 1, 1, 1])
        return out + shortcut[:, :, drop:]

    def first_frame_channels(self) -> List[int]:
        """The conv's output channels that one input frame keeps (the others unfold into the frames dropped)."""
        packed = self.conv.conv.weight.shape[0]
        probe = paddle.arange(packed, dtype="float32").reshape([1, packed, 1, 1, 1])
        kept = channels_to_space_time(probe, self.stride)[:, :, self.stride[0] - 1:]
        return sorted({int(v) for v in kept.flatten().numpy()})


def _downsampler(kind: str, in_channels: int, out_channels: int, padding_mode: str) -> nn.Layer:
    if kind == "conv":  # a strided conv that keeps the width
        return LTX2VideoCausalConv3d(in_channels, in_channels, 3, stride=(2, 2, 2), spatial_padding_mode=padding_mode)
    if kind not in STRIDES:
        raise ValueError(f"downsample_type {kind!r}: one of {', '.join(STRIDES)}")
    return LTX2VideoDownsampler3d(in_channels, out_channels, stride=STRIDES[kind], spatial_padding_mode=padding_mode)


class LTX2VideoDownBlock3D(nn.Layer):
    """Encoder stage: resnets at the input width, then `downsamplers[0]` (when spatio_temporal_scale), which makes
    the output width (the "conv" type keeps the input's)."""

    def __init__(self, in_channels: int, out_channels: Optional[int] = None, num_layers: int = 1,
                 dropout: float = 0.0, resnet_eps: float = 1e-6, resnet_act_fn: str = "swish",
                 spatio_temporal_scale: bool = True, downsample_type: str = "conv",
                 spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        out_channels = out_channels or in_channels
        self.resnets = nn.LayerList([
            LTX2VideoResnetBlock3d(in_channels, in_channels, dropout=dropout, eps=resnet_eps,
                                   non_linearity=resnet_act_fn, spatial_padding_mode=spatial_padding_mode)
            for _ in range(num_layers)])
        self.downsamplers = None
        if spatio_temporal_scale:
            self.downsamplers = nn.LayerList([_downsampler(downsample_type, in_channels, out_channels,
                                                           spatial_padding_mode)])

    def forward(self, hidden_states: paddle.Tensor, temb: Optional[paddle.Tensor] = None,
                generator: Optional[paddle.Generator] = None, causal: bool = True) -> paddle.Tensor:
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states, temb, generator, causal=causal)
        for downsampler in self.downsamplers or ():
            hidden_states = downsampler(hidden_states, causal=causal)
        return hidden_states


class LTX2VideoMidBlock3d(nn.Layer):
    """Resnets at one width; with timestep conditioning its own `time_embedder` (4 * C wide) modulates them."""

    def __init__(self, in_channels: int, num_layers: int = 1, dropout: float = 0.0, resnet_eps: float = 1e-6,
                 resnet_act_fn: str = "swish", inject_noise: bool = False, timestep_conditioning: bool = False,
                 spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        self.time_embedder = (PixArtAlphaCombinedTimestepSizeEmbeddings(in_channels * 4, 0)
                              if timestep_conditioning else None)
        self.resnets = nn.LayerList([
            LTX2VideoResnetBlock3d(in_channels, in_channels, dropout=dropout, eps=resnet_eps,
                                   non_linearity=resnet_act_fn, inject_noise=inject_noise,
                                   timestep_conditioning=timestep_conditioning,
                                   spatial_padding_mode=spatial_padding_mode)
            for _ in range(num_layers)])

    def forward(self, hidden_states: paddle.Tensor, temb: Optional[paddle.Tensor] = None,
                generator: Optional[paddle.Generator] = None, causal: bool = True) -> paddle.Tensor:
        if self.time_embedder is not None:
            temb = _embedded_timestep(self.time_embedder, _required(temb), hidden_states)
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states, temb, generator, causal=causal)
        return hidden_states


def _required(temb: Optional[paddle.Tensor]) -> paddle.Tensor:
    if temb is None:
        raise ValueError("timestep_conditioning: the decoder needs a timestep per sample (decode(z, temb))")
    return temb


class LTX2VideoUpBlock3d(nn.Layer):
    """Decoder stage: `conv_in` (a resnet, only when the widths differ), `upsamplers[0]`, then resnets at the
    output width. With timestep conditioning its `time_embedder` modulates the resnets; conv_in gets the raw
    timestep, as in diffusers (where a conditioned conv_in therefore fails; no published config has one)."""

    def __init__(self, in_channels: int, out_channels: Optional[int] = None, num_layers: int = 1,
                 dropout: float = 0.0, resnet_eps: float = 1e-6, resnet_act_fn: str = "swish",
                 spatio_temporal_scale: bool = True, upsample_type: str = "spatiotemporal",
                 inject_noise: bool = False, timestep_conditioning: bool = False, upsample_residual: bool = False,
                 upscale_factor: int = 1, spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        out_channels = out_channels or in_channels
        resnet = dict(dropout=dropout, eps=resnet_eps, non_linearity=resnet_act_fn, inject_noise=inject_noise,
                      timestep_conditioning=timestep_conditioning, spatial_padding_mode=spatial_padding_mode)
        self.time_embedder = (PixArtAlphaCombinedTimestepSizeEmbeddings(in_channels * 4, 0)
                              if timestep_conditioning else None)
        self.conv_in = LTX2VideoResnetBlock3d(in_channels, out_channels, **resnet) if in_channels != out_channels \
            else None
        self.upsamplers = None
        if spatio_temporal_scale:
            if upsample_type not in ("spatial", "temporal", "spatiotemporal"):
                raise ValueError(f"upsample_type {upsample_type!r}: one of spatial, temporal, spatiotemporal")
            self.upsamplers = nn.LayerList([LTX2VideoUpsampler3d(
                out_channels * upscale_factor, stride=STRIDES[upsample_type], residual=upsample_residual,
                upscale_factor=upscale_factor, spatial_padding_mode=spatial_padding_mode)])
        self.resnets = nn.LayerList([LTX2VideoResnetBlock3d(out_channels, out_channels, **resnet)
                                     for _ in range(num_layers)])

    def forward(self, hidden_states: paddle.Tensor, temb: Optional[paddle.Tensor] = None,
                generator: Optional[paddle.Generator] = None, causal: bool = True) -> paddle.Tensor:
        if self.conv_in is not None:
            hidden_states = self.conv_in(hidden_states, temb, generator, causal=causal)
        if self.time_embedder is not None:
            temb = _embedded_timestep(self.time_embedder, _required(temb), hidden_states)
        for upsampler in self.upsamplers or ():
            hidden_states = upsampler(hidden_states, causal=causal)
        for resnet in self.resnets:
            hidden_states = resnet(hidden_states, temb, generator, causal=causal)
        return hidden_states


# ---------------------------------------------------------------------------------------------------- coders


class LTX2VideoEncoder3d(nn.Layer):
    """patchify -> conv_in -> down_blocks -> mid_block -> norm_out -> SiLU -> conv_out (latent_channels + 1), then
    the last channel (the one log-variance shared by every latent channel) repeated: 2 * latent_channels moments."""

    def __init__(self, in_channels: int = 3, out_channels: int = 128,
                 block_out_channels: Sequence[int] = (256, 512, 1024, 2048),
                 down_block_types: Sequence[str] = ("LTX2VideoDownBlock3D",) * 4,
                 spatio_temporal_scaling: BoolOrSeq = (True, True, True, True),
                 layers_per_block: Sequence[int] = (4, 6, 6, 2, 2),
                 downsample_type: Sequence[str] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                 patch_size: int = 4, patch_size_t: int = 1, resnet_norm_eps: float = 1e-6, is_causal: bool = True,
                 spatial_padding_mode: str = "zeros") -> None:
        super().__init__()
        spatio_temporal_scaling = _per_block(spatio_temporal_scaling, len(layers_per_block) - 1)
        self.patch_size = patch_size
        self.patch_size_t = patch_size_t
        self.in_channels = in_channels * patch_size ** 2  # diffusers leaves patch_size_t out (it must be 1)
        self.is_causal = is_causal
        self.latent_channels = out_channels
        self.conv_in = LTX2VideoCausalConv3d(self.in_channels, out_channels, 3,
                                             spatial_padding_mode=spatial_padding_mode)
        self.down_blocks = nn.LayerList()
        width = out_channels
        for i, block_width in enumerate(block_out_channels):
            if down_block_types[i] != "LTX2VideoDownBlock3D":
                raise ValueError(f"Unknown down block type: {down_block_types[i]}")
            self.down_blocks.append(LTX2VideoDownBlock3D(
                width, block_width, num_layers=layers_per_block[i], resnet_eps=resnet_norm_eps,
                spatio_temporal_scale=spatio_temporal_scaling[i], downsample_type=downsample_type[i],
                spatial_padding_mode=spatial_padding_mode))
            width = block_width
        self.mid_block = LTX2VideoMidBlock3d(width, num_layers=layers_per_block[-1], resnet_eps=resnet_norm_eps,
                                             spatial_padding_mode=spatial_padding_mode)
        self.norm_out = PerChannelRMSNorm()
        self.conv_act = nn.Silu()
        self.conv_out = LTX2VideoCausalConv3d(width, out_channels + 1, 3, spatial_padding_mode=spatial_padding_mode)

    def forward(self, hidden_states: paddle.Tensor, causal: Optional[bool] = None) -> paddle.Tensor:
        causal = causal or self.is_causal
        x = self.conv_in(patchify(hidden_states, self.patch_size, self.patch_size_t), causal=causal)
        for block in self.down_blocks:
            x = block(x, causal=causal)
        x = self.mid_block(x, causal=causal)
        x = self.conv_out(self.conv_act(self.norm_out(x)), causal=causal)
        return paddle.concat([x, x[:, -1:].tile([1, x.shape[1] - 2, 1, 1, 1])], axis=1)


class LTX2VideoDecoder3d(nn.Layer):
    """conv_in -> mid_block -> up_blocks -> norm_out -> [modulation] -> SiLU -> conv_out -> unpatchify.

    Lists are given encoder-side first and reversed here, as in diffusers; each up block's widths are its listed
    widths divided by its upsample factor. Timestep conditioning: the timestep times the trainable
    `timestep_scale_multiplier` (1000 at first) conditions every block, and `time_embedder` + `scale_shift_table`
    modulate the output norm."""

    def __init__(self, in_channels: int = 128, out_channels: int = 3,
                 block_out_channels: Sequence[int] = (256, 512, 1024),
                 spatio_temporal_scaling: BoolOrSeq = (True, True, True),
                 layers_per_block: Sequence[int] = (5, 5, 5, 5),
                 upsample_type: Sequence[str] = ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
                 patch_size: int = 4, patch_size_t: int = 1, resnet_norm_eps: float = 1e-6, is_causal: bool = False,
                 inject_noise: BoolOrSeq = (False, False, False), timestep_conditioning: bool = False,
                 upsample_residual: BoolOrSeq = (True, True, True), upsample_factor: Sequence[int] = (2, 2, 2),
                 spatial_padding_mode: str = "reflect") -> None:
        super().__init__()
        blocks = len(layers_per_block)
        scaling = _per_block(spatio_temporal_scaling, blocks - 1)[::-1]
        noise = _per_block(inject_noise, blocks)[::-1]
        residual = _per_block(upsample_residual, blocks - 1)[::-1]
        widths, layers = tuple(block_out_channels)[::-1], tuple(layers_per_block)[::-1]
        factors, kinds = tuple(upsample_factor)[::-1], tuple(upsample_type)
        self.patch_size = patch_size
        self.patch_size_t = patch_size_t
        self.out_channels = out_channels * patch_size ** 2
        self.is_causal = is_causal
        width = widths[0]
        self.conv_in = LTX2VideoCausalConv3d(in_channels, width, 3, spatial_padding_mode=spatial_padding_mode)
        self.mid_block = LTX2VideoMidBlock3d(width, num_layers=layers[0], resnet_eps=resnet_norm_eps,
                                             inject_noise=noise[0], timestep_conditioning=timestep_conditioning,
                                             spatial_padding_mode=spatial_padding_mode)
        self.up_blocks = nn.LayerList()
        for i, block_width in enumerate(widths):
            in_width, width = width // factors[i], block_width // factors[i]
            self.up_blocks.append(LTX2VideoUpBlock3d(
                in_width, width, num_layers=layers[i + 1], resnet_eps=resnet_norm_eps,
                spatio_temporal_scale=scaling[i], upsample_type=kinds[i], inject_noise=noise[i + 1],
                timestep_conditioning=timestep_conditioning, upsample_residual=residual[i],
                upscale_factor=factors[i], spatial_padding_mode=spatial_padding_mode))
        self.norm_out = PerChannelRMSNorm()
        self.conv_act = nn.Silu()
        self.conv_out = LTX2VideoCausalConv3d(width, self.out_channels, 3, spatial_padding_mode=spatial_padding_mode)
        self.time_embedder = None
        self.scale_shift_table = None
        self.timestep_scale_multiplier = None
        if timestep_conditioning:
            # 0-d, as diffusers' (ppdiffusers' save would write it (1,): AutoencoderKLLTX2Video.save_pretrained).
            self.timestep_scale_multiplier = self.create_parameter(
                [], default_initializer=nn.initializer.Constant(1000.0))
            self.time_embedder = PixArtAlphaCombinedTimestepSizeEmbeddings(width * 2, 0)
            self.scale_shift_table = self.create_parameter(
                [2, width], default_initializer=nn.initializer.Normal(0.0, width ** -0.5))

    def forward(self, hidden_states: paddle.Tensor, temb: Optional[paddle.Tensor] = None,
                causal: Optional[bool] = None, generator: Optional[paddle.Generator] = None) -> paddle.Tensor:
        causal = causal or self.is_causal
        x = self.conv_in(hidden_states, causal=causal)
        if self.timestep_scale_multiplier is not None:
            temb = _required(temb) * self.timestep_scale_multiplier
        x = self.mid_block(x, temb, generator, causal=causal)
        for block in self.up_blocks:
            x = block(x, temb, generator, causal=causal)
        x = self.norm_out(x)
        if self.time_embedder is not None:
            x = self._modulate(x, temb)
        x = self.conv_out(self.conv_act(x), causal=causal)
        return unpatchify(x, self.patch_size, self.patch_size_t)

    def _modulate(self, x: paddle.Tensor, temb: paddle.Tensor) -> paddle.Tensor:
        embedded = _embedded_timestep(self.time_embedder, temb, x)
        n = embedded.shape[0]
        shift, scale = (embedded.reshape([n, 2, -1, 1, 1, 1]) + self.scale_shift_table.reshape([1, 2, -1, 1, 1, 1])
                        ).unbind(axis=1)
        return x * (1 + scale) + shift


# ---------------------------------------------------------------------------------------------------- the model


class AutoencoderKLLTX2Video(ModelMixin, ConfigMixin):
    """diffusers' AutoencoderKLLTX2Video (0.42.1): same constructor, config keys, parameter and buffer names and
    outputs (module docstring for shapes, causality, the options and the differences)."""

    _supports_gradient_checkpointing = False  # see the module docstring: checkpoint_segments instead

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 128,
        block_out_channels: Tuple[int, ...] = (256, 512, 1024, 2048),
        down_block_types: Tuple[str, ...] = (
            "LTX2VideoDownBlock3D",
            "LTX2VideoDownBlock3D",
            "LTX2VideoDownBlock3D",
            "LTX2VideoDownBlock3D",
        ),
        decoder_block_out_channels: Tuple[int, ...] = (256, 512, 1024),
        layers_per_block: Tuple[int, ...] = (4, 6, 6, 2, 2),
        decoder_layers_per_block: Tuple[int, ...] = (5, 5, 5, 5),
        spatio_temporal_scaling: BoolOrSeq = (True, True, True, True),
        decoder_spatio_temporal_scaling: BoolOrSeq = (True, True, True),
        decoder_inject_noise: BoolOrSeq = (False, False, False, False),
        downsample_type: Tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type: Tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual: BoolOrSeq = (True, True, True),
        upsample_factor: Tuple[int, ...] = (2, 2, 2),
        timestep_conditioning: bool = False,
        patch_size: int = 4,
        patch_size_t: int = 1,
        resnet_norm_eps: float = 1e-6,
        scaling_factor: float = 1.0,
        encoder_causal: bool = True,
        decoder_causal: bool = True,
        encoder_spatial_padding_mode: str = "zeros",
        decoder_spatial_padding_mode: str = "reflect",
        spatial_compression_ratio: int = None,
        temporal_compression_ratio: int = None,
    ) -> None:
        super().__init__()
        scaling = _per_block(spatio_temporal_scaling, len(layers_per_block) - 1)
        self.encoder = LTX2VideoEncoder3d(
            in_channels=in_channels, out_channels=latent_channels, block_out_channels=block_out_channels,
            down_block_types=down_block_types, spatio_temporal_scaling=scaling, layers_per_block=layers_per_block,
            downsample_type=downsample_type, patch_size=patch_size, patch_size_t=patch_size_t,
            resnet_norm_eps=resnet_norm_eps, is_causal=encoder_causal,
            spatial_padding_mode=encoder_spatial_padding_mode)
        self.decoder = LTX2VideoDecoder3d(
            in_channels=latent_channels, out_channels=out_channels, block_out_channels=decoder_block_out_channels,
            spatio_temporal_scaling=decoder_spatio_temporal_scaling, layers_per_block=decoder_layers_per_block,
            upsample_type=upsample_type, patch_size=patch_size, patch_size_t=patch_size_t,
            resnet_norm_eps=resnet_norm_eps, is_causal=decoder_causal, timestep_conditioning=timestep_conditioning,
            inject_noise=decoder_inject_noise, upsample_residual=upsample_residual, upsample_factor=upsample_factor,
            spatial_padding_mode=decoder_spatial_padding_mode)
        # In the weights (persistable), loaded and saved bit for bit; the model itself never applies them.
        self.register_buffer("latents_mean", paddle.zeros([latent_channels]), persistable=True)
        self.register_buffer("latents_std", paddle.ones([latent_channels]), persistable=True)
        # diffusers' formula (it counts every scaling block as 2x in space and time: see the module docstring).
        default_ratio = 2 ** sum(scaling)
        self.spatial_compression_ratio = (patch_size * default_ratio if spatial_compression_ratio is None
                                          else spatial_compression_ratio)
        self.temporal_compression_ratio = (patch_size_t * default_ratio if temporal_compression_ratio is None
                                           else temporal_compression_ratio)
        self.use_slicing = False
        self.use_tiling = False
        self.use_framewise_encoding = False
        self.use_framewise_decoding = False

    # -- options (diffusers' names)

    def enable_slicing(self) -> None:
        """Encode and decode a batch one sample at a time."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def enable_tiling(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("AutoencoderKLLTX2Video: tiled and framewise encode / decode are not ported "
                                  "(diffusers' inference memory savers); encode and decode whole inputs")

    def disable_tiling(self) -> None:
        self.use_tiling = False

    # -- shapes

    def latent_shape(self, num_frames: int, height: int, width: int) -> Tuple[int, int, int]:
        """(frames, height, width) of the latent of a (num_frames, height, width) input; ValueError naming the rule
        when the encoder cannot take it (published layout: 1 + 8k frames, sides multiples of 32)."""
        config = self.config
        p, pt = config.patch_size, config.patch_size_t
        if height % p or width % p or num_frames % pt:
            raise ValueError(f"AutoencoderKLLTX2Video: height {height} and width {width} must be multiples of "
                             f"patch_size {p} (frames {num_frames} of patch_size_t {pt})")
        t, h, w = num_frames // pt, height // p, width // p
        scaling = _per_block(config.spatio_temporal_scaling, len(config.layers_per_block) - 1)
        for kind, scales in zip(config.downsample_type, scaling):
            if not scales:
                continue
            if kind == "conv":  # stride 2, pad 1 in space and 2 frames in front: any size
                t, h, w = (t - 1) // 2 + 1, (h - 1) // 2 + 1, (w - 1) // 2 + 1
                continue
            st, sh, sw = STRIDES[kind]
            padded = t + st - 1
            if padded % st or h % sh or w % sw:
                raise ValueError(
                    f"AutoencoderKLLTX2Video: a {num_frames} x {height} x {width} input does not fit the encoder "
                    f"(frames must be 1 + {self.temporal_downsample_factor()}k, height and width multiples of "
                    f"{self.spatial_downsample_factor()})")
            t, h, w = padded // st, h // sh, w // sw
        return t, h, w

    def spatial_downsample_factor(self) -> int:
        """Pixels per latent pixel along a side (32 for LTX-2), from the block types (not diffusers' ratio)."""
        return self._factor(axis=1)

    def temporal_downsample_factor(self) -> int:
        """Frames per latent frame after the first (8 for LTX-2): T = 1 + factor * (T' - 1)."""
        return self._factor(axis=0)

    def _factor(self, axis: int) -> int:
        config = self.config
        factor = config.patch_size if axis else config.patch_size_t
        scaling = _per_block(config.spatio_temporal_scaling, len(config.layers_per_block) - 1)
        for kind, scales in zip(config.downsample_type, scaling):
            factor *= STRIDES[kind][axis] if scales else 1
        return factor

    # -- encode

    def _encode(self, x: paddle.Tensor, causal: Optional[bool] = None) -> paddle.Tensor:
        if x.ndim != 5:
            raise ValueError(f"AutoencoderKLLTX2Video takes (N, C, T, H, W) input, got shape {list(x.shape)}")
        self.latent_shape(*x.shape[2:])
        return self.encoder(x, causal=causal)

    def encode(self, x: paddle.Tensor, causal: Optional[bool] = None, return_dict: bool = True
               ) -> Union[AutoencoderKLOutput, Tuple[DiagonalGaussianDistribution]]:
        """The posterior of (N, C, T, H, W) pixels on [-1, 1]: `.latent_dist`, mean and logvar (N, latent_channels,
        T', H', W'), the logvar one channel repeated."""
        if self.use_slicing and x.shape[0] > 1:
            moments = paddle.concat([self._encode(part, causal) for part in x.split(x.shape[0])])
        else:
            moments = self._encode(x, causal)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    # -- decode

    def _decode(self, z: paddle.Tensor, temb: Optional[paddle.Tensor] = None, causal: Optional[bool] = None,
                return_dict: bool = True, clamp: bool = False, generator: Optional[paddle.Generator] = None
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        out = self.decoder(z, temb, causal=causal, generator=generator)
        if clamp:
            out = out.clip(-1.0, 1.0)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def decode(self, z: paddle.Tensor, temb: Optional[paddle.Tensor] = None, causal: Optional[bool] = None,
               return_dict: bool = True, clamp: bool = False, generator: Optional[paddle.Generator] = None
               ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """`.sample`: the decoder's output for (N, latent_channels, T', H', W') latents, NOT clamped (as diffusers);
        `clamp=True` clips it to [-1, 1]. `temb`: one timestep per sample, required with timestep_conditioning.
        `generator`: for decoder_inject_noise's draws (None: the global RNG, as diffusers always does)."""
        if self.use_slicing and z.shape[0] > 1:
            times = temb.split(temb.shape[0]) if temb is not None else [None] * z.shape[0]
            decoded = paddle.concat([self._decode(part, t, causal, clamp=clamp, generator=generator).sample
                                     for part, t in zip(z.split(z.shape[0]), times)])
        else:
            decoded = self._decode(z, temb, causal, clamp=clamp, generator=generator).sample
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    def forward(self, sample: paddle.Tensor, temb: Optional[paddle.Tensor] = None, sample_posterior: bool = False,
                encoder_causal: Optional[bool] = None, decoder_causal: Optional[bool] = None,
                return_dict: bool = True, generator: Optional[paddle.Generator] = None, clamp: bool = False
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """Encode, the posterior's mode (or a sample, drawn with `generator`), decode: diffusers' forward."""
        posterior = self.encode(sample, causal=encoder_causal).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, temb, causal=decoder_causal, return_dict=return_dict, clamp=clamp)

    # -- latent statistics (what LTX-2's pipelines do with the buffers)

    def normalize_latents(self, latents: paddle.Tensor) -> paddle.Tensor:
        """(z - latents_mean) * scaling_factor / latents_std per channel: LTX2Pipeline._normalize_latents."""
        mean, std = (buffer.reshape([1, -1, 1, 1, 1]).astype(latents.dtype)
                     for buffer in (self.latents_mean, self.latents_std))
        return (latents - mean) * self.config.scaling_factor / std

    def denormalize_latents(self, latents: paddle.Tensor) -> paddle.Tensor:
        """The inverse: z * latents_std / scaling_factor + latents_mean (LTX2Pipeline._denormalize_latents)."""
        mean, std = (buffer.reshape([1, -1, 1, 1, 1]).astype(latents.dtype)
                     for buffer in (self.latents_mean, self.latents_std))
        return latents * std / self.config.scaling_factor + mean

    # -- saving

    def save_pretrained(self, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any) -> None:
        """ppdiffusers' save_pretrained, the 0-d parameters (timestep_scale_multiplier) then written 0-d into the
        safetensors files it made, Paddle's and diffusers' alike: its np.ascontiguousarray turns every 0-d array
        into shape (1,), which no loader (ppdiffusers', diffusers' strict one) gives back to a 0-d parameter.
        Non-safetensors files (safe_serialization=False) are left as ppdiffusers writes them."""
        super().save_pretrained(save_directory, *args, **kwargs)
        zero_dim = [name for name, value in self.state_dict().items() if value.ndim == 0]
        if zero_dim:
            for path in glob.glob(os.path.join(str(save_directory), "diffusion_*model*.safetensors")):
                _zero_dim_in_file(path, zero_dim)

    # -- what fine-tuning needs

    def decoder_last_layer(self) -> paddle.Tensor:
        """The weight of the conv producing the image (its 3 * patch_size ** 2 patchified channels)."""
        return self.decoder.conv_out.conv.weight

    def encoder_last_layer(self) -> nn.Layer:
        """The conv producing the moments (`encoder.conv_out`: latent_channels means and one log-variance)."""
        return self.encoder.conv_out

    def encoder_side_modules(self) -> List[Tuple[str, nn.Layer]]:
        """(name, layer) of everything that defines the latents: the encoder (there is no quant_conv)."""
        return [("encoder", self.encoder)]

    def checkpoint_segments(self) -> List[Tuple[str, nn.Layer]]:
        """(name, block) that gradient checkpointing may re-run in the backward: the encoder's down blocks and mid
        block, the decoder's mid block and up blocks, each a pure function of (hidden_states, temb) (the
        decoder's blocks that inject noise are left out: they draw from the RNG). Never conv_out."""
        out = [(f"encoder.down_blocks.{i}", block) for i, block in enumerate(self.encoder.down_blocks)]
        out.append(("encoder.mid_block", self.encoder.mid_block))
        decoder = [("decoder.mid_block", self.decoder.mid_block)]
        decoder += [(f"decoder.up_blocks.{i}", block) for i, block in enumerate(self.decoder.up_blocks)]
        return out + [(name, block) for name, block in decoder if not _injects_noise(block)]


    def video_only_weights(self) -> List[VideoOnlyChannels]:
        """What a one-frame (T = 1) pass never reaches: in each temporally upsampling conv of the decoder, the output
        channels that unfold into the frames it drops (one latent frame keeps the last of stride_t). Every other
        weight gets a gradient from images (each temporal tap meets the frame itself, repeated)."""
        out = []
        for name, layer in self.named_sublayers():
            if isinstance(layer, LTX2VideoUpsampler3d) and layer.stride[0] > 1:
                used = set(layer.first_frame_channels())
                unused = tuple(k for k in range(layer.conv.conv.weight.shape[0]) if k not in used)
                out += [VideoOnlyChannels(f"{name}.conv.conv.{leaf}", unused) for leaf in ("weight", "bias")]
        return out


def _injects_noise(block: nn.Layer) -> bool:
    return any(isinstance(layer, LTX2VideoResnetBlock3d) and layer.per_channel_scale1 is not None
               for layer in block.sublayers(include_self=True))


def _zero_dim_in_file(path: str, names: Sequence[str]) -> None:
    """Rewrite the safetensors file at `path` with its tensors `names` of shape (1,) made 0-d (metadata kept)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path)
    keys = [key for key in names if key in tensors and tensors[key].shape == (1,)]
    if not keys:
        return
    with safe_open(path, framework="np") as handle:
        metadata = handle.metadata()
    for key in keys:
        tensors[key] = tensors[key].reshape(())
    save_file(tensors, path, metadata=metadata)
