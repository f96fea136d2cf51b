"""Wan's causal 3D VAE in Paddle: diffusers' `AutoencoderKLWan` (0.42.1), Wan 2.1 and Wan 2.2's residual, patchified
variant (`is_residual`, `patch_size` 2, 12 in/out channels, `decoder_base_dim`, `scale_factor_spatial` 16).

This file owns the building blocks that Wan and Qwen-Image share (same math, same parameter names: causal 3D convs,
RMS norms, resamplers, residual and attention blocks, the 3D encoder and decoder), the feature cache, the shared
encode / decode / tiling machinery (`CausalVideoVAE`) and `AutoencoderKLWan`. autoencoder_kl_qwenimage.py owns only
`AutoencoderKLQwenImage`, its constructor and the one place its outputs differ.

Parameter names, shapes and config keys are diffusers'. ppdiffusers' `convert_pytorch_state_dict_to_paddle` reads
diffusers' safetensors as they are and `save_pretrained(dir, to_diffusers=True)` writes folders diffusers loads (the
models hold no `paddle.nn.Linear`, so nothing is transposed).

Input (N, C, T, H, W); an image is T = 1. Clips are run as diffusers runs them: the encoder takes frame 0, then chunks
of 4 frames (frames past the last whole chunk of a clip of other than 1 + 4k frames are dropped, as in diffusers), the
decoder one latent frame at a time, each causal layer carrying its last input frames to the next chunk.

The cache is explicit: a chunk's pass through the encoder or decoder (`ChunkPass`, `encoder_pass` / `decoder_pass`)
is a function of the chunk and of the tensors the chunk before left (`ChunkCache.previous`), returning its output and
the tensors it leaves (`ChunkCache.next`); each causal conv with a temporal kernel owns a fixed slot (`cache_slot`), so
no counter moves and the model holds no state between calls. Re-running a chunk's pass in the backward therefore
reads exactly what the first run read: --recompute re-runs each chunk whole (`checkpoint_segments()` lists the passes)
and the gradients are bit-identical to the one-shot ones (tests/test_wan_clips.py). A chunk's outputs, frames and
cache, join in one backward node (`joined_in_backward`), so the backward runs chunk by chunk, last first: a recomputed
clip holds each chunk's input, output and cache tensors (2 frames per cached conv, copied out of the activations: a
slice would keep all of them alive) and one chunk's activations at a time.

One frame (T = 1), the training case for images: the one-frame path. `run_encoder` / `run_decoder` (under encode,
decode and the tiles) run a one-frame input through the encoder and decoder with no cache at all (`cache=None`):
every block is then a pure function of its input, so gradient checkpointing may re-run any block's forward in the
backward (`checkpoint_segments()` lists the blocks). It is the cached path exactly (`cached=True` forces that one):
with an empty cache a causal conv pads its input in front with zeros (so a single frame runs as a 2D conv with the
kernel's last temporal tap, the only one that meets data), the temporal downsampler and upsampler skip
their `time_conv`, and the residual decoder's `DupUp3D` keeps the last of its duplicated frames (`first_chunk`);
tests/test_autoencoder_kl_wan.py checks equality with the cached path, with diffusers, and of gradients with every
block recomputed.

Decoding: `decode(z).sample` is clamped to [-1, 1] as in diffusers; `decode(z, clamp=False)` (or
`_decode(z, clamp=False)`) returns the decoder's output before that clamp, for a training loss that needs gradients
past [-1, 1].

What later image fine-tuning needs (methods of both classes):
    decoder_last_layer()   `decoder.conv_out.weight`, the conv producing the image (Wan 2.2: the 12 patchified
                           channels, before unpatchify)
    encoder_last_layer()   `quant_conv`, the 1x1x1 conv producing mean and log-variance (2 * z_dim channels) from
                           `encoder.conv_out`'s output
    ENCODER_SIDE           ("encoder", "quant_conv"): everything that defines the latents; the decoder side is
                           post_quant_conv and decoder
    video_only_weights()   what a T = 1 pass never touches (`VideoOnlyWeight`):
        whole tensors: every `time_conv.weight` / `.bias` of the temporal resamplers, i.e. for Wan 2.1 and Qwen-Image
            `encoder.down_blocks.{i}.time_conv` (downsample3d) and `decoder.up_blocks.{i}.upsamplers.0.time_conv`
            (upsample3d); for Wan 2.2 (is_residual) `encoder.down_blocks.{i}.downsampler.time_conv` and
            `decoder.up_blocks.{i}.upsampler.time_conv`;
        kernel taps: `weight[:, :, :2]` (the two earlier-frame taps, which a single frame only ever multiplies with
            the zero padding) of every 3x3x3 causal conv: encoder.conv_in, encoder.conv_out, decoder.conv_in,
            decoder.conv_out and each residual block's conv1 / conv2 (down, mid and up blocks).
    These get no gradient from a one-frame pass (None, or exactly zero for the taps); an optimizer's weight decay
    would still move them, so keeping them bit-identical needs them excluded from the decay (or frozen).

Where this port knowingly differs from diffusers 0.42.1:
    - attn_scales non-empty: diffusers' encoder calls its down-block attention with cache arguments the attention's
      forward does not take, so its `encode` raises TypeError for any such config (the published ones all have
      attn_scales []); here the attention runs (per frame, it has no temporal state). The test checks it against
      diffusers' attention called without those arguments.
    - `latent_dist.kl()` / `nll()` sum over every non-batch axis (5-D: C, T, H, W); diffusers' and ppdiffusers'
      sum over axes 1-3 only, which for 5-D leaves the width unsummed.
    - fresh weights use Paddle's default initialisers (diffusers': PyTorch's); loaded weights are what count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer
from ppdiffusers.configuration_utils import ConfigMixin, register_to_config
from ppdiffusers.models.activations import get_activation
from ppdiffusers.models.modeling_outputs import AutoencoderKLOutput
from ppdiffusers.models.modeling_utils import ModelMixin
from ppdiffusers.models.vae import DecoderOutput
from ppdiffusers.models.vae import DiagonalGaussianDistribution as _PPDiagonalGaussian

# How many trailing frames each causal layer hands to the next chunk (the 3-tap kernels need two).
CACHE_T = 2
ENCODER_SIDE = ("encoder", "quant_conv")
# Frames per encoder chunk after the first (one-frame) chunk: 4 in diffusers, whatever the temporal factor.
ENCODER_CHUNK = 4


# ---- the posterior

class DiagonalGaussianDistribution(_PPDiagonalGaussian):
    """ppdiffusers' diagonal Gaussian (mean, logvar clipped to [-30, 20], std, var, mode(), sample()); elementwise,
    so 5-D (N, C, T, H, W) works as it is. kl() and nll() sum over every non-batch axis, not axes 1-3 only."""

    def _non_batch_axes(self) -> List[int]:
        return list(range(1, self.mean.ndim))

    def kl(self, other: Optional["DiagonalGaussianDistribution"] = None) -> paddle.Tensor:
        if self.deterministic:
            return paddle.to_tensor([0.0])
        if other is None:
            terms = self.mean.pow(2) + self.var - 1.0 - self.logvar
        else:
            terms = ((self.mean - other.mean).pow(2) / other.var + self.var / other.var - 1.0 - self.logvar
                     + other.logvar)
        return 0.5 * paddle.sum(terms, axis=self._non_batch_axes())

    def nll(self, sample: paddle.Tensor, dims: Optional[Sequence[int]] = None) -> paddle.Tensor:
        if self.deterministic:
            return paddle.to_tensor([0.0])
        terms = math.log(2.0 * math.pi) + self.logvar + (sample - self.mean).pow(2) / self.var
        return 0.5 * paddle.sum(terms, axis=list(dims) if dims is not None else self._non_batch_axes())


# ---- the feature cache

class _FirstChunkSeen:
    """What a temporal upsampler stores after the first chunk: it saw one, but its frame is not doubled."""

    def __repr__(self) -> str:
        return "FIRST_CHUNK_SEEN"


FIRST_CHUNK_SEEN = _FirstChunkSeen()


class ChunkCache:
    """The causal state at one chunk of a clip, as explicit values: `previous[slot]`, what the chunk before left in
    each cached layer's slot (read, never written), and `next[slot]`, what this chunk leaves for the one after.

    Each causal conv with a temporal kernel owns one slot (`cache_slot`, fixed when its encoder or decoder is built:
    `number_cache_slots`; a temporal resampler keeps its state in its time_conv's). No counter, no state in the
    model: a chunk's pass (`ChunkPass`) is a function of its input and `previous` alone."""

    def __init__(self, previous: Sequence[Any]) -> None:
        self.previous = tuple(previous)
        self.next: List[Any] = [None] * len(self.previous)


def number_cache_slots(coder: nn.Layer) -> int:
    """Give each causal conv of `coder` with a temporal kernel its own `cache_slot`; returns how many there are."""
    convs = [layer for layer in coder.sublayers() if isinstance(layer, WanCausalConv3d) and layer._kernel_size[0] > 1]
    for slot, conv in enumerate(convs):
        conv.cache_slot = slot
    return len(convs)


def last_frames(x: paddle.Tensor, count: int) -> paddle.Tensor:
    """x[:, :, -count:] (all of x when it has fewer frames), as a tensor of its own: a slice would be a view keeping
    all of x alive for as long as the cache holds it."""
    return x[:, :, max(0, x.shape[2] - count):].contiguous()


def _tail_for_next_chunk(x: paddle.Tensor, previous: Optional[paddle.Tensor]) -> paddle.Tensor:
    """The CACHE_T frames the next chunk must see before its own: x's last ones, topped up with the previous
    chunk's last frame when x is a single frame."""
    tail = last_frames(x, CACHE_T)
    if tail.shape[2] < CACHE_T and previous is not None:
        tail = paddle.concat([previous[:, :, -1:], tail], axis=2)
    return tail


# ---- layers

class WanCausalConv3d(nn.Conv3D):
    """A Conv3D padded in time at the front only (2 * padding_t frames), so frame t sees frames <= t; spatial padding
    is symmetric. `forward(x, cache)` puts the previous chunk's frames in front of x instead of that many zeros.

    One frame and no cache (an image, or a clip's first frame): only the last temporal tap meets data, the others
    meet the zero padding, so it runs as a 2D conv with that tap (a third of the work and activation memory of a
    3x3x3 conv over the padded frames; equal within float rounding). The other taps get an exactly zero gradient."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Union[int, Sequence[int]],
                 stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int]] = 0) -> None:
        pad_t, pad_h, pad_w = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        # The conv pads space itself; time is padded by hand, all of it in front.
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=[0, pad_h, pad_w])
        self.time_pad = 2 * pad_t

    def forward(self, x: paddle.Tensor, cache: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        if cache is None and x.shape[2] == 1 and self.time_pad == self._kernel_size[0] - 1:
            return self._one_frame(x)
        front = self.time_pad
        if cache is not None and front > 0:
            x = paddle.concat([cache if cache.dtype == x.dtype else cache.astype(x.dtype), x], axis=2)
            front -= cache.shape[2]
        if front > 0:
            zeros = paddle.zeros([x.shape[0], x.shape[1], front, x.shape[3], x.shape[4]], dtype=x.dtype)
            x = paddle.concat([zeros, x], axis=2)
        return super().forward(x)

    def _one_frame(self, x: paddle.Tensor) -> paddle.Tensor:
        """The conv of a single zero-padded frame: a 2D conv with the last temporal tap."""
        out = F.conv2d(x.squeeze(2), self.weight[:, :, -1], self.bias, stride=self._stride[1:],
                       padding=self._padding[1:], dilation=self._dilation[1:], groups=self._groups)
        return out.unsqueeze(2)

    def step(self, x: paddle.Tensor, cache: Optional[ChunkCache]) -> paddle.Tensor:
        """The conv on one chunk: with a cache, fed the previous chunk's last frames and leaving its own."""
        if cache is None:
            return self(x)
        previous = cache.previous[self.cache_slot]
        cache.next[self.cache_slot] = _tail_for_next_chunk(x, previous)
        return self(x, previous)


# Floats narrower than float32. diffusers (PR #13316) normalises them in float32: a float16 sum of squares over a
# few hundred channels overflows, bfloat16's and float8's lose most of their digits. (Paddle's CPU has no float16,
# bfloat16 or float8 kernel for the norm at all.)
NARROW_FLOATS = tuple(getattr(paddle, name) for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
                      if hasattr(paddle, name))


def unit_normalize(x: paddle.Tensor, axis: int) -> paddle.Tensor:
    """x / max(||x||_2, 1e-12) along `axis` (torch's F.normalize), in float32 for a narrow float x, then cast back
    to x's dtype (as diffusers' RMS norms: the scale and gamma are applied after the cast)."""
    if x.dtype not in NARROW_FLOATS:
        return F.normalize(x, p=2, axis=axis, epsilon=1e-12)
    return F.normalize(x.astype("float32"), p=2, axis=axis, epsilon=1e-12).astype(x.dtype)


class WanRMSNorm(nn.Layer):
    """x / ||x||_2 over the channels (axis 1) * sqrt(dim) * gamma (+ bias): diffusers' WanRMS_norm. `images`: gamma
    broadcasts over (H, W), else over (T, H, W). Narrow floats (float16, bfloat16, float8) are normalised in float32
    and cast back before the scale (`unit_normalize`), as diffusers does."""

    def __init__(self, dim: int, channel_first: bool = True, images: bool = True, bias: bool = False) -> None:
        super().__init__()
        broadcast = (1, 1) if images else (1, 1, 1)
        shape = [dim, *broadcast] if channel_first else [dim]
        self.channel_first = channel_first
        self.scale = dim ** 0.5
        self.gamma = self.create_parameter(shape, default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter(shape, default_initializer=nn.initializer.Constant(0.0)) if bias else 0.0

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return unit_normalize(x, axis=1 if self.channel_first else -1) * self.scale * self.gamma + self.bias


class WanUpsample2x(nn.Layer):
    """Nearest 2x spatial upsampling (for a factor of 2 PyTorch's nearest-exact picks the same pixels), in float32
    for half precision inputs like diffusers' WanUpsample."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        upcast = x.dtype != paddle.float32
        out = F.interpolate(x.astype("float32") if upcast else x, scale_factor=2.0, mode="nearest")
        return out.astype(x.dtype) if upcast else out


def _per_frame(layer: nn.Layer, x: paddle.Tensor) -> paddle.Tensor:
    """A 2D layer applied to each frame of (B, C, T, H, W)."""
    b, c, t, h, w = x.shape
    frames = layer(x.transpose([0, 2, 1, 3, 4]).reshape([b * t, c, h, w]))
    return frames.reshape([b, t, *frames.shape[1:]]).transpose([0, 2, 1, 3, 4])


class WanResample(nn.Layer):
    """Spatial 2x up- or downsampling per frame (`resample`), with a temporal 2x (`time_conv`) in the 3d modes.

    upsample3d: time_conv makes 2C channels, read as two frames per frame (skipped on the first chunk, so one latent
    frame decodes to one frame). downsample3d: time_conv (3 taps, stride 2) over the previous chunk's last frame and
    this chunk's (skipped on the first chunk). Without a cache both are skipped: the one-frame path."""

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

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
            self.time_conv = WanCausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = WanCausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=0)

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        if self.mode == "upsample3d" and cache is not None:
            x = self._double_frames(x, cache)
        x = _per_frame(self.resample, x)
        if self.mode == "downsample3d" and cache is not None:
            x = self._halve_frames(x, cache)
        return x

    def _double_frames(self, x: paddle.Tensor, cache: ChunkCache) -> paddle.Tensor:
        slot = self.time_conv.cache_slot
        previous = cache.previous[slot]
        if previous is None:
            cache.next[slot] = FIRST_CHUNK_SEEN
            return x
        first = previous is FIRST_CHUNK_SEEN
        tail = last_frames(x, CACHE_T)
        if tail.shape[2] < CACHE_T:  # after the first chunk the frame before is "zero", as the conv's own padding
            tail = paddle.concat([paddle.zeros_like(tail) if first else previous[:, :, -1:], tail], axis=2)
        doubled = self.time_conv(x, None if first else previous)
        cache.next[slot] = tail
        b, c, t, h, w = x.shape
        # Channels [0, C) are each frame's first output frame, [C, 2C) its second: interleave them in time.
        doubled = doubled.reshape([b, 2, c, t, h, w]).transpose([0, 2, 3, 1, 4, 5])
        return doubled.reshape([b, c, t * 2, h, w])

    def _halve_frames(self, x: paddle.Tensor, cache: ChunkCache) -> paddle.Tensor:
        slot = self.time_conv.cache_slot
        previous = cache.previous[slot]
        cache.next[slot] = last_frames(x, 1)
        if previous is None:
            return x
        return self.time_conv(paddle.concat([previous[:, :, -1:], x], axis=2))


class WanResidualBlock(nn.Layer):
    """norm1 -> act -> conv1 -> norm2 -> act -> dropout -> conv2, plus the input (conv_shortcut when widths differ)."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0, non_linearity: str = "silu") -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.nonlinearity = get_activation(non_linearity)
        self.norm1 = WanRMSNorm(in_dim, images=False)
        self.conv1 = WanCausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = WanRMSNorm(out_dim, images=False)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = WanCausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = WanCausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        shortcut = self.conv_shortcut(x)
        x = self.conv1.step(self.nonlinearity(self.norm1(x)), cache)
        x = self.dropout(self.nonlinearity(self.norm2(x)))
        return self.conv2.step(x, cache) + shortcut


class WanAttentionBlock(nn.Layer):
    """Single-head self-attention over the pixels of each frame (no temporal mixing, so no cache)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.norm = WanRMSNorm(dim)
        self.to_qkv = nn.Conv2D(dim, dim * 3, 1)
        self.proj = nn.Conv2D(dim, dim, 1)

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        return x + _per_frame(self._attend, x)

    def _attend(self, frames: paddle.Tensor) -> paddle.Tensor:
        n, c, h, w = frames.shape
        q, k, v = self.to_qkv(self.norm(frames)).reshape([n, 3, c, h * w]).unbind(axis=1)
        weights = F.softmax(paddle.matmul(q, k, transpose_x=True) / math.sqrt(c), axis=-1)  # (n, hw queries, hw keys)
        return self.proj(paddle.matmul(v, weights, transpose_y=True).reshape([n, c, h, w]))


class WanMidBlock(nn.Layer):
    """resnets[0], then per layer an attention and a resnet."""

    def __init__(self, dim: int, dropout: float = 0.0, non_linearity: str = "silu", num_layers: int = 1) -> None:
        super().__init__()
        self.dim = dim
        self.resnets = nn.LayerList([WanResidualBlock(dim, dim, dropout, non_linearity)
                                     for _ in range(num_layers + 1)])
        self.attentions = nn.LayerList([WanAttentionBlock(dim) for _ in range(num_layers)])

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        x = self.resnets[0](x, cache)
        for attention, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attention(x), cache)
        return x


