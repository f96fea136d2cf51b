"""DC-AE, the deep-compression autoencoder of SANA (diffusers' `AutoencoderDC`, 0.42.1), in Paddle.

This module owns the model and every block it is made of: `ResBlock`, `EfficientViTBlock` (SANA's multi-scale
ReLU linear attention, `SanaMultiscaleLinearAttention`, followed by `GLUMBConv`), the residual down / up blocks
`DCDownBlock2d` / `DCUpBlock2d`, `Encoder`, `Decoder`, and two norms ppdiffusers 0.29 has no equal of: RMSNorm
with a bias over the channels, and a BatchNorm whose training-mode running statistics follow PyTorch's.

The constructor, its defaults and config keys, and every parameter and buffer name are diffusers', so that
ppdiffusers' `convert_pytorch_state_dict_to_paddle` reads a diffusers `diffusion_pytorch_model.safetensors`
(`state_dict_from_diffusers` adds the BatchNorm counters that conversion drops) and
`save_pretrained(dir, to_diffusers=True)` writes a folder diffusers' `AutoencoderDC.from_pretrained` loads with no
missing, unexpected or mismatched key. Float32 outputs, tiled encode / decode included, equal diffusers' to ~1e-5
(tests/test_autoencoder_dc.py). Fresh weights are drawn like PyTorch's defaults, from Paddle's global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from ppdiffusers.configuration_utils import ConfigMixin, register_to_config
from ppdiffusers.models.activations import get_activation
from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
from ppdiffusers.models.modeling_utils import ModelMixin
from ppdiffusers.models.vae import DecoderOutput as _PPDecoderOutput
from ppdiffusers.utils import BaseOutput

from .initialisation import init_like_pytorch

COUNTER_SUFFIX = ".num_batches_tracked"  # BatchNorm's counter, which ppdiffusers' PyTorch conversion drops
HALF_DTYPES = (paddle.float16, paddle.bfloat16)

StrOrSeq = Union[str, Sequence[str]]


@dataclass
class EncoderOutput(BaseOutput):
    """diffusers' EncoderOutput: the latent, (batch, latent_channels, height / f, width / f)."""

    latent: paddle.Tensor


@dataclass
class DecoderOutput(_PPDecoderOutput):
    """ppdiffusers' DecoderOutput with diffusers' optional `commit_loss` (always None here)."""

    commit_loss: Optional[paddle.Tensor] = None


# ---------------------------------------------------------------------------------------------------- norms


class ChannelRMSNorm(nn.Layer):
    """diffusers' `RMSNorm(dim, eps, elementwise_affine, bias)` applied over the channels of an NCHW tensor, which
    diffusers does by moving the channels last and back; normalising over axis 1 gives the same numbers without the
    two transposed copies. Like diffusers, the mean square is taken in float32 and half weights cast the result
    back to their dtype. (ppdiffusers 0.29's RMSNorm has no bias and its forward returns nothing.)"""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0)) \
            if elementwise_affine else None
        self.bias = self.create_parameter([dim], default_initializer=nn.initializer.Constant(0.0)) \
            if elementwise_affine and bias else None

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.astype(paddle.float32)
        variance = hidden_states.pow(2).mean(axis=1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.eps)
        if self.weight is None:
            return hidden_states.astype(input_dtype)
        if self.weight.dtype in HALF_DTYPES:
            hidden_states = hidden_states.astype(self.weight.dtype)
        hidden_states = hidden_states * _per_channel(self.weight)
        return hidden_states + _per_channel(self.bias) if self.bias is not None else hidden_states


def _per_channel(vector: paddle.Tensor) -> paddle.Tensor:
    return vector.reshape([1, -1, 1, 1])


