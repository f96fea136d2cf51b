"""The representation autoencoder (RAE) in Paddle: diffusers 0.42.1's `AutoencoderRAE`, a frozen representation
encoder (DINOv2 with registers, or MAE's ViT) whose patch tokens are the latents, and a trainable MAE-style ViT decoder.

This module owns the model (same constructor, config keys and state-dict names as diffusers, so that ppdiffusers'
`convert_pytorch_state_dict_to_paddle` reads diffusers' files and `save_pretrained(..., to_diffusers=True)` writes
folders diffusers loads), its latent (de)normalisation and training noise, and `encoder_state_from_dinov2`, which
puts a downloaded DINOv2's weights under this model's names. Reading DINOv2 files and resizing position embeddings
the way DINOv2's libraries do are models/dinov2.py's. Training it is models/families/rae.py's (its family).

Images go in and come out on [0, 1], as in diffusers. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from ppdiffusers.configuration_utils import ConfigMixin, register_to_config
from ppdiffusers.models.modeling_utils import ModelMixin
from ppdiffusers.utils import BaseOutput, rand_tensor, randn_tensor
from ppdiffusers.utils.constants import TO_DIFFUSERS

from .dinov2 import IMAGENET_MEAN, IMAGENET_STD, read_dinov2, resize_matrix

ENCODER_TYPES = ("dinov2", "mae")
HEAD_DIM = 64  # diffusers builds every encoder with heads = hidden size / 64
LATENT_EPS = 1e-5  # diffusers' (z - mean) / (std + eps)
# diffusers' DINOv2 encoder: Dinov2WithRegistersConfig(image_size=518, ...) with its defaults (4 registers, MLP 4x).
DINOV2_IMAGE_SIZE, DINOV2_REGISTERS, DINOV2_MLP_RATIO, DINOV2_EPS = 518, 4, 4, 1e-6
# diffusers' MAE encoder: ViTMAEConfig(image_size=224, mask_ratio=0, ...) with its defaults.
MAE_IMAGE_SIZE, MAE_INTERMEDIATE_SIZE, MAE_EPS = 224, 3072, 1e-12
DECODER_EPS = 1e-12
NOT_PORTED = {"siglip2": "diffusers 0.42.1 itself cannot build it with transformers 5 (SiglipVisionModel has no "
                         "`vision_model` there), so there is no reference to port it against"}


@dataclass
class EncoderOutput(BaseOutput):
    """`latent`: (N, C, h, w) with reshape_to_2d, else (N, h * w, C)."""

    latent: paddle.Tensor


@dataclass
class DecoderOutput(BaseOutput):
    """`sample`: images (N, num_channels, image_size, image_size), on [0, 1] up to the decoder's error."""

    sample: paddle.Tensor


def check_encoder_type(encoder_type: str) -> None:
    """One ValueError naming an encoder type this port does not build, and the ones it does."""
    if encoder_type in ENCODER_TYPES:
        return
    why = f" ({NOT_PORTED[encoder_type]})" if encoder_type in NOT_PORTED else ""
    raise ValueError(f"AutoencoderRAE: encoder_type={encoder_type!r} is not supported{why}; supported: "
                     f"{', '.join(ENCODER_TYPES)}")


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------