class AvgDown3D(nn.Layer):
    """Wan 2.2's parameter-free downsampling shortcut: space-(and time-)to-channels, then the mean of each group of
    in_channels * factor / out_channels channels. Time is zero-padded in front to a multiple of factor_t."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1) -> None:
        super().__init__()
        factor = factor_t * factor_s * factor_s
        if in_channels * factor % out_channels != 0:
            raise ValueError(f"`in_channels` ({in_channels}) times the downsampling factor ({factor}) must be "
                             f"divisible by `out_channels` ({out_channels}).")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.group_size = in_channels * factor // out_channels

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        ft, fs = self.factor_t, self.factor_s
        pad_t = -x.shape[2] % ft
        if pad_t:
            x = paddle.concat([paddle.zeros([x.shape[0], x.shape[1], pad_t, *x.shape[3:]], dtype=x.dtype), x], axis=2)
        b, c, t, h, w = x.shape
        x = x.reshape([b, c, t // ft, ft, h // fs, fs, w // fs, fs]).transpose([0, 1, 3, 5, 7, 2, 4, 6])
        return x.reshape([b, self.out_channels, self.group_size, t // ft, h // fs, w // fs]).mean(axis=2)


class DupUp3D(nn.Layer):
    """Wan 2.2's parameter-free upsampling shortcut: channels repeated, then channels-to-space(-and-time). On the
    first chunk only the last of the factor_t frames is kept (one latent frame decodes to one frame)."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        factor = factor_t * factor_s * factor_s
        if out_channels * factor % in_channels != 0:
            raise ValueError(f"`out_channels` ({out_channels}) times the upsampling factor ({factor}) must be "
                             f"divisible by `in_channels` ({in_channels}).")
        self.repeats = out_channels * factor // in_channels

    def forward(self, x: paddle.Tensor, first_chunk: bool = False) -> paddle.Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = paddle.repeat_interleave(x, self.repeats, axis=1)
        b, _, t, h, w = x.shape
        x = x.reshape([b, self.out_channels, ft, fs, fs, t, h, w]).transpose([0, 1, 5, 2, 6, 3, 7, 4])
        x = x.reshape([b, self.out_channels, t * ft, h * fs, w * fs])
        return x[:, :, ft - 1:] if first_chunk else x