class TorchBatchNorm2D(nn.BatchNorm2D):
    """`torch.nn.BatchNorm2d(num_features, eps, momentum=0.1)` (affine) in Paddle. Evaluation is Paddle's kernel. In
    training, Paddle's kernel would update the running variance with the biased batch variance, PyTorch with the
    unbiased one, so the training forward is written out here and updates the statistics as PyTorch does. Paddle's
    momentum weighs the running value (0.9), PyTorch's the batch (0.1). Holds PyTorch's `num_batches_tracked`
    counter (shape [1]: ppdiffusers saves a 0-d buffer as [1]; the PyTorch export writes it 0-d, vae_saving.py) so
    that diffusers finds every buffer it expects."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__(num_features, momentum=1.0 - momentum, epsilon=eps)
        self.register_buffer("num_batches_tracked", paddle.zeros([1], dtype="int64"))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not self.training:
            return super().forward(x)
        # In float32 for half inputs too (as PyTorch's kernels compute), the output in the input's dtype.
        x32 = x.astype(paddle.float32)
        mean = x32.mean(axis=[0, 2, 3])
        variance = (x32 - _per_channel(mean)).pow(2).mean(axis=[0, 2, 3])  # biased: what normalises the batch
        self._update_statistics(mean, variance, x.shape[0] * x.shape[2] * x.shape[3])
        out = (x32 - _per_channel(mean)) * paddle.rsqrt(_per_channel(variance) + self._epsilon)
        out = out * _per_channel(self.weight.astype(paddle.float32)) + _per_channel(self.bias.astype(paddle.float32))
        return out.astype(x.dtype)

    @paddle.no_grad()
    def _update_statistics(self, mean: paddle.Tensor, variance: paddle.Tensor, count: int) -> None:
        if count < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got {count}")
        batch_weight = 1.0 - self._momentum
        unbiased = variance * (count / (count - 1))
        paddle.assign(self._mean * self._momentum + mean.astype(self._mean.dtype) * batch_weight, self._mean)
        paddle.assign(self._variance * self._momentum + unbiased.astype(self._variance.dtype) * batch_weight,
                      self._variance)
        paddle.assign(self.num_batches_tracked + 1, self.num_batches_tracked)


def get_normalization(norm_type: str, num_features: int, eps: float = 1e-5) -> nn.Layer:
    """diffusers' `get_normalization` with its defaults (affine, with bias). Its layer_norm is nn.LayerNorm over the
    last axis (diffusers applies it to NCHW as it is, like batch_norm)."""
    if norm_type == "rms_norm":
        return ChannelRMSNorm(num_features, eps=eps, elementwise_affine=True, bias=True)
    if norm_type == "layer_norm":
        return nn.LayerNorm(num_features, epsilon=eps)
    if norm_type == "batch_norm":
        return TorchBatchNorm2D(num_features, eps=eps)
    raise ValueError(f"norm_type={norm_type!r} is not supported.")


# ---------------------------------------------------------------------------------------------------- blocks


class ResBlock(nn.Layer):
    """conv3x3 -> act -> conv3x3 (no bias) -> norm, plus the input."""

    def __init__(self, in_channels: int, out_channels: int, norm_type: str = "batch_norm",
                 act_fn: Optional[str] = "relu6") -> None:
        super().__init__()
        self.norm_type = norm_type
        self.nonlinearity = get_activation(act_fn) if act_fn is not None else nn.Identity()
        self.conv1 = nn.Conv2D(in_channels, in_channels, 3, 1, 1)
        self.conv2 = nn.Conv2D(in_channels, out_channels, 3, 1, 1, bias_attr=False)
        self.norm = get_normalization(norm_type, out_channels)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        out = self.conv2(self.nonlinearity(self.conv1(hidden_states)))
        return self.norm(out) + hidden_states


class SanaMultiscaleAttentionProjection(nn.Layer):
    """One extra scale of q, k, v: a depthwise kxk conv, then a 1x1 conv grouped per head of q, k and v."""

    def __init__(self, in_channels: int, num_attention_heads: int, kernel_size: int) -> None:
        super().__init__()
        channels = 3 * in_channels
        self.proj_in = nn.Conv2D(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels,
                                 bias_attr=False)
        self.proj_out = nn.Conv2D(channels, channels, 1, 1, 0, groups=3 * num_attention_heads, bias_attr=False)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        return self.proj_out(self.proj_in(hidden_states))


class SanaMultiscaleLinearAttention(nn.Layer):
    """SANA's multi-scale attention: q, k, v (bias-free Linear layers over the channels) and their multi-scale
    projections, ReLU kernels, linear attention (quadratic when the map has no more positions than a head has
    channels), out projection, norm, residual. The linear path runs in float32."""

    def __init__(self, in_channels: int, out_channels: int, num_attention_heads: Optional[int] = None,
                 attention_head_dim: int = 8, mult: float = 1.0, norm_type: str = "batch_norm",
                 kernel_sizes: Sequence[int] = (5,), eps: float = 1e-15, residual_connection: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.attention_head_dim = attention_head_dim
        self.norm_type = norm_type
        self.residual_connection = residual_connection
        if num_attention_heads is None:
            num_attention_heads = int(in_channels // attention_head_dim * mult)
        inner_dim = num_attention_heads * attention_head_dim
        self.to_q = nn.Linear(in_channels, inner_dim, bias_attr=False)
        self.to_k = nn.Linear(in_channels, inner_dim, bias_attr=False)
        self.to_v = nn.Linear(in_channels, inner_dim, bias_attr=False)
        self.to_qkv_multiscale = nn.LayerList(
            [SanaMultiscaleAttentionProjection(inner_dim, num_attention_heads, k) for k in kernel_sizes])
        self.nonlinearity = nn.ReLU()
        self.to_out = nn.Linear(inner_dim * (1 + len(kernel_sizes)), out_channels, bias_attr=False)
        self.norm_out = get_normalization(norm_type, out_channels)

    def apply_linear_attention(self, query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor) -> paddle.Tensor:
        # A row of ones under v makes the last output row the normaliser, sum_n k_n . q (diffusers pads the same).
        value = paddle.concat([value, paddle.ones_like(value[:, :, :1])], axis=2)
        hidden_states = paddle.matmul(paddle.matmul(value, key, transpose_y=True), query).astype(paddle.float32)
        return hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + self.eps)

    def apply_quadratic_attention(self, query: paddle.Tensor, key: paddle.Tensor,
                                  value: paddle.Tensor) -> paddle.Tensor:
        scores = paddle.matmul(key, query, transpose_x=True).astype(paddle.float32)
        scores = scores / (scores.sum(axis=2, keepdim=True) + self.eps)
        return paddle.matmul(value, scores.astype(value.dtype))

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        batch, _, height, width = hidden_states.shape
        use_linear_attention = height * width > self.attention_head_dim
        residual, original_dtype = hidden_states, hidden_states.dtype
        channels_last = hidden_states.transpose([0, 2, 3, 1])
        qkv = paddle.concat([self.to_q(channels_last), self.to_k(channels_last), self.to_v(channels_last)], axis=3)
        qkv = qkv.transpose([0, 3, 1, 2])
        qkv = paddle.concat([qkv] + [scale(qkv) for scale in self.to_qkv_multiscale], axis=1)
        if use_linear_attention:
            qkv = qkv.astype(paddle.float32)
        # Heads of 3 * head_dim consecutive channels, each split into its q, k, v thirds (diffusers' order).
        qkv = qkv.reshape([batch, -1, 3 * self.attention_head_dim, height * width])
        query, key, value = paddle.chunk(qkv, 3, axis=2)
        query, key = self.nonlinearity(query), self.nonlinearity(key)
        if use_linear_attention:
            out = self.apply_linear_attention(query, key, value).astype(original_dtype)
        else:
            out = self.apply_quadratic_attention(query, key, value)
        out = self.to_out(out.reshape([batch, -1, height, width]).transpose([0, 2, 3, 1])).transpose([0, 3, 1, 2])
        out = self.norm_out(out)
        return out + residual if self.residual_connection else out


class GLUMBConv(nn.Layer):
    """Inverted 1x1 conv -> SiLU -> depthwise 3x3 -> gated by SiLU of its second half -> 1x1 conv -> norm, plus
    the input (SANA's gated MBConv)."""

    def __init__(self, in_channels: int, out_channels: int, expand_ratio: float = 4,
                 norm_type: Optional[str] = None, residual_connection: bool = True) -> None:
        super().__init__()
        hidden_channels = int(expand_ratio * in_channels)
        self.norm_type = norm_type
        self.residual_connection = residual_connection
        self.nonlinearity = nn.Silu()
        self.conv_inverted = nn.Conv2D(in_channels, hidden_channels * 2, 1, 1, 0)
        self.conv_depth = nn.Conv2D(hidden_channels * 2, hidden_channels * 2, 3, 1, 1, groups=hidden_channels * 2)
        self.conv_point = nn.Conv2D(hidden_channels, out_channels, 1, 1, 0, bias_attr=False)
        self.norm = ChannelRMSNorm(out_channels, eps=1e-5, elementwise_affine=True, bias=True) \
            if norm_type == "rms_norm" else None

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        out = self.conv_depth(self.nonlinearity(self.conv_inverted(hidden_states)))
        out, gate = paddle.chunk(out, 2, axis=1)  # first half the values, second half the gate
        out = self.conv_point(out * self.nonlinearity(gate))
        if self.norm is not None:
            out = self.norm(out)
        return out + hidden_states if self.residual_connection else out


class EfficientViTBlock(nn.Layer):
    """Multi-scale linear attention (residual), then GLUMBConv with RMSNorm (residual)."""

    def __init__(self, in_channels: int, mult: float = 1.0, attention_head_dim: int = 32,
                 qkv_multiscales: Sequence[int] = (5,), norm_type: str = "batch_norm") -> None:
        super().__init__()
        self.attn = SanaMultiscaleLinearAttention(in_channels, in_channels, mult=mult,
                                                  attention_head_dim=attention_head_dim, norm_type=norm_type,
                                                  kernel_sizes=qkv_multiscales, residual_connection=True)
        self.conv_out = GLUMBConv(in_channels, in_channels, norm_type="rms_norm")

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.conv_out(self.attn(x))


def get_block(block_type: str, in_channels: int, out_channels: int, attention_head_dim: int, norm_type: str,
              act_fn: Optional[str], qkv_multiscales: Sequence[int] = ()) -> nn.Layer:
    if block_type == "ResBlock":
        return ResBlock(in_channels, out_channels, norm_type, act_fn)
    if block_type == "EfficientViTBlock":
        return EfficientViTBlock(in_channels, attention_head_dim=attention_head_dim, norm_type=norm_type,
                                 qkv_multiscales=qkv_multiscales)
    raise ValueError(f"Block with block_type={block_type!r} is not supported.")


class DCDownBlock2d(nn.Layer):
    """Halves the size: a stride-2 conv, or a conv then pixel-unshuffle (`downsample`); the shortcut is the
    pixel-unshuffled input averaged over groups of channels."""

    def __init__(self, in_channels: int, out_channels: int, downsample: bool = False, shortcut: bool = True) -> None:
        super().__init__()
        self.downsample = downsample
        self.factor = 2
        self.stride = 1 if downsample else 2
        self.group_size = in_channels * self.factor ** 2 // out_channels
        self.shortcut = shortcut
        if downsample:
            assert out_channels % self.factor ** 2 == 0, "pixel_unshuffle needs out_channels divisible by 4"
            out_channels = out_channels // self.factor ** 2
        self.conv = nn.Conv2D(in_channels, out_channels, kernel_size=3, stride=self.stride, padding=1)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        x = self.conv(hidden_states)
        if self.downsample:
            x = F.pixel_unshuffle(x, self.factor)
        if not self.shortcut:
            return x
        y = F.pixel_unshuffle(hidden_states, self.factor)
        batch, channels, height, width = y.shape
        return x + y.reshape([batch, channels // self.group_size, self.group_size, height, width]).mean(axis=2)


class DCUpBlock2d(nn.Layer):
    """Doubles the size: nearest interpolation then a conv (`interpolate`), or a conv then pixel-shuffle; the
    shortcut is the input with each channel repeated, pixel-shuffled."""

    def __init__(self, in_channels: int, out_channels: int, interpolate: bool = False, shortcut: bool = True,
                 interpolation_mode: str = "nearest") -> None:
        super().__init__()
        self.interpolate = interpolate
        self.interpolation_mode = interpolation_mode
        self.shortcut = shortcut
        self.factor = 2
        self.repeats = out_channels * self.factor ** 2 // in_channels
        if not interpolate:
            out_channels = out_channels * self.factor ** 2
        self.conv = nn.Conv2D(in_channels, out_channels, 3, 1, 1)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        if self.interpolate:
            x = self.conv(F.interpolate(hidden_states, scale_factor=self.factor, mode=self.interpolation_mode))
        else:
            x = F.pixel_shuffle(self.conv(hidden_states), self.factor)
        if not self.shortcut:
            return x
        # repeat_interleave: channel c becomes channels c*r .. c*r+r-1, as in torch.
        y = paddle.repeat_interleave(hidden_states, self.repeats, axis=1)
        return x + F.pixel_shuffle(y, self.factor)


# ---------------------------------------------------------------------------------------------------- coders


def _per_stage(value: StrOrSeq, stages: int) -> Tuple[str, ...]:
    """One string for every stage, or the per-stage sequence as given."""
    return (value,) * stages if isinstance(value, str) else tuple(value)


class Encoder(nn.Layer):
    """conv_in, per stage its blocks then a DCDownBlock2d (not after the last stage, nor for a stage without
    blocks), conv_out to the latent channels plus (out_shortcut) the features averaged over channel groups."""

    def __init__(self, in_channels: int, latent_channels: int, attention_head_dim: int = 32,
                 block_type: StrOrSeq = "ResBlock",
                 block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
                 layers_per_block: Sequence[int] = (2, 2, 2, 2, 2, 2),
                 qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
                 downsample_block_type: str = "pixel_unshuffle", out_shortcut: bool = True) -> None:
        super().__init__()
        stages = len(block_out_channels)
        block_type = _per_stage(block_type, stages)
        pixel_unshuffle = downsample_block_type == "pixel_unshuffle"
        if layers_per_block[0] > 0:
            self.conv_in = nn.Conv2D(in_channels, block_out_channels[0], kernel_size=3, stride=1, padding=1)
        else:  # no first stage: the input goes straight to the second width, at half the size
            self.conv_in = DCDownBlock2d(in_channels, block_out_channels[1], downsample=pixel_unshuffle,
                                         shortcut=False)
        down_blocks = []
        for i, (width, layers) in enumerate(zip(block_out_channels, layers_per_block)):
            stage = [get_block(block_type[i], width, width, attention_head_dim=attention_head_dim,
                               norm_type="rms_norm", act_fn="silu", qkv_multiscales=qkv_multiscales[i])
                     for _ in range(layers)]
            if i < stages - 1 and layers > 0:
                stage.append(DCDownBlock2d(width, block_out_channels[i + 1], downsample=pixel_unshuffle,
                                           shortcut=True))
            down_blocks.append(nn.Sequential(*stage))
        self.down_blocks = nn.LayerList(down_blocks)
        self.conv_out = nn.Conv2D(block_out_channels[-1], latent_channels, 3, 1, 1)
        self.out_shortcut = out_shortcut
        if out_shortcut:
            self.out_shortcut_average_group_size = block_out_channels[-1] // latent_channels

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        hidden_states = self.conv_in(hidden_states)
        for down_block in self.down_blocks:
            hidden_states = down_block(hidden_states)
        if not self.out_shortcut:
            return self.conv_out(hidden_states)
        batch, channels, height, width = hidden_states.shape
        group = self.out_shortcut_average_group_size
        shortcut = hidden_states.reshape([batch, channels // group, group, height, width]).mean(axis=2)
        return self.conv_out(hidden_states) + shortcut


class Decoder(nn.Layer):
    """conv_in from the latent plus (in_shortcut) the latent's channels repeated; per stage, deepest first, a
    DCUpBlock2d (not for the last stage, nor for a stage without blocks) then its blocks; RMSNorm, act, conv_out."""

    def __init__(self, in_channels: int, latent_channels: int, attention_head_dim: int = 32,
                 block_type: StrOrSeq = "ResBlock",
                 block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
                 layers_per_block: Sequence[int] = (2, 2, 2, 2, 2, 2),
                 qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
                 norm_type: StrOrSeq = "rms_norm", act_fn: StrOrSeq = "silu",
                 upsample_block_type: str = "pixel_shuffle", in_shortcut: bool = True,
                 conv_act_fn: str = "relu") -> None:
        super().__init__()
        stages = len(block_out_channels)
        block_type, norm_type, act_fn = (_per_stage(v, stages) for v in (block_type, norm_type, act_fn))
        interpolate = upsample_block_type == "interpolate"
        self.conv_in = nn.Conv2D(latent_channels, block_out_channels[-1], 3, 1, 1)
        self.in_shortcut = in_shortcut
        if in_shortcut:
            self.in_shortcut_repeats = block_out_channels[-1] // latent_channels
        up_blocks = []  # index i is stage i (run deepest first), as diffusers numbers them
        for i, (width, layers) in enumerate(zip(block_out_channels, layers_per_block)):
            stage = []
            if i < stages - 1 and layers > 0:
                stage.append(DCUpBlock2d(block_out_channels[i + 1], width, interpolate=interpolate, shortcut=True))
            stage += [get_block(block_type[i], width, width, attention_head_dim=attention_head_dim,
                                norm_type=norm_type[i], act_fn=act_fn[i], qkv_multiscales=qkv_multiscales[i])
                      for _ in range(layers)]
            up_blocks.append(nn.Sequential(*stage))
        self.up_blocks = nn.LayerList(up_blocks)
        channels = block_out_channels[0] if layers_per_block[0] > 0 else block_out_channels[1]
        self.norm_out = ChannelRMSNorm(channels, 1e-5, elementwise_affine=True, bias=True)
        self.conv_act = get_activation(conv_act_fn)
        if layers_per_block[0] > 0:
            self.conv_out = nn.Conv2D(channels, in_channels, 3, 1, 1)
        else:  # no first stage: the last upsampling makes the image
            self.conv_out = DCUpBlock2d(channels, in_channels, interpolate=interpolate, shortcut=False)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        x = self.conv_in(hidden_states)
        if self.in_shortcut:
            x = x + paddle.repeat_interleave(hidden_states, self.in_shortcut_repeats, axis=1)
        for i in reversed(range(len(self.up_blocks))):
            x = self.up_blocks[i](x)
        return self.conv_out(self.conv_act(self.norm_out(x)))


# ---------------------------------------------------------------------------------------------------- model


class AutoencoderDC(ModelMixin, ConfigMixin):
    """diffusers' AutoencoderDC (0.42.1): same constructor, config keys, parameter and buffer names, outputs.
    Deterministic: `encode(x).latent`, no posterior; `scaling_factor` is for the caller (z * scaling_factor)."""

    _supports_gradient_checkpointing = False  # as diffusers

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        latent_channels: int = 32,
        attention_head_dim: int = 32,
        encoder_block_types: StrOrSeq = "ResBlock",
        decoder_block_types: StrOrSeq = "ResBlock",
        encoder_block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
        decoder_block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
        encoder_layers_per_block: Sequence[int] = (2, 2, 2, 3, 3, 3),
        decoder_layers_per_block: Sequence[int] = (3, 3, 3, 3, 3, 3),
        encoder_qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
        upsample_block_type: str = "pixel_shuffle",
        downsample_block_type: str = "pixel_unshuffle",
        decoder_norm_types: StrOrSeq = "rms_norm",
        decoder_act_fns: StrOrSeq = "silu",
        encoder_out_shortcut: bool = True,
        decoder_in_shortcut: bool = True,
        decoder_conv_act_fn: str = "relu",
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.encoder = Encoder(in_channels, latent_channels, attention_head_dim=attention_head_dim,
                               block_type=encoder_block_types, block_out_channels=encoder_block_out_channels,
                               layers_per_block=encoder_layers_per_block, qkv_multiscales=encoder_qkv_multiscales,
                               downsample_block_type=downsample_block_type, out_shortcut=encoder_out_shortcut)
        self.decoder = Decoder(in_channels, latent_channels, attention_head_dim=attention_head_dim,
                               block_type=decoder_block_types, block_out_channels=decoder_block_out_channels,
                               layers_per_block=decoder_layers_per_block, qkv_multiscales=decoder_qkv_multiscales,
                               norm_type=decoder_norm_types, act_fn=decoder_act_fns,
                               upsample_block_type=upsample_block_type, in_shortcut=decoder_in_shortcut,
                               conv_act_fn=decoder_conv_act_fn)
        init_like_pytorch(self)
        self.spatial_compression_ratio = 2 ** (len(encoder_block_out_channels) - 1)
        self.temporal_compression_ratio = 1
        self.use_slicing = False  # one sample at a time through encode / decode
        self.use_tiling = False  # overlapping tiles, blended (diffusers' defaults: 512 px tiles, stride 448)
        self.tile_sample_min_height = 512
        self.tile_sample_min_width = 512
        self.tile_sample_stride_height = 448
        self.tile_sample_stride_width = 448
        self.tile_latent_min_height = self.tile_sample_min_height // self.spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // self.spatial_compression_ratio

    # -- switches (diffusers' AutoencoderMixin and enable_tiling)

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None,
                      tile_sample_stride_height: Optional[int] = None,
                      tile_sample_stride_width: Optional[int] = None) -> None:
        """Encode / decode images larger than a tile as overlapping tiles blended together (less memory); a
        setting left None keeps its value."""
        self.use_tiling = True
        self.tile_sample_min_height = tile_sample_min_height or self.tile_sample_min_height
        self.tile_sample_min_width = tile_sample_min_width or self.tile_sample_min_width
        self.tile_sample_stride_height = tile_sample_stride_height or self.tile_sample_stride_height
        self.tile_sample_stride_width = tile_sample_stride_width or self.tile_sample_stride_width
        self.tile_latent_min_height = self.tile_sample_min_height // self.spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // self.spatial_compression_ratio

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    # -- encode / decode

    def _encode(self, x: paddle.Tensor) -> paddle.Tensor:
        height, width = x.shape[-2:]
        if self.use_tiling and (width > self.tile_sample_min_width or height > self.tile_sample_min_height):
            return self.tiled_encode(x, return_dict=False)[0]
        return self.encoder(x)

    def encode(self, x: paddle.Tensor, return_dict: bool = True) -> Union[EncoderOutput, Tuple[paddle.Tensor]]:
        """Images (batch, in_channels, H, W) -> latents (batch, latent_channels, H / f, W / f)."""
        if self.use_slicing and x.shape[0] > 1:
            encoded = paddle.concat([self._encode(one) for one in paddle.split(x, x.shape[0])])
        else:
            encoded = self._encode(x)
        return EncoderOutput(latent=encoded) if return_dict else (encoded,)

    def _decode(self, z: paddle.Tensor) -> paddle.Tensor:
        height, width = z.shape[-2:]
        if self.use_tiling and (width > self.tile_latent_min_width or height > self.tile_latent_min_height):
            return self.tiled_decode(z, return_dict=False)[0]
        return self.decoder(z)

    def decode(self, z: paddle.Tensor, return_dict: bool = True) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """Latents -> images."""
        if self.use_slicing and z.shape[0] > 1:
            decoded = paddle.concat([self._decode(one) for one in paddle.split(z, z.shape[0])])
        else:
            decoded = self._decode(z)
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    def forward(self, sample: paddle.Tensor, return_dict: bool = True) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        """The reconstruction: decode(encode(sample))."""
        decoded = self.decode(self.encode(sample, return_dict=False)[0], return_dict=False)[0]
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    # -- tiling (diffusers' loops; the blends build new tensors instead of writing into slices of `b`)

    def blend_v(self, a: paddle.Tensor, b: paddle.Tensor, blend_extent: int) -> paddle.Tensor:
        """b with its first rows faded in from a's last rows (linear ramp)."""
        return _blend(a, b, blend_extent, axis=2)

    def blend_h(self, a: paddle.Tensor, b: paddle.Tensor, blend_extent: int) -> paddle.Tensor:
        """b with its first columns faded in from a's last columns (linear ramp)."""
        return _blend(a, b, blend_extent, axis=3)

    def tiled_encode(self, x: paddle.Tensor, return_dict: bool = True) -> Union[EncoderOutput, Tuple[paddle.Tensor]]:
        f = self.spatial_compression_ratio
        height, width = x.shape[-2:]
        rows = [[self.encoder(_pad_to_multiple(x[:, :, i:i + self.tile_sample_min_height,
                                                  j:j + self.tile_sample_min_width], f))
                 for j in range(0, width, self.tile_sample_stride_width)]
                for i in range(0, height, self.tile_sample_stride_height)]
        encoded = self._blend_tiles(rows, self.tile_sample_min_height // f - self.tile_sample_stride_height // f,
                                    self.tile_sample_min_width // f - self.tile_sample_stride_width // f,
                                    self.tile_sample_stride_height // f, self.tile_sample_stride_width // f)
        encoded = encoded[:, :, :height // f, :width // f]
        return EncoderOutput(latent=encoded) if return_dict else (encoded,)

    def tiled_decode(self, z: paddle.Tensor, return_dict: bool = True) -> Union[DecoderOutput, Tuple[paddle.Tensor]]:
        f = self.spatial_compression_ratio
        height, width = z.shape[-2:]
        latent_tile_h, latent_tile_w = self.tile_sample_min_height // f, self.tile_sample_min_width // f
        stride_h, stride_w = self.tile_sample_stride_height // f, self.tile_sample_stride_width // f
        rows = [[self.decoder(z[:, :, i:i + latent_tile_h, j:j + latent_tile_w]) for j in range(0, width, stride_w)]
                for i in range(0, height, stride_h)]
        decoded = self._blend_tiles(rows, self.tile_sample_min_height - self.tile_sample_stride_height,
                                    self.tile_sample_min_width - self.tile_sample_stride_width,
                                    self.tile_sample_stride_height, self.tile_sample_stride_width)
        return DecoderOutput(sample=decoded) if return_dict else (decoded,)

    def _blend_tiles(self, rows: List[List[paddle.Tensor]], blend_height: int, blend_width: int,
                     keep_height: int, keep_width: int) -> paddle.Tensor:
        """Each tile blended with the (already blended) tile above and to its left, cropped to the stride, stitched.
        diffusers blends in place, so a tile's neighbours are their blended selves: stored back into `rows` here."""
        result_rows = []
        for i, row in enumerate(rows):
            for j, tile in enumerate(row):
                if i > 0:
                    tile = self.blend_v(rows[i - 1][j], tile, blend_height)
                if j > 0:
                    tile = self.blend_h(row[j - 1], tile, blend_width)
                row[j] = tile
            result_rows.append(paddle.concat([tile[:, :, :keep_height, :keep_width] for tile in row], axis=3))
        return paddle.concat(result_rows, axis=2)


def _blend(a: paddle.Tensor, b: paddle.Tensor, blend_extent: int, axis: int) -> paddle.Tensor:
    extent = min(a.shape[axis], b.shape[axis], blend_extent)
    if extent <= 0:
        return b
    # diffusers multiplies by the Python floats 1 - y / extent and y / extent: the same values, rounded to float32.
    ramp = np.arange(extent, dtype=np.float64) / extent
    shape = [1, 1, 1, 1]
    shape[axis] = extent
    weight_b = paddle.to_tensor(ramp.astype(np.float32).reshape(shape)).astype(b.dtype)
    weight_a = paddle.to_tensor((1.0 - ramp).astype(np.float32).reshape(shape)).astype(b.dtype)
    tail_a = paddle.slice(a, [axis], [a.shape[axis] - extent], [a.shape[axis]])
    head_b = paddle.slice(b, [axis], [0], [extent])
    rest_b = paddle.slice(b, [axis], [extent], [b.shape[axis]])
    return paddle.concat([tail_a * weight_a + head_b * weight_b, rest_b], axis=axis)


def _pad_to_multiple(tile: paddle.Tensor, factor: int) -> paddle.Tensor:
    """A tile zero-padded at the bottom / right to a multiple of the compression factor (diffusers' edge tiles)."""
    pad_h, pad_w = -tile.shape[2] % factor, -tile.shape[3] % factor
    return F.pad(tile, [0, pad_w, 0, pad_h]) if pad_h or pad_w else tile


# ---------------------------------------------------------------------------------------------------- weights


def state_dict_from_diffusers(model: AutoencoderDC,
                              torch_state: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A diffusers AutoencoderDC state dict (numpy arrays, e.g. safetensors' `load_file`) in this model's names and
    layouts: ppdiffusers' conversion (Linear weights transposed, BatchNorm running_mean / running_var renamed
    _mean / _variance) plus the BatchNorm counters it drops, as shape [1]. Half weights are cast to the model's
    float dtype, so an fp16 variant file loads into a float32 model."""
    counters = {k: np.asarray(v, np.int64).reshape([1]) for k, v in torch_state.items() if k.endswith(COUNTER_SUFFIX)}
    converted = convert_pytorch_state_dict_to_paddle(model, dict(torch_state))
    dtype = np.dtype(paddle.get_default_dtype())
    converted = {k: np.asarray(v).astype(dtype) if np.issubdtype(np.asarray(v).dtype, np.floating) else v
                 for k, v in converted.items()}
    return {**converted, **counters}