def _attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, heads: int) -> paddle.Tensor:
    """Multi-head softmax attention of [B, N, C] projections (scale head_dim ** -0.5, no mask)."""
    b, n, c = q.shape

    def split(t):
        return t.reshape([b, n, heads, c // heads]).transpose([0, 2, 1, 3])

    scores = paddle.matmul(split(q), split(k), transpose_y=True) * (c // heads) ** -0.5
    out = paddle.matmul(F.softmax(scores, axis=-1), split(v))
    return out.transpose([0, 2, 1, 3]).reshape([b, n, c])


def _affine_free_layer_norm(width: int, eps: float) -> nn.LayerNorm:
    # RAE removes the encoder's final LayerNorm weight and bias: diffusers neither saves nor loads them.
    return nn.LayerNorm(width, epsilon=eps, weight_attr=False, bias_attr=False)


def _zeros(layer: nn.Layer, shape: Sequence[int]) -> paddle.Tensor:
    return layer.create_parameter(list(shape), default_initializer=nn.initializer.Constant(0.0))


def _trunc_normal(layer: nn.Layer, shape: Sequence[int]) -> paddle.Tensor:
    # transformers' initialisation of cls tokens and learned positions (the files overwrite them).
    return layer.create_parameter(list(shape), default_initializer=nn.initializer.TruncatedNormal(std=0.02))


class _ProjAttention(nn.Layer):
    """transformers 5's attention names: q_proj, k_proj, v_proj, o_proj."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.o_proj(_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads))


class _Mlp(nn.Layer):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # exact (erf) GELU, transformers' "gelu"


class _PatchEmbeddings(nn.Layer):
    def __init__(self, width: int, patch: int):
        super().__init__()
        self.projection = nn.Conv2D(3, width, patch, stride=patch)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        return self.projection(pixels).flatten(2).transpose([0, 2, 1])  # [B, h * w, C]


def _positions_grid(positions: paddle.Tensor) -> tuple[paddle.Tensor, int]:
    """The patch positions of [1, 1 + g * g, C] as [C, g, g], and g."""
    grid, width = math.isqrt(positions.shape[1] - 1), positions.shape[2]
    return positions[0, 1:].reshape([grid, grid, width]).transpose([2, 0, 1]), grid


def _grid_to_tokens(grid: paddle.Tensor) -> paddle.Tensor:
    """[C, h, w] -> [1, h * w, C]."""
    return grid.flatten(1).transpose([1, 0]).unsqueeze(0)


# ---------------------------------------------------------------------------------------------------------------
# Encoders (frozen; transformers 5's module names, as diffusers saves them under `encoder.`)
# ---------------------------------------------------------------------------------------------------------------


class _Dinov2Embeddings(nn.Layer):
    def __init__(self, width: int, patch: int):
        super().__init__()
        grid = DINOV2_IMAGE_SIZE // patch
        self.patch = patch
        self.cls_token = _trunc_normal(self, [1, 1, width])
        self.mask_token = _zeros(self, [1, width])  # only for masked pre-training; saved all the same
        self.patch_embeddings = _PatchEmbeddings(width, patch)
        self.position_embeddings = _trunc_normal(self, [1, 1 + grid * grid, width])
        self.register_tokens = _zeros(self, [1, DINOV2_REGISTERS, width])

    def _positions(self, height: int, width: int) -> paddle.Tensor:
        """transformers' interpolate_pos_encoding: the stored grid resized by torch's antialiased bicubic."""
        h, w = height // self.patch, width // self.patch
        grid, g = _positions_grid(self.position_embeddings)
        if h * w == g * g and height == width:
            return self.position_embeddings
        rows = paddle.to_tensor(resize_matrix(g, h, "antialias"))
        cols = paddle.to_tensor(resize_matrix(g, w, "antialias"))
        # In float32 whatever the model's dtype, as transformers does.
        resized = paddle.matmul(paddle.matmul(rows, grid.astype("float32")), cols, transpose_y=True)  # [C, h, w]
        patches = _grid_to_tokens(resized).astype(grid.dtype)
        return paddle.concat([self.position_embeddings[:, :1], patches], axis=1)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        b = pixels.shape[0]
        x = self.patch_embeddings(pixels)
        x = paddle.concat([self.cls_token.expand([b, 1, -1]), x], axis=1)
        x = x + self._positions(pixels.shape[2], pixels.shape[3])
        registers = self.register_tokens.expand([b, -1, -1])
        return paddle.concat([x[:, :1], registers, x[:, 1:]], axis=1)  # cls, registers, patches


class _LayerScale(nn.Layer):
    def __init__(self, width: int):
        super().__init__()
        self.lambda1 = self.create_parameter([width], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * self.lambda1


class _Dinov2Layer(nn.Layer):
    def __init__(self, width: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, epsilon=DINOV2_EPS)
        self.attention = _ProjAttention(width, width // HEAD_DIM)
        self.layer_scale1 = _LayerScale(width)
        self.norm2 = nn.LayerNorm(width, epsilon=DINOV2_EPS)
        self.mlp = _Mlp(width, DINOV2_MLP_RATIO * width)
        self.layer_scale2 = _LayerScale(width)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.layer_scale1(self.attention(self.norm1(x)))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class Dinov2WithRegistersEncoder(nn.Layer):
    """transformers' Dinov2WithRegistersModel as RAE builds it (4 registers, final LayerNorm without affine)."""

    dropped_tokens = 1 + DINOV2_REGISTERS  # cls and registers

    def __init__(self, width: int, patch: int, depth: int):
        super().__init__()
        self.embeddings = _Dinov2Embeddings(width, patch)
        self.encoder = nn.Layer()  # transformers' Dinov2WithRegistersEncoder holds only `layer`
        self.encoder.layer = nn.LayerList([_Dinov2Layer(width) for _ in range(depth)])
        self.layernorm = _affine_free_layer_norm(width, DINOV2_EPS)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        """last_hidden_state: all tokens [B, 5 + h * w, C] of ImageNet-normalised pixels."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)

    def patch_tokens(self, pixels: paddle.Tensor) -> paddle.Tensor:
        return self(pixels)[:, self.dropped_tokens:]


class _MaeEmbeddings(nn.Layer):
    def __init__(self, width: int, patch: int):
        super().__init__()
        grid = MAE_IMAGE_SIZE // patch
        self.patch = patch
        self.cls_token = _trunc_normal(self, [1, 1, width])
        self.patch_embeddings = _PatchEmbeddings(width, patch)
        # MAE's fixed sin-cos table, read from the file; zeros until then, as diffusers' RAE built from a config has.
        self.position_embeddings = _zeros(self, [1, 1 + grid * grid, width])

    def _positions(self, height: int, width: int) -> paddle.Tensor:
        """ViTMAE's interpolate_pos_encoding: plain bicubic (Paddle's matches torch's to ~1e-6)."""
        h, w = height // self.patch, width // self.patch
        grid, g = _positions_grid(self.position_embeddings)
        if h * w == g * g and height == width:
            return self.position_embeddings
        resized = F.interpolate(grid.unsqueeze(0), size=[h, w], mode="bicubic", align_corners=False)[0]
        return paddle.concat([self.position_embeddings[:, :1], _grid_to_tokens(resized)], axis=1)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        positions = self._positions(pixels.shape[2], pixels.shape[3])
        x = self.patch_embeddings(pixels) + positions[:, 1:]
        # RAE passes noise = arange, so MAE's random masking (ratio 0) keeps every patch in order: nothing to do.
        cls = (self.cls_token + positions[:, :1]).expand([pixels.shape[0], 1, -1])
        return paddle.concat([cls, x], axis=1)


class _MaeLayer(nn.Layer):
    def __init__(self, width: int):
        super().__init__()
        self.attention = _ProjAttention(width, width // HEAD_DIM)
        self.layernorm_before = nn.LayerNorm(width, epsilon=MAE_EPS)
        self.layernorm_after = nn.LayerNorm(width, epsilon=MAE_EPS)
        self.mlp = _Mlp(width, MAE_INTERMEDIATE_SIZE)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attention(self.layernorm_before(x))
        return x + self.mlp(self.layernorm_after(x))


class MaeEncoder(nn.Layer):
    """transformers' ViTMAEModel as RAE builds it (mask ratio 0, final LayerNorm without affine)."""

    dropped_tokens = 1  # cls

    def __init__(self, width: int, patch: int, depth: int):
        super().__init__()
        self.embeddings = _MaeEmbeddings(width, patch)
        self.layers = nn.LayerList([_MaeLayer(width) for _ in range(depth)])
        self.layernorm = _affine_free_layer_norm(width, MAE_EPS)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        x = self.embeddings(pixels)
        for layer in self.layers:
            x = layer(x)
        return self.layernorm(x)

    def patch_tokens(self, pixels: paddle.Tensor) -> paddle.Tensor:
        return self(pixels)[:, self.dropped_tokens:]


_ENCODERS = {"dinov2": Dinov2WithRegistersEncoder, "mae": MaeEncoder}


# ---------------------------------------------------------------------------------------------------------------
# Decoder (diffusers' RAEDecoder: an MAE decoder)
# ---------------------------------------------------------------------------------------------------------------


def decoder_positions(width: int, grid: int) -> np.ndarray:
    """diffusers' get_2d_sincos_pos_embed(width, grid, cls_token=True, extra_tokens=1) as [1, 1 + g * g, C] float32:
    a zero cls row, then [sin, cos](column * w), [sin, cos](row * w). Its default base_size=16 scales the
    coordinates by 16 / grid, unlike MAE's own table; kept, since trained decoders rely on it."""
    if width % 4:
        raise ValueError(f"decoder_hidden_size={width} must be divisible by 4 (2-D sin-cos positions)")
    coords = (np.arange(grid, dtype=np.float32) / np.float32(grid / 16.0)).astype(np.float64)
    omega = 1.0 / 10000.0 ** (np.arange(width // 4, dtype=np.float64) / (width / 4.0))
    rows, cols = np.meshgrid(coords, coords, indexing="ij")
    emb_col, emb_row = np.outer(cols.ravel(), omega), np.outer(rows.ravel(), omega)
    table = np.concatenate([np.sin(emb_col), np.cos(emb_col), np.sin(emb_row), np.cos(emb_row)], axis=1)
    return np.concatenate([np.zeros((1, width)), table])[None].astype(np.float32)


class _DiffusersAttention(nn.Layer):
    """diffusers' Attention names: to_q, to_k, to_v, to_out.0 (to_out.1 is its dropout, p = 0)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.to_out = nn.LayerList([nn.Linear(width, width), nn.Dropout(0.0)])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = _attention(self.to_q(x), self.to_k(x), self.to_v(x), self.heads)
        return self.to_out[1](self.to_out[0](out))


class _DecoderLayer(nn.Layer):
    """diffusers' ViTMAELayer: pre-norm attention and GELU MLP (intermediate.dense, output.dense)."""

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"decoder_hidden_size={width} must be divisible by decoder_num_attention_heads={heads}")
        self.attention = _DiffusersAttention(width, heads)
        self.intermediate, self.output = nn.Layer(), nn.Layer()
        self.intermediate.dense, self.output.dense = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.layernorm_before = nn.LayerNorm(width, epsilon=DECODER_EPS)
        self.layernorm_after = nn.LayerNorm(width, epsilon=DECODER_EPS)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attention(self.layernorm_before(x))
        return x + self.output.dense(F.gelu(self.intermediate.dense(self.layernorm_after(x))))


class RAEDecoder(nn.Layer):
    """Tokens [B, L, encoder width] -> patch logits [B, num_patches, patch_size ** 2 * channels]; `unpatchify` makes
    images. L != num_patches: the token grid is first resized (bilinear) to the trained one, as diffusers does."""

    def __init__(self, hidden_size: int, decoder_hidden_size: int, decoder_num_hidden_layers: int,
                 decoder_num_attention_heads: int, decoder_intermediate_size: int, num_patches: int, patch_size: int,
                 num_channels: int, image_size: int):
        super().__init__()
        self.patch_size, self.num_channels, self.image_size = patch_size, num_channels, image_size
        self.num_patches, self.grid = num_patches, math.isqrt(num_patches)
        self.decoder_embed = nn.Linear(hidden_size, decoder_hidden_size)
        # Fixed, so not persistable: diffusers neither saves nor expects it.
        self.register_buffer("decoder_pos_embed", paddle.to_tensor(decoder_positions(decoder_hidden_size, self.grid)),
                             persistable=False)
        self.decoder_layers = nn.LayerList([
            _DecoderLayer(decoder_hidden_size, decoder_num_attention_heads, decoder_intermediate_size)
            for _ in range(decoder_num_hidden_layers)])
        self.decoder_norm = nn.LayerNorm(decoder_hidden_size, epsilon=DECODER_EPS)
        self.decoder_pred = nn.Linear(decoder_hidden_size, patch_size ** 2 * num_channels)
        self.trainable_cls_token = _zeros(self, [1, 1, decoder_hidden_size])

    def _to_trained_grid(self, x: paddle.Tensor) -> paddle.Tensor:
        b, length, c = x.shape
        if length == self.num_patches:
            return x
        side = math.isqrt(length)
        grid = x.reshape([b, side, side, c]).transpose([0, 3, 1, 2])
        grid = F.interpolate(grid, size=[self.grid, self.grid], mode="bilinear", align_corners=False)
        return grid.transpose([0, 2, 3, 1]).reshape([b, self.num_patches, c])

    def forward(self, tokens: paddle.Tensor) -> paddle.Tensor:
        x = self._to_trained_grid(self.decoder_embed(tokens))
        x = paddle.concat([self.trainable_cls_token.expand([x.shape[0], 1, -1]), x], axis=1)
        x = x + self.decoder_pos_embed.astype(x.dtype)
        for layer in self.decoder_layers:
            x = layer(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]  # the cls token's output is dropped

    def unpatchify(self, logits: paddle.Tensor) -> paddle.Tensor:
        """[B, h * w, p * p * C] -> [B, C, h * p, w * p] (patch pixels in (p, q, channel) order, as MAE)."""
        b, p, c = logits.shape[0], self.patch_size, self.num_channels
        side = self.image_size // p
        if side * side != logits.shape[1]:
            raise ValueError(f"{logits.shape[1]} patches do not make a {side} x {side} grid")
        x = logits.reshape([b, side, side, p, p, c]).transpose([0, 5, 1, 3, 2, 4])
        return x.reshape([b, c, side * p, side * p])


# ---------------------------------------------------------------------------------------------------------------
# The autoencoder
# ---------------------------------------------------------------------------------------------------------------


def _as_list(value: Any) -> Any:
    """Config-serialisable: tensors and arrays as (nested) lists, tuples as lists."""
    if isinstance(value, paddle.Tensor):
        return value.numpy().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_as_list(v) for v in value]
    return value


def _stats_buffer(value: Any, default: float) -> paddle.Tensor:
    """latents_mean / latents_std as a float32 tensor of their own shape, or [default] (shape (1,)) when unset."""
    array = np.asarray(_as_list(value) if value is not None else [default], dtype=np.float32)
    return paddle.to_tensor(array)


def _image_size(patch_size: int, num_patches: int, image_size: Optional[int]) -> int:
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches:
        raise ValueError(f"Computed num_patches={num_patches} must be a perfect square.")
    derived = patch_size * grid
    if image_size is not None and int(image_size) != derived:
        raise ValueError(f"image_size={image_size} must equal decoder_patch_size*sqrt(num_patches)={derived} for "
                         f"patch_size={patch_size} and computed num_patches={num_patches}.")
    return derived


class AutoencoderRAE(ModelMixin, ConfigMixin):
    """diffusers 0.42.1's AutoencoderRAE (same arguments, defaults, config and weight names).

    `encode(images on [0, 1]).latent`: images resized (bicubic) to encoder_input_size, normalised by
    encoder_norm_mean/std, the frozen encoder's patch tokens (cls and register tokens dropped), in training mode plus
    noise_tau * U(0, 1) * N(0, 1) (one U per sample), reshaped to (N, C, h, w) with reshape_to_2d, then
    (z - latents_mean) / (latents_std + 1e-5) (per channel, or per channel and position: the stats' own shape
    broadcast), times scaling_factor. `decode(latents).sample` undoes all that and un-normalises the image.

    The encoder is frozen (its parameters have stop_gradient set; gradients still reach the input images);
    train `model.decoder`. `decoder_last_layer()` is the decoder's output projection (for an adaptive GAN weight).
    Load diffusers' files with ppdiffusers' `convert_pytorch_state_dict_to_paddle(model, state)` or
    `from_pretrained(folder, from_diffusers=True)`; `save_pretrained(folder, to_diffusers=True)` writes a folder
    diffusers loads.
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(
        self,
        encoder_type: str = "dinov2",
        encoder_hidden_size: int = 768,
        encoder_patch_size: int = 14,
        encoder_num_hidden_layers: int = 12,
        decoder_hidden_size: int = 512,
        decoder_num_hidden_layers: int = 8,
        decoder_num_attention_heads: int = 16,
        decoder_intermediate_size: int = 2048,
        patch_size: int = 16,
        encoder_input_size: int = 224,
        image_size: Optional[int] = None,
        num_channels: int = 3,
        encoder_norm_mean: Optional[list] = None,
        encoder_norm_std: Optional[list] = None,
        latents_mean: Optional[Any] = None,
        latents_std: Optional[Any] = None,
        noise_tau: float = 0.0,
        reshape_to_2d: bool = True,
        use_encoder_loss: bool = False,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        check_encoder_type(encoder_type)
        # Tensors given for the statistics are kept in the config as lists (JSON), as diffusers does.
        self.register_to_config(latents_mean=_as_list(latents_mean), latents_std=_as_list(latents_std))
        self.encoder_input_size, self.noise_tau = int(encoder_input_size), float(noise_tau)
        self.reshape_to_2d, self.use_encoder_loss = bool(reshape_to_2d), bool(use_encoder_loss)
        if self.encoder_input_size % int(encoder_patch_size):
            raise ValueError(f"encoder_input_size={encoder_input_size} must be divisible by "
                             f"encoder_patch_size={encoder_patch_size}.")
        if int(patch_size) <= 0:
            raise ValueError("patch_size must be a positive integer (this is decoder_patch_size).")
        self.encoder = _ENCODERS[encoder_type](int(encoder_hidden_size), int(encoder_patch_size),
                                               int(encoder_num_hidden_layers))
        for param in self.encoder.parameters():
            param.stop_gradient = True
        self.num_patches = (self.encoder_input_size // int(encoder_patch_size)) ** 2
        self.decoder_patch_size = int(patch_size)
        self.decoder_image_size = _image_size(self.decoder_patch_size, self.num_patches, image_size)
        self._register_statistics(encoder_norm_mean, encoder_norm_std, latents_mean, latents_std)
        self.decoder = RAEDecoder(int(encoder_hidden_size), int(decoder_hidden_size), int(decoder_num_hidden_layers),
                                  int(decoder_num_attention_heads), int(decoder_intermediate_size), self.num_patches,
                                  self.decoder_patch_size, int(num_channels), self.decoder_image_size)
        self.use_slicing = False

    def _register_statistics(self, norm_mean: Optional[list], norm_std: Optional[list], latents_mean: Any,
                             latents_std: Any) -> None:
        """Saved buffers, as diffusers': encoder_mean / encoder_std [1, 3, 1, 1], _latents_mean / _latents_std."""
        for name, value, default in (("encoder_mean", norm_mean, IMAGENET_MEAN),
                                     ("encoder_std", norm_std, IMAGENET_STD)):
            array = np.asarray(value if value is not None else default, np.float32).reshape([1, 3, 1, 1])
            self.register_buffer(name, paddle.to_tensor(array), persistable=True)
        self.register_buffer("_latents_mean", _stats_buffer(latents_mean, 0.0), persistable=True)
        self.register_buffer("_latents_std", _stats_buffer(latents_std, 1.0), persistable=True)

    def decoder_last_layer(self) -> paddle.Tensor:
        """The weight of the decoder's last layer, `decoder.decoder_pred` ([decoder width, patch_size ** 2 *
        channels] in Paddle's layout): what an adaptive GAN weight differentiates against."""
        return self.decoder.decoder_pred.weight

    def enable_slicing(self) -> None:
        """Encode and decode one image at a time (less memory; same results)."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    # -- encoding -------------------------------------------------------------------------------------------------

    def _encoder_pixels(self, images: paddle.Tensor) -> paddle.Tensor:
        images = resize_bicubic(images, self.encoder_input_size)
        return (images - self.encoder_mean.astype(images.dtype)) / self.encoder_std.astype(images.dtype)

    def _noising(self, tokens: paddle.Tensor, generator: Optional[paddle.Generator] = None) -> paddle.Tensor:
        """tokens + tau * U(0, 1) * N(0, 1): one noise level per sample, drawn in [0, tau]."""
        sigma = self.noise_tau * rand_tensor([tokens.shape[0]] + [1] * (tokens.ndim - 1), generator=generator,
                                             dtype=tokens.dtype)
        return tokens + sigma * randn_tensor(tokens.shape, generator=generator, dtype=tokens.dtype)

    def _normalise_latents(self, z: paddle.Tensor) -> paddle.Tensor:
        mean, std = self._latents_mean.astype(z.dtype), self._latents_std.astype(z.dtype)
        return (z - mean) / (std + LATENT_EPS)

    def _denormalise_latents(self, z: paddle.Tensor) -> paddle.Tensor:
        mean, std = self._latents_mean.astype(z.dtype), self._latents_std.astype(z.dtype)
        return z * (std + LATENT_EPS) + mean

    def _encode(self, images: paddle.Tensor, generator: Optional[paddle.Generator] = None) -> paddle.Tensor:
        return self.encode_with_tokens(images, generator)[0]

    def encode_with_tokens(self, images: paddle.Tensor,
                           generator: Optional[paddle.Generator] = None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(`encode`'s latents of images on [0, 1]; the encoder's tokens shaped as those, before the training noise
        and the latent normalisation: what latents_mean / latents_std are statistics of, RAE's stat.pt)."""
        tokens = self.encoder.patch_tokens(self._encoder_pixels(images))  # [B, N, C]
        raw = _tokens_to_grid(tokens) if self.reshape_to_2d else tokens
        if self.training and self.noise_tau > 0:  # drawn in the tokens' layout, as diffusers draws it
            tokens = self._noising(tokens, generator)
        z = _tokens_to_grid(tokens) if self.reshape_to_2d else tokens
        z = self._normalise_latents(z)
        return (z * self.config.scaling_factor if self.config.scaling_factor != 1.0 else z), raw

    def encode(self, x: paddle.Tensor, return_dict: bool = True,
               generator: Optional[paddle.Generator] = None) -> EncoderOutput | tuple[paddle.Tensor]:
        """Latents of images on [0, 1]: EncoderOutput(latent=...), or (latent,) with return_dict=False."""
        if self.use_slicing and x.shape[0] > 1:
            latents = paddle.concat([self._encode(part, generator) for part in x.split(x.shape[0])], axis=0)
        else:
            latents = self._encode(x, generator)
        return EncoderOutput(latent=latents) if return_dict else (latents,)

    # -- decoding -------------------------------------------------------------------------------------------------

    def _decode(self, z: paddle.Tensor) -> paddle.Tensor:
        if self.config.scaling_factor != 1.0:
            z = z / self.config.scaling_factor
        z = self._denormalise_latents(z)
        tokens = z.flatten(2).transpose([0, 2, 1]) if self.reshape_to_2d else z
        images = self.decoder.unpatchify(self.decoder(tokens))
        return images * self.encoder_std.astype(images.dtype) + self.encoder_mean.astype(images.dtype)

    def decode(self, z: paddle.Tensor, return_dict: bool = True) -> DecoderOutput | tuple[paddle.Tensor]:
        """Images (on [0, 1] for a trained decoder) of latents: DecoderOutput(sample=...), or (sample,)."""
        if self.use_slicing and z.shape[0] > 1:
            images = paddle.concat([self._decode(part) for part in z.split(z.shape[0])], axis=0)
        else:
            images = self._decode(z)
        return DecoderOutput(sample=images) if return_dict else (images,)

    def forward(self, sample: paddle.Tensor, return_dict: bool = True,
                generator: Optional[paddle.Generator] = None) -> DecoderOutput | tuple[paddle.Tensor]:
        """decode(encode(sample)): DecoderOutput(sample=reconstruction), or (reconstruction,)."""
        images = self.decode(self.encode(sample, return_dict=False, generator=generator)[0], return_dict=False)[0]
        return DecoderOutput(sample=images) if return_dict else (images,)

    # -- saving ---------------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str, *args, to_diffusers: Optional[bool] = None, **kwargs) -> None:
        """ppdiffusers' save_pretrained; with to_diffusers, its converter squeezes every 1-D tensor, which turns the
        unset latent statistics (shape (1,)) into scalars that diffusers refuses as mismatched: they are reshaped
        back in the written files."""
        super().save_pretrained(save_directory, *args, to_diffusers=to_diffusers, **kwargs)
        if TO_DIFFUSERS if to_diffusers is None else to_diffusers:
            _restore_squeezed(save_directory, {k: list(v.shape) for k, v in self.state_dict().items()})


def resize_bicubic(images: paddle.Tensor, size: int) -> paddle.Tensor:
    """Images [B, C, H, W] resized to size x size as diffusers' encode does (torch's bicubic, align_corners=False,
    no antialias); unchanged when already that size. Paddle's bicubic (a = -0.75, clamped borders) matches torch's
    to ~1e-6 (tests/test_autoencoder_rae.py)."""
    if tuple(images.shape[2:]) == (size, size):
        return images
    return F.interpolate(images, size=[size, size], mode="bicubic", align_corners=False)


def _tokens_to_grid(tokens: paddle.Tensor) -> paddle.Tensor:
    """[B, N, C] -> [B, C, h, w] (N = h * w)."""
    b, n, c = tokens.shape
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"Token length n={n} is not a perfect square; cannot reshape to 2D.")
    return tokens.transpose([0, 2, 1]).reshape([b, c, side, side])


def _restore_squeezed(folder: str, shapes: dict) -> None:
    """Give the scalars of the diffusers weight files in `folder` back the shape (1,) the model holds them with."""
    for file in glob.glob(os.path.join(folder, "diffusion_pytorch_model*.safetensors")):
        from safetensors.numpy import load_file, save_file

        state = load_file(file)
        fixed = {k for k, v in state.items() if v.ndim == 0 and shapes.get(k) == [1]}
        if fixed:
            save_file({k: (v.reshape([1]) if k in fixed else v) for k, v in state.items()}, file,
                      metadata={"format": "pt"})
    for file in glob.glob(os.path.join(folder, "diffusion_pytorch_model*.bin")):
        import torch  # ppdiffusers wrote this file with torch.save, so torch is there

        state = torch.load(file, map_location="cpu", weights_only=True)
        fixed = {k for k, v in state.items() if v.ndim == 0 and shapes.get(k) == [1]}
        if fixed:
            torch.save({k: (v.reshape([1]) if k in fixed else v) for k, v in state.items()}, file)


# ---------------------------------------------------------------------------------------------------------------
# A downloaded DINOv2 as RAE's encoder
# ---------------------------------------------------------------------------------------------------------------

_BLOCK_RENAMES = {"norm1": "norm1", "norm2": "norm2", "attn.proj": "attention.o_proj", "mlp.fc1": "mlp.fc1",
                  "mlp.fc2": "mlp.fc2"}


def encoder_state_from_dinov2(path: str) -> tuple[dict, dict]:
    """A DINOv2-with-registers' weights as AutoencoderRAE's encoder: (numpy float32 state dict under the model's
    names, `encoder.…`, in Paddle's layout, for `model.set_state_dict`; {"encoder_hidden_size", "encoder_patch_size",
    "encoder_num_hidden_layers"} to build or check an AutoencoderRAE config against).

    `path`: a transformers folder (config.json + model.safetensors / pytorch_model.bin, old or new module names) or
    a timm / torch-hub state dict, read by models/dinov2.py. RAE's encoder is DINOv2 with 4 registers, head width 64,
    a GELU MLP 4x wide and 518 / patch stored positions per side; anything else is a ValueError saying what differs
    (a DINOv2 without registers cannot be one: RAE drops 5 tokens and attends to 4 registers)."""
    state, arch = read_dinov2(path)
    _check_rae_dinov2(path, arch)
    width = arch["width"]
    out = _dinov2_embeddings(state, width)
    for key, value in state.items():
        if not key.startswith("blocks."):
            continue
        _, index, name = key.split(".", 2)
        prefix = f"encoder.encoder.layer.{index}."
        if name.startswith("attn.qkv."):  # timm's fused q, k, v: [in, 3 * out] weights, [3 * out] biases
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), np.split(value, 3, axis=-1)):
                out[prefix + f"attention.{part}.{name.rsplit('.', 1)[1]}"] = np.ascontiguousarray(chunk)
        elif name in ("ls1", "ls2"):
            out[prefix + f"layer_scale{name[2]}.lambda1"] = value
        else:
            module, leaf = name.rsplit(".", 1)
            out[prefix + f"{_BLOCK_RENAMES[module]}.{leaf}"] = value
    sizes = {"encoder_hidden_size": width, "encoder_patch_size": arch["patch"],
             "encoder_num_hidden_layers": arch["depth"]}
    return out, sizes


def _check_rae_dinov2(path: str, arch: dict) -> None:
    grid = DINOV2_IMAGE_SIZE // arch["patch"]
    wanted = {"registers": DINOV2_REGISTERS, "swiglu": False, "hidden": DINOV2_MLP_RATIO * arch["width"],
              "heads": arch["width"] // HEAD_DIM, "eps": DINOV2_EPS, "stored grid": grid}
    found = dict(arch, **{"stored grid": math.isqrt(arch["positions"])})
    differs = [f"{key} {found[key]} (RAE: {value})" for key, value in wanted.items() if found[key] != value]
    if arch["width"] % HEAD_DIM:
        differs.append(f"width {arch['width']} (RAE: a multiple of {HEAD_DIM})")
    if differs:
        raise ValueError(f"{path} cannot be AutoencoderRAE's dinov2 encoder (DINOv2 with {DINOV2_REGISTERS} "
                         f"registers, head width {HEAD_DIM}, GELU MLP {DINOV2_MLP_RATIO}x, {grid} x {grid} stored "
                         f"positions): {'; '.join(differs)}")


def _dinov2_embeddings(state: dict, width: int) -> dict:
    """The embedding weights in RAE's names; timm's layout (cls position folded into cls_token) unfolded."""
    positions, cls = state["pos_embed"], state["cls_token"]
    if math.isqrt(positions.shape[1]) ** 2 == positions.shape[1]:  # no cls position: a zero one adds nothing
        positions = np.concatenate([np.zeros((1, 1, width), np.float32), positions], axis=1)
    mask = state.get("mask_token", state.get("embeddings.mask_token", np.zeros((1, width), np.float32)))
    prefix = "encoder.embeddings."
    return {prefix + "cls_token": cls, prefix + "mask_token": np.asarray(mask, np.float32).reshape([1, width]),
            prefix + "position_embeddings": positions, prefix + "register_tokens": state["reg_token"],
            prefix + "patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
            prefix + "patch_embeddings.projection.bias": state["patch_embed.proj.bias"]}


# ---------------------------------------------------------------------------------------------------------------
# The RAE authors' decoder files (bytetriper/RAE: src/stage1/decoders/decoder.py's GeneralDecoder, saved by
# train_stage1.py / extract_decoder.py) under this model's names
# ---------------------------------------------------------------------------------------------------------------

# The authors' decoders: ViTB / ViTL / ViTXL (configs/decoder/*/config.json), heads by width (not in the weights).
RELEASED_DECODER_HEADS = {768: 12, 1024: 16, 1152: 16}
_AUTHORS_ATTENTION = {"attention.attention.query.": "attention.to_q.", "attention.attention.key.": "attention.to_k.",
                      "attention.attention.value.": "attention.to_v.", "attention.output.dense.": "attention.to_out.0."}


def authors_decoder_state(state: dict) -> dict:
    """The decoder's weights of an authors' file: a GeneralDecoder state dict, or a training checkpoint's model
    (wrappers' `module.` / `_orig_mod.` and the RAE's `decoder.` prefixes dropped, its encoder left out)."""
    out = {}
    for key, value in state.items():
        while key.startswith(("module.", "_orig_mod.")):
            key = key.split(".", 1)[1]
        if key.startswith("encoder."):
            continue
        out[key.removeprefix("decoder.")] = np.asarray(value)
    return out


def decoder_sizes_from_authors(state: dict, heads: Optional[int] = None) -> dict:
    """AutoencoderRAE's decoder config keys read off an authors' decoder state dict (`authors_decoder_state`); the
    heads, which the weights do not hold, from `heads` or the released decoders' widths."""
    try:
        width, encoder_width = state["decoder_embed.weight"].shape
        layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("decoder_layers."))
        hidden = state["decoder_layers.0.intermediate.dense.weight"].shape[0]
        patch = math.isqrt(state["decoder_pred.weight"].shape[0] // 3)
    except (KeyError, ValueError) as error:
        raise ValueError(f"not an RAE decoder (GeneralDecoder) state dict: no {error}") from None
    heads = heads or RELEASED_DECODER_HEADS.get(int(width))
    if heads is None:
        raise ValueError(f"a decoder of width {width}, not one of the released ones ({RELEASED_DECODER_HEADS}), "
                         "whose attention heads the weights do not say (configs/decoder/*/config.json's "
                         "decoder_num_attention_heads)")
    return {"decoder_hidden_size": int(width), "decoder_num_hidden_layers": layers,
            "decoder_num_attention_heads": int(heads), "decoder_intermediate_size": int(hidden), "patch_size": patch,
            "encoder_hidden_size": int(encoder_width)}


def decoder_state_from_authors(state: dict, model: "AutoencoderRAE") -> dict:
    """An authors' decoder state dict (`authors_decoder_state`) in `model`'s names and Paddle's layout (Linear
    weights transposed), for `model.set_state_dict`. Their fixed positions (`decoder_pos_embed`, saved there) must
    be this model's (diffusers' table); a missing `trainable_cls_token` (older files) stays zero, as diffusers'
    conversion leaves it; any other key missing or left over is a ValueError naming it."""
    state = dict(state)
    positions = state.pop("decoder_pos_embed", None)
    ours = model.decoder.decoder_pos_embed.numpy()
    if positions is not None and (positions.shape != ours.shape or np.abs(positions - ours).max() > 1e-5):
        raise ValueError(f"its decoder_pos_embed {list(positions.shape)} is not the table diffusers' AutoencoderRAE "
                         f"computes ({list(ours.shape)}; it scales positions to a 16 x 16 grid): diffusers' class "
                         "would decode this decoder wrongly")
    out = {}
    for key, value in state.items():
        for theirs, name in _AUTHORS_ATTENTION.items():
            key = key.replace(theirs, name)
        out["decoder." + key] = value.T if value.ndim == 2 else value  # torch Linear [out, in] -> Paddle [in, out]
    expected = {k for k in model.state_dict() if k.startswith("decoder.")}
    missing = sorted(expected - set(out) - {"decoder.trainable_cls_token"})
    unexpected = sorted(set(out) - expected)
    if missing or unexpected:
        raise ValueError(f"decoder weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