class WanResidualDownBlock(nn.Layer):
    """Wan 2.2's encoder stage: resnets and a downsampler, plus the AvgDown3D shortcut of the stage's input."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float, num_res_blocks: int,
                 temperal_downsample: bool = False, down_flag: bool = False) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown3D(in_dim, out_dim, factor_t=2 if temperal_downsample else 1,
                                      factor_s=2 if down_flag else 1)
        self.resnets = nn.LayerList([WanResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout)
                                     for k in range(num_res_blocks)])
        mode = "downsample3d" if temperal_downsample else "downsample2d"
        self.downsampler = WanResample(out_dim, mode=mode) if down_flag else None

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + shortcut


class WanUpBlock(nn.Layer):
    """Wan 2.1's (and Qwen-Image's) decoder stage: num_res_blocks + 1 resnets, then `upsamplers[0]` if any."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float = 0.0,
                 upsample_mode: Optional[str] = None, non_linearity: str = "silu") -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.resnets = nn.LayerList([WanResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout, non_linearity)
                                     for k in range(num_res_blocks + 1)])
        self.upsamplers = nn.LayerList([WanResample(out_dim, mode=upsample_mode)]) if upsample_mode else None

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None, first_chunk: bool = False
                ) -> paddle.Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        return self.upsamplers[0](x, cache) if self.upsamplers is not None else x


