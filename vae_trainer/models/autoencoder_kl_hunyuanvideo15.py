"""HunyuanVideo 1.5's causal 3D VAE in Paddle: diffusers' `AutoencoderKLHunyuanVideo15` (0.42.1).

This module owns the model and every block it is made of: the replicate-padded causal conv, the RMS norm, the
frame-causal mid-block attention, the DC-AE-style down- and upsamplers (a conv whose output is folded between
space / time and channels, plus a parameter-free shortcut doing the same to the input), the residual, down, up and mid
blocks, the encoder and the decoder. From autoencoder_kl_wan.py it takes only what is the same math there: the
posterior (`DiagonalGaussianDistribution`), the RMS norm's layout and the tile blending.

Parameter names, shapes and config keys are diffusers'. The model holds no `paddle.nn.Linear` (the attention's
projections are 1x1x1 convs), so ppdiffusers' `convert_pytorch_state_dict_to_paddle` transposes nothing: a diffusers
folder loads as it is, and `save_pretrained(dir, to_diffusers=True)` writes one diffusers loads with no missing or
unexpected key (tests/test_autoencoder_kl_hunyuanvideo15.py).

Geometry: 16x spatial, 4x temporal, 32 latent channels by default. Input (N, C, T, H, W) on [-1, 1] with T = 1 + 4k
(an image is T = 1), H and W multiples of 16; T' = 1 + (T - 1) / 4 latent frames, and a decode of T' frames gives
1 + 4 (T' - 1). Each temporal stage keeps the first frame on its own (packed in space only) and pairs the frames
after it, so any other T cannot be folded: `encode` refuses it (diffusers fails inside a `view`).

No feature cache: unlike Wan, diffusers runs the whole clip through the encoder and the decoder in one pass (its
causality is the front-only time padding and the frame-causal attention mask), and so does this port. Every block is
then a pure function of its input, for any T: `checkpoint_segments()` lists the encoder's and decoder's blocks for
non-reentrant recompute, and `enable_gradient_checkpointing()` (ppdiffusers' switch) recomputes the same blocks.

Where it differs from diffusers 0.42.1, knowingly:
    - batch > 1: diffusers' mid-block attention builds its mask as (N, S, S) against scores of (N, 1, S, S), which
      PyTorch cannot broadcast, so its encode and decode fail for any batch above 1. The mask here is one (S, S)
      table broadcast over the batch: each sample is what a batch of one gives.
    - one frame: with replicate padding every temporal tap of a 3x3x3 causal conv meets the same frame, so a single
      frame runs as a 2D conv with the taps summed (a third of the work and activation memory; equal to the 3D conv
      within float rounding; each tap gets the same gradient).
    - enable_gradient_checkpointing recomputes the encoder's and decoder's blocks; diffusers' up blocks also nest a
      recompute of each of their resnets inside that (same values, nothing saved by it).
    - fresh weights use Paddle's default initialisers (diffusers': PyTorch's); loaded weights are what count.

Half precision: the RMS norms compute the L2 normalisation in float32 for float16 / bfloat16 (and float8) inputs and
cast the result back before the gamma scale, as diffusers 0.42.1 does (PR #13316); the attention's softmax runs in
float32 for such inputs.

Decoding: diffusers' `decode` does not clamp (its pipelines' postprocessing clamps to [0, 1] after mapping to
pixels), so `decode(z).sample` is the decoder's output as it is; `decode(z, clamp=True)` clamps to [-1, 1] for
callers that want Wan's behaviour.

The HunyuanVideo 1.5 pipelines scale latents by `config.scaling_factor` alone (no shift): image-to-video takes the
posterior mode (`sample_mode="argmax"`) times scaling_factor; decoding divides by it.

What later fine-tuning needs (methods of the class): `encoder_side_modules()` (the encoder: there is no quant_conv),
`encoder_last_layer()` (encoder.conv_out's Conv3D, which makes the moments, plus a parameter-free channel-mean
shortcut), `decoder_last_layer()` (decoder.conv_out's weight), `checkpoint_segments()`, and `video_only_weights()`:
what a one-frame pass leaves with an exactly zero gradient, the output channels of each temporal upsampler's conv
that only frames after the first read (`VideoOnlyChannels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed.fleet.utils import recompute
from ppdiffusers.configuration_utils import ConfigMixin, register_to_config
from ppdiffusers.models.activations import get_activation
from ppdiffusers.models.modeling_outputs import AutoencoderKLOutput
from ppdiffusers.models.modeling_utils import ModelMixin
from ppdiffusers.models.vae import DecoderOutput

from .autoencoder_kl_wan import DiagonalGaussianDistribution, WanRMSNorm, _blend_tiles

IntOrTriple = Union[int, Sequence[int]]
# The dtypes diffusers normalises in float32 (Paddle's names for them; float8 where this Paddle has it).
LOW_PRECISION = tuple(getattr(paddle, name) for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
                      if hasattr(paddle, name))


# ---- layers

def _triple(value: IntOrTriple) -> Tuple[int, int, int]:
    return (value,) * 3 if isinstance(value, int) else tuple(value)


class HunyuanVideo15CausalConv3d(nn.Layer):
    """A Conv3D (`self.conv`, diffusers' name) on its input padded by `pad_mode` (replicate by default): in time at
    the front only, kernel - 1 frames, so frame t sees frames <= t (the first frame stands in for the ones before
    it); in space symmetrically, kernel // 2."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTriple = 3, stride: IntOrTriple = 1,
                 padding: IntOrTriple = 0, dilation: IntOrTriple = 1, bias: bool = True,
                 pad_mode: str = "replicate") -> None:
        super().__init__()
        kernel = _triple(kernel_size)
        self.pad_mode = pad_mode
        # F.pad's order: W left / right, H top / bottom, T front / back. diffusers takes W's from kernel[0] and T's
        # from kernel[2]; kept so, though every conv of the model is cubic.
        self.time_causal_padding = (kernel[0] // 2, kernel[0] // 2, kernel[1] // 2, kernel[1] // 2, kernel[2] - 1, 0)
        self.conv = nn.Conv3D(in_channels, out_channels, kernel, stride=stride, padding=padding, dilation=dilation,
                              bias_attr=None if bias else False)
        self._one_frame_ok = (pad_mode == "replicate" and _triple(padding) == (0, 0, 0)
                              and _triple(dilation)[0] == 1 and kernel[2] == kernel[0])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if x.shape[2] == 1 and self._one_frame_ok:
            return self._one_frame(x)
        return self.conv(F.pad(x, list(self.time_causal_padding), mode=self.pad_mode, data_format="NCDHW"))

    def _one_frame(self, x: paddle.Tensor) -> paddle.Tensor:
        """One frame replicated in front meets every temporal tap: a 2D conv with the taps summed."""
        frame = F.pad(x.squeeze(2), list(self.time_causal_padding[:4]), mode="replicate", data_format="NCHW")
        out = F.conv2d(frame, self.conv.weight.sum(axis=2), self.conv.bias, stride=self.conv._stride[1:],
                       dilation=self.conv._dilation[1:], groups=self.conv._groups)
        return out.unsqueeze(2)


class HunyuanVideo15RMSNorm(WanRMSNorm):
    """x / ||x||_2 over the channels * sqrt(dim) * gamma (+ bias): diffusers' HunyuanVideo15RMS_norm, which is Wan's
    (parameter `gamma`, shape (dim, 1, 1, 1) for video). Low-precision inputs are normalised in float32 and cast back
    before the scale, float8 included as in diffusers."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        upcast = x.dtype in LOW_PRECISION
        normalized = F.normalize(x.astype("float32") if upcast else x, p=2, axis=1 if self.channel_first else -1,
                                 epsilon=1e-12)
        return normalized.astype(x.dtype) * self.scale * self.gamma + self.bias


def causal_frame_mask(frames: int, tokens_per_frame: int, dtype: Any) -> paddle.Tensor:
    """(S, S) additive mask, S = frames * tokens_per_frame: 0 where the key's frame is not after the query's, -inf
    elsewhere. One table for the whole batch: it broadcasts over (N, S, S) scores (diffusers' (N, S, S) mask does
    not broadcast against its (N, 1, S, S) scores)."""
    frame = paddle.arange(frames * tokens_per_frame) // tokens_per_frame
    allowed = frame.unsqueeze(0) <= frame.unsqueeze(1)
    return paddle.where(allowed, paddle.zeros([], dtype), paddle.full([], float("-inf"), dtype))


class HunyuanVideo15AttnBlock(nn.Layer):
    """Single-head self-attention over all positions of a clip, causal between frames (a frame's positions see
    every position of their own and earlier frames), with a residual."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.norm = HunyuanVideo15RMSNorm(in_channels, images=False)
        self.to_q = nn.Conv3D(in_channels, in_channels, 1)
        self.to_k = nn.Conv3D(in_channels, in_channels, 1)
        self.to_v = nn.Conv3D(in_channels, in_channels, 1)
        self.proj_out = nn.Conv3D(in_channels, in_channels, 1)

    @staticmethod
    def prepare_causal_attention_mask(n_frame: int, n_hw: int, dtype: Any) -> paddle.Tensor:
        """diffusers' name for the mask (without its batch expansion, which is the bug): `causal_frame_mask`."""
        return causal_frame_mask(n_frame, n_hw, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        b, c, t, h, w = x.shape
        normed = self.norm(x)

        def tokens(projection: nn.Layer) -> paddle.Tensor:  # (B, S, C), S in (frame, row, column) order
            return projection(normed).reshape([b, c, t * h * w]).transpose([0, 2, 1])

        query, key, value = tokens(self.to_q), tokens(self.to_k), tokens(self.to_v)
        scores = paddle.matmul(query, key, transpose_y=True) * (c ** -0.5)
        if x.dtype in LOW_PRECISION:
            scores = scores.astype("float32")
        if t > 1:  # a single frame attends to all of itself: the mask would be all zeros
            scores = scores + causal_frame_mask(t, h * w, scores.dtype)
        weights = F.softmax(scores, axis=-1).astype(value.dtype)
        out = paddle.matmul(weights, value).transpose([0, 2, 1]).reshape([b, c, t, h, w])
        return self.proj_out(out) + x


# ---- folding space and time into channels (DC-AE style)

def fold(x: paddle.Tensor, r_t: int, r_h: int, r_w: int) -> paddle.Tensor:
    """(B, C, r_t F, r_h H, r_w W) -> (B, r_t r_h r_w C, F, H, W); output channel ((i_t r_h + i_h) r_w + i_w) C + c
    holds offset (i_t, i_h, i_w) of channel c."""
    b, c, t, h, w = x.shape
    x = x.reshape([b, c, t // r_t, r_t, h // r_h, r_h, w // r_w, r_w]).transpose([0, 3, 5, 7, 1, 2, 4, 6])
    return x.reshape([b, r_t * r_h * r_w * c, t // r_t, h // r_h, w // r_w])


def unfold(x: paddle.Tensor, r_t: int, r_h: int, r_w: int) -> paddle.Tensor:
    """The inverse of `fold`: (B, r_t r_h r_w C, F, H, W) -> (B, C, r_t F, r_h H, r_w W)."""
    b, packed, t, h, w = x.shape
    c = packed // (r_t * r_h * r_w)
    x = x.reshape([b, r_t, r_h, r_w, c, t, h, w]).transpose([0, 4, 5, 1, 6, 2, 7, 3])
    return x.reshape([b, c, t * r_t, h * r_h, w * r_w])


def channel_group_mean(x: paddle.Tensor, channels: int) -> paddle.Tensor:
    """(B, channels * g, ...) -> (B, channels, ...), each output the mean of g consecutive input channels."""
    b, total, *rest = x.shape
    return x.reshape([b, channels, total // channels, *rest]).mean(axis=2)


def _split_first_frame(x: paddle.Tensor) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
    """(frame 0, the frames after it or None): a temporal resampler treats the first frame on its own."""
    return x[:, :, :1], (x[:, :, 1:] if x.shape[2] > 1 else None)


class HunyuanVideo15Downsample(nn.Layer):
    """2x down in space (and in time with `add_temporal_downsample`): a conv to out / factor channels folded into
    out, plus the input folded alike and averaged down to out channels."""

    def __init__(self, in_channels: int, out_channels: int, add_temporal_downsample: bool = True) -> None:
        super().__init__()
        factor = 8 if add_temporal_downsample else 4
        self.conv = HunyuanVideo15CausalConv3d(in_channels, out_channels // factor, kernel_size=3)
        self.add_temporal_downsample = add_temporal_downsample
        self.group_size = factor * in_channels // out_channels
        self.out_channels = out_channels

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = self.conv(x)
        if not self.add_temporal_downsample:
            return fold(h, 1, 2, 2) + channel_group_mean(fold(x, 1, 2, 2), self.out_channels)
        # Frame 0 has no partner in time: folded in space only, it has half the channels the pairs after it get,
        # so the conv's output is doubled and the shortcut averages half as many input channels.
        h_first, h_rest = _split_first_frame(h)
        x_first, x_rest = _split_first_frame(x)
        first = fold(h_first, 1, 2, 2)
        hs = [paddle.concat([first, first], axis=1)]
        shortcuts = [channel_group_mean(fold(x_first, 1, 2, 2), self.out_channels)]
        if h_rest is not None:
            hs.append(fold(h_rest, 2, 2, 2))
            shortcuts.append(channel_group_mean(fold(x_rest, 2, 2, 2), self.out_channels))
        return paddle.concat(hs, axis=2) + paddle.concat(shortcuts, axis=2)


class HunyuanVideo15Upsample(nn.Layer):
    """2x up in space (and in time with `add_temporal_upsample`): a conv to out * factor channels unfolded into
    out, plus the input's channels repeated and unfolded alike."""

    def __init__(self, in_channels: int, out_channels: int, add_temporal_upsample: bool = True) -> None:
        super().__init__()
        factor = 8 if add_temporal_upsample else 4
        self.conv = HunyuanVideo15CausalConv3d(in_channels, out_channels * factor, kernel_size=3)
        self.add_temporal_upsample = add_temporal_upsample
        self.repeats = factor * out_channels // in_channels

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = self.conv(x)
        if not self.add_temporal_upsample:
            shortcut = paddle.repeat_interleave(x, self.repeats, axis=1)
            return unfold(h, 1, 2, 2) + unfold(shortcut, 1, 2, 2)
        # Frame 0 stays one frame: unfolded in space only it has twice the channels, of which the first half is
        # kept (so the rest of the conv's outputs only ever serve later frames: `video_only_weights`), and the
        # shortcut repeats its channels half as often.
        h_first, h_rest = _split_first_frame(h)
        x_first, x_rest = _split_first_frame(x)
        first = unfold(h_first, 1, 2, 2)
        hs = [first[:, :first.shape[1] // 2]]
        shortcuts = [paddle.repeat_interleave(unfold(x_first, 1, 2, 2), self.repeats // 2, axis=1)]
        if h_rest is not None:
            hs.append(unfold(h_rest, 2, 2, 2))
            shortcuts.append(paddle.repeat_interleave(unfold(x_rest, 2, 2, 2), self.repeats, axis=1))
        return paddle.concat(hs, axis=2) + paddle.concat(shortcuts, axis=2)

    def first_frame_channels(self) -> List[int]:
        """The conv's output channels that frame 0's output reads (the others serve only the frames after it)."""
        packed = self.conv.conv.weight.shape[0]
        probe = paddle.arange(packed, dtype="float32").reshape([1, packed, 1, 1, 1])
        first = unfold(probe, 1, 2, 2)
        return sorted(int(v) for v in first[:, :first.shape[1] // 2].flatten().numpy())


# ---- blocks

def _activation(name: str) -> nn.Layer:
    """SiLU as Paddle's swish kernel (its SiLU kernel's backward is NaN below -88: activations.py)."""
    return nn.Swish() if name in ("swish", "silu") else get_activation(name)


class HunyuanVideo15ResnetBlock(nn.Layer):
    """norm1 -> act -> conv1 -> norm2 -> act -> conv2, plus the input (a 1x1x1 conv_shortcut when widths differ)."""

    def __init__(self, in_channels: int, out_channels: Optional[int] = None, non_linearity: str = "swish") -> None:
        super().__init__()
        out_channels = out_channels or in_channels
        self.nonlinearity = _activation(non_linearity)
        self.norm1 = HunyuanVideo15RMSNorm(in_channels, images=False)
        self.conv1 = HunyuanVideo15CausalConv3d(in_channels, out_channels, kernel_size=3)
        self.norm2 = HunyuanVideo15RMSNorm(out_channels, images=False)
        self.conv2 = HunyuanVideo15CausalConv3d(out_channels, out_channels, kernel_size=3)
        self.conv_shortcut = nn.Conv3D(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = self.conv1(self.nonlinearity(self.norm1(x)))
        h = self.conv2(self.nonlinearity(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class HunyuanVideo15MidBlock(nn.Layer):
    """A resnet, then num_layers x (attention, resnet)."""

    def __init__(self, in_channels: int, num_layers: int = 1, add_attention: bool = True) -> None:
        super().__init__()
        self.add_attention = add_attention
        self.resnets = nn.LayerList([HunyuanVideo15ResnetBlock(in_channels, in_channels)
                                     for _ in range(num_layers + 1)])
        # diffusers keeps a None per layer without attention; a LayerList holds no None, and None has no weights.
        self.attentions = nn.LayerList([HunyuanVideo15AttnBlock(in_channels) for _ in range(num_layers)]
                                       if add_attention else [])
        self.gradient_checkpointing = False

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.resnets[0](x)
        for k, resnet in enumerate(self.resnets[1:]):
            if self.add_attention:
                x = self.attentions[k](x)
            x = resnet(x)
        return x


class HunyuanVideo15DownBlock3D(nn.Layer):
    """num_layers resnets, then a downsampler when downsample_out_channels is given."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int = 1,
                 downsample_out_channels: Optional[int] = None, add_temporal_downsample: bool = True) -> None:
        super().__init__()
        self.resnets = nn.LayerList([HunyuanVideo15ResnetBlock(in_channels if i == 0 else out_channels, out_channels)
                                     for i in range(num_layers)])
        self.downsamplers = None if downsample_out_channels is None else nn.LayerList(
            [HunyuanVideo15Downsample(out_channels, downsample_out_channels, add_temporal_downsample)])
        self.gradient_checkpointing = False

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        for layer in [*self.resnets, *(self.downsamplers or [])]:
            x = layer(x)
        return x


class HunyuanVideo15UpBlock3D(nn.Layer):
    """num_layers resnets, then an upsampler when upsample_out_channels is given."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int = 1,
                 upsample_out_channels: Optional[int] = None, add_temporal_upsample: bool = True) -> None:
        super().__init__()
        self.resnets = nn.LayerList([HunyuanVideo15ResnetBlock(in_channels if i == 0 else out_channels, out_channels)
                                     for i in range(num_layers)])
        self.upsamplers = None if upsample_out_channels is None else nn.LayerList(
            [HunyuanVideo15Upsample(out_channels, upsample_out_channels, add_temporal_upsample)])
        self.gradient_checkpointing = False

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        for layer in [*self.resnets, *(self.upsamplers or [])]:
            x = layer(x)
        return x


def _run_blocks(coder: nn.Layer, blocks: Sequence[nn.Layer], x: paddle.Tensor) -> paddle.Tensor:
    """The blocks in turn; each recomputed in the backward under enable_gradient_checkpointing (as diffusers)."""
    checkpointed = coder.gradient_checkpointing and paddle.is_grad_enabled()
    for block in blocks:
        x = recompute(block, x, use_reentrant=False) if checkpointed else block(x)
    return x


class HunyuanVideo15Encoder3D(nn.Layer):
    """conv_in, down blocks (spatial 2x in the first log2(spatial) of them, temporal too in the last log2(temporal)
    of those), mid block, then norm -> act -> conv_out to the moments plus a shortcut: the mid block's output
    averaged down to out_channels."""

    def __init__(self, in_channels: int = 3, out_channels: int = 64,
                 block_out_channels: Tuple[int, ...] = (128, 256, 512, 1024, 1024), layers_per_block: int = 2,
                 temporal_compression_ratio: int = 4, spatial_compression_ratio: int = 16,
                 downsample_match_channel: bool = True) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.group_size = block_out_channels[-1] // out_channels
        self.conv_in = HunyuanVideo15CausalConv3d(in_channels, block_out_channels[0], kernel_size=3)
        spatial_stages = math.log2(spatial_compression_ratio)
        first_temporal = math.log2(spatial_compression_ratio // temporal_compression_ratio)
        self.down_blocks = nn.LayerList()
        channels = block_out_channels[0]
        for i, width in enumerate(block_out_channels):
            if i < spatial_stages:
                out = block_out_channels[i + 1] if downsample_match_channel else width
                block = HunyuanVideo15DownBlock3D(channels, width, layers_per_block, downsample_out_channels=out,
                                                  add_temporal_downsample=i >= first_temporal)
            else:
                out = width
                block = HunyuanVideo15DownBlock3D(channels, width, layers_per_block, downsample_out_channels=None,
                                                  add_temporal_downsample=False)
            self.down_blocks.append(block)
            channels = out
        self.mid_block = HunyuanVideo15MidBlock(block_out_channels[-1])
        self.norm_out = HunyuanVideo15RMSNorm(block_out_channels[-1], images=False)
        self.conv_act = nn.Swish()
        self.conv_out = HunyuanVideo15CausalConv3d(block_out_channels[-1], out_channels, kernel_size=3)
        self.gradient_checkpointing = False

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = _run_blocks(self, [*self.down_blocks, self.mid_block], self.conv_in(x))
        shortcut = channel_group_mean(x, self.out_channels)
        return self.conv_out(self.conv_act(self.norm_out(x))) + shortcut


class HunyuanVideo15Decoder3D(nn.Layer):
    """conv_in plus the latent's channels repeated to its width, mid block, up blocks (layers_per_block + 1 resnets
    each; spatial 2x in the first log2(spatial), temporal too in the first log2(temporal)), norm -> act -> conv_out."""

    def __init__(self, in_channels: int = 32, out_channels: int = 3,
                 block_out_channels: Tuple[int, ...] = (1024, 1024, 512, 256, 128), layers_per_block: int = 2,
                 spatial_compression_ratio: int = 16, temporal_compression_ratio: int = 4,
                 upsample_match_channel: bool = True) -> None:
        super().__init__()
        self.layers_per_block = layers_per_block
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.repeat = block_out_channels[0] // in_channels
        self.conv_in = HunyuanVideo15CausalConv3d(in_channels, block_out_channels[0], kernel_size=3)
        self.mid_block = HunyuanVideo15MidBlock(block_out_channels[0])
        self.up_blocks = nn.LayerList()
        channels = block_out_channels[0]
        for i, width in enumerate(block_out_channels):
            temporal = i < math.log2(temporal_compression_ratio)
            if i < math.log2(spatial_compression_ratio) or temporal:
                out = block_out_channels[i + 1] if upsample_match_channel else width
                block = HunyuanVideo15UpBlock3D(channels, width, layers_per_block + 1, upsample_out_channels=out,
                                                add_temporal_upsample=temporal)
            else:
                out = width
                block = HunyuanVideo15UpBlock3D(channels, width, layers_per_block + 1, upsample_out_channels=None,
                                                add_temporal_upsample=False)
            self.up_blocks.append(block)
            channels = out
        self.norm_out = HunyuanVideo15RMSNorm(block_out_channels[-1], images=False)
        self.conv_act = nn.Swish()
        self.conv_out = HunyuanVideo15CausalConv3d(block_out_channels[-1], out_channels, kernel_size=3)
        self.gradient_checkpointing = False

    def forward(self, z: paddle.Tensor) -> paddle.Tensor:
        x = self.conv_in(z) + paddle.repeat_interleave(z, self.repeat, axis=1)
        x = _run_blocks(self, [self.mid_block, *self.up_blocks], x)
        return self.conv_out(self.conv_act(self.norm_out(x)))


# ---- what image fine-tuning needs to know

@dataclass(frozen=True)
class VideoOnlyChannels:
    """Output channels of a conv (`name` its weight or bias) that only a clip's frames after the first reach; a
    one-frame pass gives them an exactly zero gradient."""

    name: str
    channels: Tuple[int, ...]

    def part(self, value: Any) -> Any:
        """Those channels of `value` (a weight or bias, or its gradient: output channels on axis 0)."""
        return value[list(self.channels)]


# ---- the model

class AutoencoderKLHunyuanVideo15(ModelMixin, ConfigMixin):
    """diffusers' AutoencoderKLHunyuanVideo15 (0.42.1): same constructor, config keys, parameter names and outputs
    (module docstring for where it differs)."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, in_channels: int = 3, out_channels: int = 3, latent_channels: int = 32,
                 block_out_channels: Tuple[int] = (128, 256, 512, 1024, 1024), layers_per_block: int = 2,
                 spatial_compression_ratio: int = 16, temporal_compression_ratio: int = 4,
                 downsample_match_channel: bool = True, upsample_match_channel: bool = True,
                 scaling_factor: float = 1.03682) -> None:
        super().__init__()
        block_out_channels = tuple(block_out_channels)
        self.encoder = HunyuanVideo15Encoder3D(
            in_channels=in_channels, out_channels=latent_channels * 2, block_out_channels=block_out_channels,
            layers_per_block=layers_per_block, temporal_compression_ratio=temporal_compression_ratio,
            spatial_compression_ratio=spatial_compression_ratio, downsample_match_channel=downsample_match_channel)
        self.decoder = HunyuanVideo15Decoder3D(
            in_channels=latent_channels, out_channels=out_channels, block_out_channels=block_out_channels[::-1],
            layers_per_block=layers_per_block, temporal_compression_ratio=temporal_compression_ratio,
            spatial_compression_ratio=spatial_compression_ratio, upsample_match_channel=upsample_match_channel)
        self.spatial_compression_ratio = spatial_compression_ratio
        self.temporal_compression_ratio = temporal_compression_ratio
        self.use_slicing = False
        self.use_tiling = False
        # diffusers' tiling defaults: 256 px tiles (16 latents at f16), overlapping by a quarter.
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_latent_min_height = self.tile_sample_min_height // spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // spatial_compression_ratio
        self.tile_overlap_factor = 0.25

    def _set_gradient_checkpointing(self, module: nn.Layer, value: bool = False) -> None:
        if isinstance(module, (HunyuanVideo15Encoder3D, HunyuanVideo15Decoder3D)):
            module.gradient_checkpointing = value

    # -- options (diffusers' names)

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None,
                      tile_latent_min_height: Optional[int] = None, tile_latent_min_width: Optional[int] = None,
                      tile_overlap_factor: Optional[float] = None) -> None:
        """Encode and decode large inputs in overlapping spatial tiles (unset sizes unchanged; as diffusers, the
        latent tile size is not derived from the sample one)."""
        self.use_tiling = True
        self.tile_sample_min_height = tile_sample_min_height or self.tile_sample_min_height
        self.tile_sample_min_width = tile_sample_min_width or self.tile_sample_min_width
        self.tile_latent_min_height = tile_latent_min_height or self.tile_latent_min_height
        self.tile_latent_min_width = tile_latent_min_width or self.tile_latent_min_width
        self.tile_overlap_factor = tile_overlap_factor or self.tile_overlap_factor

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def enable_slicing(self) -> None:
        """Encode and decode a batch one sample at a time."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    @property
    def temporal_stages(self) -> int:
        """How many encoder stages halve time (log2 of the temporal factor)."""
        return sum(1 for block in self.encoder.down_blocks
                   if block.downsamplers is not None and block.downsamplers[0].add_temporal_downsample)

    # -- encode

    def _check_clip(self, x: paddle.Tensor) -> None:
        if x.ndim != 5:
            raise ValueError(f"expected (N, C, T, H, W) pixels, got shape {list(x.shape)} (an image is T = 1)")
        step = 2 ** self.temporal_stages
        if (x.shape[2] - 1) % step:
            raise ValueError(f"{x.shape[2]} frames: the encoder takes 1 + {step}k frames (an image is 1)")

    def _encode(self, x: paddle.Tensor) -> paddle.Tensor:
        """The moments (2 * latent_channels: mean, then log-variance) of (N, C, T, H, W) pixels."""
        self._check_clip(x)
        if self.use_tiling and (x.shape[4] > self.tile_sample_min_width or x.shape[3] > self.tile_sample_min_height):
            return self.tiled_encode(x)
        return self.encoder(x)

    def encode(self, x: paddle.Tensor, return_dict: bool = True
               ) -> Union[AutoencoderKLOutput, Tuple[DiagonalGaussianDistribution]]:
        """The posterior of (N, C, T, H, W) pixels on [-1, 1]: `.latent_dist`, 5-D (N, latent_channels, T', h, w)
        with `.mean`, `.logvar`, `.var`, `.std`, `.mode()`, `.sample(generator)`, `.kl()`."""
        if self.use_slicing and x.shape[0] > 1:
            moments = paddle.concat([self._encode(part) for part in x.split(x.shape[0])])
        else:
            moments = self._encode(x)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    # -- decode

    def _decode(self, z: paddle.Tensor, clamp: bool = False) -> paddle.Tensor:
        """Pixels of (N, latent_channels, T', h, w) latents, unclamped unless `clamp` (to [-1, 1])."""
        if self.use_tiling and (z.shape[4] > self.tile_latent_min_width or z.shape[3] > self.tile_latent_min_height):
            out = self.tiled_decode(z)
        else:
            out = self.decoder(z)
        return out.clip(-1.0, 1.0) if clamp else out

    def decode(self, z: paddle.Tensor, return_dict: bool = True, clamp: bool = False
               ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """`.sample`: the decoder's output for latents, not clamped (diffusers' decode clamps nothing);
        `clamp=True` clamps it to [-1, 1]."""
        if self.use_slicing and z.shape[0] > 1:
            decoded = paddle.concat([self._decode(part, clamp) for part in z.split(z.shape[0])])
        else:
            decoded = self._decode(z, clamp)
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    def forward(self, sample: paddle.Tensor, sample_posterior: bool = False, return_dict: bool = True,
                generator: Optional[paddle.Generator] = None, clamp: bool = False
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        posterior = self.encode(sample).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, return_dict=return_dict, clamp=clamp)

    # -- tiling (diffusers' arithmetic: strides of (1 - overlap) tiles, blends of overlap x the other space's tile)

    def tiled_encode(self, x: paddle.Tensor) -> paddle.Tensor:
        """Moments of pixels encoded in overlapping tiles, blended (the blended rows and columns cropped off)."""
        stride_h = int(self.tile_sample_min_height * (1 - self.tile_overlap_factor))
        stride_w = int(self.tile_sample_min_width * (1 - self.tile_overlap_factor))
        blend_h = int(self.tile_latent_min_height * self.tile_overlap_factor)
        blend_w = int(self.tile_latent_min_width * self.tile_overlap_factor)
        rows = [[self.encoder(x[:, :, :, i:i + self.tile_sample_min_height, j:j + self.tile_sample_min_width])
                 for j in range(0, x.shape[4], stride_w)] for i in range(0, x.shape[3], stride_h)]
        return _blend_tiles(rows, blend_h, blend_w, self.tile_latent_min_height - blend_h,
                            self.tile_latent_min_width - blend_w)

    def tiled_decode(self, z: paddle.Tensor) -> paddle.Tensor:
        """Pixels of latents decoded in overlapping tiles, blended."""
        stride_h = int(self.tile_latent_min_height * (1 - self.tile_overlap_factor))
        stride_w = int(self.tile_latent_min_width * (1 - self.tile_overlap_factor))
        blend_h = int(self.tile_sample_min_height * self.tile_overlap_factor)
        blend_w = int(self.tile_sample_min_width * self.tile_overlap_factor)
        rows = [[self.decoder(z[:, :, :, i:i + self.tile_latent_min_height, j:j + self.tile_latent_min_width])
                 for j in range(0, z.shape[4], stride_w)] for i in range(0, z.shape[3], stride_h)]
        return _blend_tiles(rows, blend_h, blend_w, self.tile_sample_min_height - blend_h,
                            self.tile_sample_min_width - blend_w)

    # -- what fine-tuning needs

    def encoder_side_modules(self) -> List[Tuple[str, nn.Layer]]:
        """(name, layer) of everything that defines the latents: the encoder alone (the moments are its output;
        there is no quant_conv). The decoder side is `decoder`."""
        return [("encoder", self.encoder)]

    def encoder_last_layer(self) -> nn.Layer:
        """The Conv3D making the moments (encoder.conv_out.conv; a parameter-free channel-mean shortcut of the mid
        block's output is added to it)."""
        return self.encoder.conv_out.conv

    def decoder_last_layer(self) -> paddle.Tensor:
        """The weight of the conv producing the pixels (decoder.conv_out.conv.weight)."""
        return self.decoder.conv_out.conv.weight

    def checkpoint_segments(self) -> List[Tuple[str, nn.Layer]]:
        """(name, block) that recompute may re-run in the backward: the encoder's down blocks and mid block, the
        decoder's mid block and up blocks. Each is a pure function of its input for any number of frames (no cache,
        no state); the decoder's norm_out / conv_out are not among them."""
        return ([(f"encoder.down_blocks.{i}", block) for i, block in enumerate(self.encoder.down_blocks)]
                + [("encoder.mid_block", self.encoder.mid_block), ("decoder.mid_block", self.decoder.mid_block)]
                + [(f"decoder.up_blocks.{i}", block) for i, block in enumerate(self.decoder.up_blocks)])

    def video_only_weights(self) -> List[VideoOnlyChannels]:
        """What a one-frame (T = 1) pass never reaches: in each temporal upsampler's conv, the output channels
        frame 0 drops (half of them: weight and bias rows). Every other weight, every temporal tap included (the
        replicate padding feeds them the frame itself), gets a gradient from images."""
        out = []
        for name, layer in self.named_sublayers():
            if isinstance(layer, HunyuanVideo15Upsample) and layer.add_temporal_upsample:
                used = set(layer.first_frame_channels())
                unused = tuple(k for k in range(layer.conv.conv.weight.shape[0]) if k not in used)
                out += [VideoOnlyChannels(f"{name}.conv.conv.{leaf}", unused) for leaf in ("weight", "bias")]
        return out