class WanResidualUpBlock(nn.Layer):
    """Wan 2.2's decoder stage: resnets and an upsampler (to out_dim), plus the DupUp3D shortcut of its input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float = 0.0,
                 temperal_upsample: bool = False, up_flag: bool = False, non_linearity: str = "silu") -> None:
        super().__init__()
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.avg_shortcut = (DupUp3D(in_dim, out_dim, factor_t=2 if temperal_upsample else 1, factor_s=2)
                             if up_flag else None)
        self.resnets = nn.LayerList([WanResidualBlock(in_dim if k == 0 else out_dim, out_dim, dropout, non_linearity)
                                     for k in range(num_res_blocks + 1)])
        mode = "upsample3d" if temperal_upsample else "upsample2d"
        self.upsampler = WanResample(out_dim, mode=mode, upsample_out_dim=out_dim) if up_flag else None

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None, first_chunk: bool = False
                ) -> paddle.Tensor:
        shortcut = self.avg_shortcut(x, first_chunk=first_chunk) if self.avg_shortcut is not None else None
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is not None:
            x = self.upsampler(x, cache)
        return x if shortcut is None else x + shortcut


class WanEncoder3d(nn.Layer):
    """conv_in, down_blocks, mid_block, norm_out, act, conv_out (z_dim channels: the model asks for 2 * z_dim).

    Wan 2.1 / Qwen-Image: down_blocks is flat (resnets, an attention after each resnet at the scales in attn_scales,
    a resampler between stages); Wan 2.2 (is_residual): one WanResidualDownBlock per stage."""

    def __init__(self, in_channels: int = 3, dim: int = 128, z_dim: int = 4, dim_mult: Sequence[int] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, attn_scales: Sequence[float] = (),
                 temperal_downsample: Sequence[bool] = (True, True, False), dropout: float = 0.0,
                 non_linearity: str = "silu", is_residual: bool = False) -> None:
        super().__init__()
        self.nonlinearity = get_activation(non_linearity)
        dims = [dim * u for u in [1, *dim_mult]]
        last = len(dim_mult) - 1
        self.conv_in = WanCausalConv3d(in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.LayerList()
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if is_residual:
                self.down_blocks.append(WanResidualDownBlock(
                    in_dim, out_dim, dropout, num_res_blocks,
                    temperal_downsample=temperal_downsample[i] if i != last else False, down_flag=i != last))
                continue
            for _ in range(num_res_blocks):
                self.down_blocks.append(WanResidualBlock(in_dim, out_dim, dropout))
                if scale in attn_scales:
                    self.down_blocks.append(WanAttentionBlock(out_dim))
                in_dim = out_dim
            if i != last:
                mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
                self.down_blocks.append(WanResample(out_dim, mode=mode))
                scale /= 2.0
        self.mid_block = WanMidBlock(dims[-1], dropout, non_linearity, num_layers=1)
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = WanCausalConv3d(dims[-1], z_dim, 3, padding=1)
        self.cache_slots = number_cache_slots(self)

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None) -> paddle.Tensor:
        x = self.conv_in.step(x, cache)
        for layer in self.down_blocks:
            x = layer(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out.step(self.nonlinearity(self.norm_out(x)), cache)


class WanDecoder3d(nn.Layer):
    """conv_in, mid_block, up_blocks, norm_out, act, conv_out (out_channels: the image, patchified for Wan 2.2).

    Wan 2.1 / Qwen-Image stages halve their widths in the upsampler, so each stage after the first starts at half
    the width listed for it; Wan 2.2's (is_residual) keep theirs. attn_scales is taken and unused, as in diffusers:
    the decoder's only attention is the mid block's."""

    def __init__(self, dim: int = 128, z_dim: int = 4, dim_mult: Sequence[int] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, attn_scales: Sequence[float] = (),
                 temperal_upsample: Sequence[bool] = (False, True, True), dropout: float = 0.0,
                 non_linearity: str = "silu", out_channels: int = 3, is_residual: bool = False) -> None:
        super().__init__()
        self.nonlinearity = get_activation(non_linearity)
        dims = [dim * u for u in [dim_mult[-1], *dim_mult[::-1]]]
        last = len(dim_mult) - 1
        self.conv_in = WanCausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = WanMidBlock(dims[0], dropout, non_linearity, num_layers=1)
        self.up_blocks = nn.LayerList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != last
            if is_residual:
                self.up_blocks.append(WanResidualUpBlock(
                    in_dim, out_dim, num_res_blocks, dropout, temperal_upsample=temperal_upsample[i] if up else False,
                    up_flag=up, non_linearity=non_linearity))
                continue
            mode = ("upsample3d" if temperal_upsample[i] else "upsample2d") if up else None
            self.up_blocks.append(WanUpBlock(in_dim // 2 if i > 0 else in_dim, out_dim, num_res_blocks, dropout,
                                             upsample_mode=mode, non_linearity=non_linearity))
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = WanCausalConv3d(dims[-1], out_channels, 3, padding=1)
        self.cache_slots = number_cache_slots(self)

    def forward(self, x: paddle.Tensor, cache: Optional[ChunkCache] = None, first_chunk: bool = False
                ) -> paddle.Tensor:
        x = self.conv_in.step(x, cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache, first_chunk=first_chunk)
        return self.conv_out.step(self.nonlinearity(self.norm_out(x)), cache)


# ---- patchify (Wan 2.2)

def patchify(x: paddle.Tensor, patch_size: int) -> paddle.Tensor:
    """(B, C, T, H, W) -> (B, C*p*p, T, H/p, W/p), channel c*p*p + j*p + i holding pixel (i, j) of each p x p patch
    (column offset first, as diffusers orders them)."""
    if patch_size == 1:
        return x
    if x.ndim != 5:
        raise ValueError(f"Invalid input shape: {x.shape}")
    b, c, t, h, w = x.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"Height ({h}) and width ({w}) must be divisible by patch_size ({patch_size})")
    p = patch_size
    x = x.reshape([b, c, t, h // p, p, w // p, p]).transpose([0, 1, 6, 4, 2, 3, 5])
    return x.reshape([b, c * p * p, t, h // p, w // p])


def unpatchify(x: paddle.Tensor, patch_size: int) -> paddle.Tensor:
    """The inverse of `patchify`."""
    if patch_size == 1:
        return x
    if x.ndim != 5:
        raise ValueError(f"Invalid input shape: {x.shape}")
    b, cpp, t, h, w = x.shape
    p = patch_size
    x = x.reshape([b, cpp // (p * p), p, p, t, h, w]).transpose([0, 1, 4, 5, 3, 6, 2])
    return x.reshape([b, cpp // (p * p), t, h * p, w * p])


# ---- tiling helpers

def blend_v(a: paddle.Tensor, b: paddle.Tensor, extent: int) -> paddle.Tensor:
    """b with its first `extent` rows faded in from a's last ones (weight of b: row / extent)."""
    extent = min(a.shape[-2], b.shape[-2], extent)
    if extent <= 0:
        return b
    weight = (paddle.arange(extent, dtype="float32") / extent).astype(b.dtype).reshape([extent, 1])
    top = a[..., a.shape[-2] - extent:, :] * (1 - weight) + b[..., :extent, :] * weight
    return paddle.concat([top, b[..., extent:, :]], axis=-2)


def blend_h(a: paddle.Tensor, b: paddle.Tensor, extent: int) -> paddle.Tensor:
    """b with its first `extent` columns faded in from a's last ones."""
    extent = min(a.shape[-1], b.shape[-1], extent)
    if extent <= 0:
        return b
    weight = (paddle.arange(extent, dtype="float32") / extent).astype(b.dtype)
    left = a[..., a.shape[-1] - extent:] * (1 - weight) + b[..., :extent] * weight
    return paddle.concat([left, b[..., extent:]], axis=-1)


def _blend_tiles(rows: List[List[paddle.Tensor]], blend_h_extent: int, blend_w_extent: int, keep_h: int,
                 keep_w: int) -> paddle.Tensor:
    """Each tile blended with the (already blended) tiles above and left of it, cropped to keep_h x keep_w, joined.
    A blended tile replaces its original in `rows`, as diffusers' in-place blending leaves it."""
    out_rows = []
    for i, row in enumerate(rows):
        kept = []
        for j in range(len(row)):
            tile = row[j]
            if i > 0:
                tile = blend_v(rows[i - 1][j], tile, blend_h_extent)
            if j > 0:
                tile = blend_h(row[j - 1], tile, blend_w_extent)
            row[j] = tile
            kept.append(tile[:, :, :, :keep_h, :keep_w])
        out_rows.append(paddle.concat(kept, axis=-1))
    return paddle.concat(out_rows, axis=3)


def encoder_chunks(num_frames: int) -> Iterator[Tuple[int, int]]:
    """The frame ranges the encoder takes, as diffusers: [0, 1), then [1 + 4k, 5 + 4k) while k < (T - 1) // 4."""
    yield 0, 1
    for k in range((num_frames - 1) // ENCODER_CHUNK):
        yield 1 + ENCODER_CHUNK * k, 1 + ENCODER_CHUNK * (k + 1)


@dataclass(frozen=True)
class VideoOnlyWeight:
    """A weight (or part of one) that only a video (T > 1) pass reaches. `taps` None: the whole tensor; k: its first
    k temporal kernel taps, `weight[:, :, :k]`."""

    name: str
    taps: Optional[int] = None

    def part(self, value: Any) -> Any:
        return value if self.taps is None else value[:, :, : self.taps]


class _OneBackwardNode(PyLayer):
    """The identity on several tensors, as one node of the backward graph: it runs, letting the backward into what
    made them, once every one of their gradients is in (zeros for one never used)."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(tensor.clone() for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def joined_in_backward(outputs: Sequence[Any]) -> List[Any]:
    """A chunk's outputs (its frames and the cache it leaves), those that need a gradient joined into one node of the
    backward, so that the chunk's backward starts once the next chunk's is through (which gives the cache's
    gradients): chunk by chunk, last first. Paddle's recompute re-runs a chunk's pass when its backward starts: left
    to itself, it would start each chunk's as soon as the loss gave its frames their gradient, every chunk at once,
    so every chunk's activations would be re-made and held together. The one-shot pass is joined the same way, so
    that its gradients are summed in the same order: the recomputed ones equal them bit for bit."""
    outputs = list(outputs)
    live = [k for k, out in enumerate(outputs) if isinstance(out, paddle.Tensor) and not out.stop_gradient]
    if len(live) > 1 and paddle.is_grad_enabled():
        for k, tensor in zip(live, _OneBackwardNode.apply(*[outputs[k] for k in live])):
            outputs[k] = tensor
    return outputs


class ChunkPass:
    """The encoder's or decoder's pass over one chunk of a clip as a function of tensors alone:
    `forward(chunk, *previous) -> (output, *next)`, `previous` and `next` the cache's slots (`ChunkCache`; the
    decoder's first chunk is flagged). It reads and writes nothing else, so --recompute (models/recompute.py) may re-run it
    whole in the backward, from the same cache tensors: a clip then keeps each chunk's input, output and cache, and
    one chunk's activations at a time. Not a Layer: the parameters are its coder's."""

    def __init__(self, coder: nn.Layer, flags_first_chunk: bool = False) -> None:
        self.coder = coder
        self.flags_first_chunk = flags_first_chunk

    def __call__(self, *args: Any, **kwargs: Any) -> Tuple[Any, ...]:
        return self.forward(*args, **kwargs)

    def forward(self, x: paddle.Tensor, *previous: Any, **kwargs: Any) -> Tuple[Any, ...]:
        cache = ChunkCache(previous)
        return (self.coder(x, cache, **kwargs), *cache.next)

    def parameters(self) -> List[paddle.Tensor]:
        return self.coder.parameters()

    def over(self, chunks: Sequence[paddle.Tensor]) -> paddle.Tensor:
        """The outputs of `chunks` in turn, each given what the one before left (nothing, the first), joined in time."""
        state, outs = (None,) * self.coder.cache_slots, []
        for k, chunk in enumerate(chunks):
            flags = {"first_chunk": k == 0} if self.flags_first_chunk else {}
            out, *state = joined_in_backward(self(chunk, *state, **flags))
            outs.append(out)
        return paddle.concat(outs, axis=2)


# ---- the model

class CausalVideoVAE(ModelMixin, ConfigMixin):
    """What AutoencoderKLWan and AutoencoderKLQwenImage share: encode / decode over the feature cache, the
    one-frame path, spatial tiling, slicing, and the lists for fine-tuning. Subclasses build encoder, quant_conv,
    post_quant_conv, decoder and set `spatial_compression_ratio`."""

    # diffusers' Qwen-Image does not clamp a tiled decode; Wan does.
    clamp_tiled_decode = True

    def _init_runtime_options(self) -> None:
        """diffusers' runtime options at their defaults, and the chunk passes over clips."""
        self.use_slicing = False
        self.use_tiling = False
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_sample_stride_height = 192
        self.tile_sample_stride_width = 192
        self.encoder_pass = ChunkPass(self.encoder)
        self.decoder_pass = ChunkPass(self.decoder, flags_first_chunk=True)

    @property
    def patch_size(self) -> int:
        return self.config.get("patch_size", None) or 1

    # -- options (diffusers' names)

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None,
                      tile_sample_stride_height: Optional[int] = None,
                      tile_sample_stride_width: Optional[int] = None) -> None:
        """Encode and decode large inputs in overlapping spatial tiles (sizes in pixels; unset ones unchanged)."""
        self.use_tiling = True
        self.tile_sample_min_height = tile_sample_min_height or self.tile_sample_min_height
        self.tile_sample_min_width = tile_sample_min_width or self.tile_sample_min_width
        self.tile_sample_stride_height = tile_sample_stride_height or self.tile_sample_stride_height
        self.tile_sample_stride_width = tile_sample_stride_width or self.tile_sample_stride_width

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def enable_slicing(self) -> None:
        """Encode and decode a batch one sample at a time."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    # -- the encoder and decoder over time

    def run_encoder(self, x: paddle.Tensor, cached: Optional[bool] = None) -> paddle.Tensor:
        """The encoder over a (patchified) clip, chunk by chunk (`encoder_pass`). One frame takes the stateless
        one-frame path unless `cached`."""
        if x.shape[2] == 1 and not cached:
            return self.encoder(x)
        return self.encoder_pass.over([x[:, :, start:stop] for start, stop in encoder_chunks(x.shape[2])])

    def run_decoder(self, x: paddle.Tensor, cached: Optional[bool] = None) -> paddle.Tensor:
        """The decoder over post_quant_conv's output, a latent frame at a time (`decoder_pass`); one frame takes the
        one-frame path unless `cached`."""
        if x.shape[2] == 1 and not cached:
            return self.decoder(x, first_chunk=True)
        return self.decoder_pass.over([x[:, :, k:k + 1] for k in range(x.shape[2])])

    # -- encode

    def _encode(self, x: paddle.Tensor) -> paddle.Tensor:
        """Mean and log-variance (2 * z_dim channels) of (B, C, T, H, W) pixels."""
        height, width = x.shape[3], x.shape[4]
        x = patchify(x, self.patch_size)
        if self.use_tiling and (width > self.tile_sample_min_width or height > self.tile_sample_min_height):
            return self.tiled_encode(x)
        return self.quant_conv(self.run_encoder(x))

    def encode(self, x: paddle.Tensor, return_dict: bool = True
               ) -> Union[AutoencoderKLOutput, Tuple[DiagonalGaussianDistribution]]:
        """The posterior of (B, C, T, H, W) pixels in [-1, 1]: `.latent_dist` (5-D, T' = 1 + (T - 1) / factor_t)."""
        if self.use_slicing and x.shape[0] > 1:
            moments = paddle.concat([self._encode(part) for part in x.split(x.shape[0])])
        else:
            moments = self._encode(x)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    # -- decode

    def _decode(self, z: paddle.Tensor, return_dict: bool = True, clamp: bool = True
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """Pixels of latents; `clamp=False`: the decoder's output before diffusers' clamp to [-1, 1]."""
        ratio = self.spatial_compression_ratio
        if self.use_tiling and (z.shape[4] > self.tile_sample_min_width // ratio
                                or z.shape[3] > self.tile_sample_min_height // ratio):
            return self.tiled_decode(z, return_dict=return_dict, clamp=clamp)
        out = unpatchify(self.run_decoder(self.post_quant_conv(z)), self.patch_size)
        if clamp:
            out = out.clip(-1.0, 1.0)
        return DecoderOutput(sample=out) if return_dict else (out,)

    def decode(self, z: paddle.Tensor, return_dict: bool = True, clamp: bool = True
               ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """`.sample`: pixels of (B, z_dim, T', h, w) latents, clamped to [-1, 1] as diffusers does (Qwen-Image's
        tiled decode excepted, as in diffusers); `clamp=False` gives the decoder's output before any clamp."""
        if self.use_slicing and z.shape[0] > 1:
            decoded = paddle.concat([self._decode(part, clamp=clamp).sample for part in z.split(z.shape[0])])
        else:
            decoded = self._decode(z, clamp=clamp).sample
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    def forward(self, sample: paddle.Tensor, sample_posterior: bool = False, return_dict: bool = True,
                generator: Optional[paddle.Generator] = None, clamp: bool = True
                ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        posterior = self.encode(sample).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, return_dict=return_dict, clamp=clamp)

    # -- tiling

    def tiled_encode(self, x: paddle.Tensor) -> paddle.Tensor:
        """Moments of (patchified) pixels encoded in overlapping tiles, blended: diffusers' tiling exactly (its tile
        sizes count patchified pixels here, as in diffusers)."""
        _, _, _, height, width = x.shape
        ratio = self.spatial_compression_ratio // self.patch_size
        tile_h, tile_w = self.tile_sample_min_height, self.tile_sample_min_width
        stride_h, stride_w = self.tile_sample_stride_height, self.tile_sample_stride_width
        rows = [[self.quant_conv(self.run_encoder(x[:, :, :, i:i + tile_h, j:j + tile_w]))
                 for j in range(0, width, stride_w)] for i in range(0, height, stride_h)]
        enc = _blend_tiles(rows, tile_h // ratio - stride_h // ratio, tile_w // ratio - stride_w // ratio,
                           stride_h // ratio, stride_w // ratio)
        return enc[:, :, :, :height // ratio, :width // ratio]

    def tiled_decode(self, z: paddle.Tensor, return_dict: bool = True, clamp: bool = True
                     ) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """Pixels of latents decoded in overlapping tiles, blended: diffusers' tiling exactly."""
        _, _, _, height, width = z.shape
        ratio, p = self.spatial_compression_ratio, self.patch_size
        tile_h, tile_w = self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        stride_h, stride_w = self.tile_sample_stride_height // ratio, self.tile_sample_stride_width // ratio
        rows = [[self.run_decoder(self.post_quant_conv(z[:, :, :, i:i + tile_h, j:j + tile_w]))
                 for j in range(0, width, stride_w)] for i in range(0, height, stride_h)]
        # The decoder's tiles are patchified pixels: blend and crop in those units.
        keep_h, keep_w = self.tile_sample_stride_height // p, self.tile_sample_stride_width // p
        dec = _blend_tiles(rows, self.tile_sample_min_height // p - keep_h, self.tile_sample_min_width // p - keep_w,
                           keep_h, keep_w)
        dec = unpatchify(dec[:, :, :, :height * ratio // p, :width * ratio // p], p)
        if clamp and self.clamp_tiled_decode:
            dec = dec.clip(-1.0, 1.0)
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    # -- what image fine-tuning needs

    def decoder_last_layer(self) -> paddle.Tensor:
        """The weight of the conv producing the image (Wan 2.2: its patchified channels)."""
        return self.decoder.conv_out.weight

    def encoder_last_layer(self) -> nn.Layer:
        """The conv producing mean and log-variance (quant_conv, fed by encoder.conv_out)."""
        return self.quant_conv

    def encoder_side_modules(self) -> List[Tuple[str, nn.Layer]]:
        """(name, layer) of everything that defines the latents: encoder and quant_conv."""
        return [(name, getattr(self, name)) for name in ENCODER_SIDE]

    def video_only_weights(self) -> List[VideoOnlyWeight]:
        """Every weight, or kernel part, that a one-frame (T = 1) pass never touches (module docstring)."""
        out = []
        for name, layer in self.named_sublayers():
            if isinstance(layer, WanResample) and hasattr(layer, "time_conv"):
                out += [VideoOnlyWeight(f"{name}.time_conv.weight"), VideoOnlyWeight(f"{name}.time_conv.bias")]
            elif isinstance(layer, WanCausalConv3d) and not name.endswith(".time_conv") and layer.time_pad > 0:
                out.append(VideoOnlyWeight(f"{name}.weight", taps=layer.time_pad))
        return out

    def checkpoint_segments(self) -> List[Tuple[str, Any]]:
        """(name, segment) that gradient checkpointing may re-run in the backward: the encoder's and decoder's
        blocks, pure functions of their input on the one-frame path, and their chunk passes over clips
        (`encoder.chunk`, `decoder.chunk`: `ChunkPass`, inside which the blocks run as they are)."""
        out = []
        for coder_name, blocks_name in (("encoder", "down_blocks"), ("decoder", "up_blocks")):
            coder = getattr(self, coder_name)
            out += [(f"{coder_name}.{blocks_name}.{i}", block) for i, block in enumerate(getattr(coder, blocks_name))]
            out.append((f"{coder_name}.mid_block", coder.mid_block))
        return out + [("encoder.chunk", self.encoder_pass), ("decoder.chunk", self.decoder_pass)]


# Wan 2.1's published latent statistics: diffusers' defaults.
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                      -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                     1.6382, 1.1253, 2.8251, 1.9160]


class AutoencoderKLWan(CausalVideoVAE):
    """diffusers' AutoencoderKLWan (0.42.1): same constructor, config keys, parameter names and outputs."""

    @register_to_config
    def __init__(self, base_dim: int = 96, decoder_base_dim: Optional[int] = None, z_dim: int = 16,
                 dim_mult: List[int] = [1, 2, 4, 4], num_res_blocks: int = 2, attn_scales: List[float] = [],
                 temperal_downsample: List[bool] = [False, True, True], dropout: float = 0.0,
                 latents_mean: List[float] = WAN21_LATENTS_MEAN, latents_std: List[float] = WAN21_LATENTS_STD,
                 is_residual: bool = False, in_channels: int = 3, out_channels: int = 3,
                 patch_size: Optional[int] = None, scale_factor_temporal: Optional[int] = 4,
                 scale_factor_spatial: Optional[int] = 8) -> None:
        super().__init__()
        self.z_dim = z_dim
        self.temperal_downsample = list(temperal_downsample)
        self.temperal_upsample = list(temperal_downsample)[::-1]
        self.encoder = WanEncoder3d(in_channels=in_channels, dim=base_dim, z_dim=z_dim * 2, dim_mult=dim_mult,
                                    num_res_blocks=num_res_blocks, attn_scales=attn_scales,
                                    temperal_downsample=temperal_downsample, dropout=dropout, is_residual=is_residual)
        self.quant_conv = WanCausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = WanCausalConv3d(z_dim, z_dim, 1)
        self.decoder = WanDecoder3d(dim=base_dim if decoder_base_dim is None else decoder_base_dim, z_dim=z_dim,
                                    dim_mult=dim_mult, num_res_blocks=num_res_blocks, attn_scales=attn_scales,
                                    temperal_upsample=self.temperal_upsample, dropout=dropout,
                                    out_channels=out_channels, is_residual=is_residual)
        self.spatial_compression_ratio = scale_factor_spatial
        if patch_size is not None and scale_factor_spatial is not None and scale_factor_spatial % patch_size:
            raise ValueError(f"scale_factor_spatial ({scale_factor_spatial}) must be a multiple of patch_size "
                             f"({patch_size})")
        self._init_runtime_options()
