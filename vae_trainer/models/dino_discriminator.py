"""RAE's discriminator (`--disc_type dino`), ported from the authors' DinoDisc (bytetriper/RAE, src/disc): trainable
heads on the tokens of a frozen DINO ViT-S/8, and DiffAugment (StyleGAN-T's, as RAE configures it: translation and
colour, no cutout) on every image it judges. Usable with every autoencoder family.

The ViT (models/dinov2.py's, with a tanh GELU and LayerNorm eps 1e-6 as the authors run it) sees the images resized
bilinearly to 224 px with ImageNet's normalisation; the tokens after blocks 2, 5, 8 and 11, and after the last block
once more, each get a head: 1-wide conv -> residual 9-wide circular conv -> 1-wide conv to one logit per token, the
convs spectral-normalised, each followed by a per-image normalisation over the tokens (the authors' BatchNormLocal
with a virtual batch of 1) and LeakyReLU(0.2). The logits of all heads and tokens are concatenated.

Like the authors' D step, the images the discriminator trains on without a gradient (its own loss: real ones and
detached reconstructions) are clamped and rounded to 8 bits first, and its spectral norms take their power iteration
there only; the generator's pass (an input carrying a gradient) leaves both alone. The ViT is kept outside the
layer's state (never in checkpoints or discriminator/): --disc_backbone_path gives it again.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from .dinov2 import IMAGENET_MEAN, IMAGENET_STD, Dinov2, read_dinov2
from .lpips import freeze

VIT_SIZE = 224  # the ViT's input side (DINO's 28 x 28 patches of 8 px: its stored positions, never resized)
KEY_BLOCKS = (2, 5, 8, 11)  # blocks whose tokens get a head, besides the last block's
HEAD_KERNEL = 9  # the residual conv's width over the tokens (RAE's config: ks 9)
NORM_EPS = 1e-6
LEAKY_SLOPE = 0.2
TRANSLATION = 0.125  # DiffAugment: shifts of up to 1/8 of a side, zeros shifted in
BACKBONE_EXPECTED = ("a DINO ViT (torch-hub / timm dino_vits8 state dict, or a transformers ViTModel folder of "
                     "facebook/dino-vits8)")


def diff_augment(images: paddle.Tensor, draws: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """DiffAugment's translation then colour (brightness, saturation, contrast), each image its own draw; `draws`:
    [5, B] uniforms on [0, 1) (default: Paddle's global generator). Differentiable in `images`."""
    b, _, h, w = images.shape
    draws = paddle.rand([5, b]) if draws is None else draws
    x = _translate(images.astype("float32"), draws[0], draws[1])
    x = x + (draws[2] - 0.5).reshape([b, 1, 1, 1])  # brightness
    mean = x.mean(axis=1, keepdim=True)
    x = (x - mean) * (2.0 * draws[3]).reshape([b, 1, 1, 1]) + mean  # saturation
    mean = x.mean(axis=[1, 2, 3], keepdim=True)
    return (x - mean) * (draws[4] + 0.5).reshape([b, 1, 1, 1]) + mean  # contrast


def _translate(x: paddle.Tensor, draw_h: paddle.Tensor, draw_w: paddle.Tensor) -> paddle.Tensor:
    """x shifted by integer offsets in [-round(side / 8), round(side / 8)], per image, zeros shifted in."""
    b, c, h, w = x.shape
    padded = F.pad(x, [1, 1, 1, 1])  # the zeros read beyond the image
    rows = _shifted_indices(h, draw_h)  # [B, H] rows of `padded`
    cols = _shifted_indices(w, draw_w)
    x = paddle.take_along_axis(padded, rows.reshape([b, 1, h, 1]).expand([b, c, h, w + 2]), axis=2)
    return paddle.take_along_axis(x, cols.reshape([b, 1, 1, w]).expand([b, c, h, w]), axis=3)


def _shifted_indices(side: int, draw: paddle.Tensor) -> paddle.Tensor:
    delta = round(side * TRANSLATION)
    shift = paddle.floor(draw * (2 * delta + 1)).astype("int64") - delta  # [B]
    return paddle.clip(paddle.arange(side, dtype="int64").unsqueeze(0) + shift.unsqueeze(1) + 1, 0, side + 1)


def quantized(images: paddle.Tensor) -> paddle.Tensor:
    """Images on [-1, 1] clamped and rounded to the 256 levels of an 8-bit image."""
    return paddle.round((images.clip(-1.0, 1.0) + 1.0) * 127.5) / 127.5 - 1.0


class TokenNorm(nn.Layer):
    """Per image and channel over the tokens of [B, C, L], then a per-channel affine (float32): an instance norm."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = self.create_parameter([channels], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([channels], default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.instance_norm(x.astype("float32"), weight=self.weight, bias=self.bias, eps=NORM_EPS, data_format="NCL")


def _conv(channels_in: int, channels_out: int, kernel: int) -> nn.Layer:
    """A spectral-normalised Conv1D with torch's default initialisation, circular padding."""
    bound = 1.0 / math.sqrt(channels_in * kernel)
    uniform = nn.initializer.Uniform(-bound, bound)
    conv = nn.Conv1D(channels_in, channels_out, kernel, padding=kernel // 2, padding_mode="circular",
                     weight_attr=uniform, bias_attr=nn.initializer.Uniform(-bound, bound))
    return nn.utils.spectral_norm(conv, dim=0)


def _block(channels: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(_conv(channels, channels, kernel), TokenNorm(channels), nn.LeakyReLU(LEAKY_SLOPE))


class _Residual(nn.Layer):
    def __init__(self, block: nn.Layer):
        super().__init__()
        self.block = block

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return (self.block(x) + x) * (1.0 / math.sqrt(2.0))


class DinoDiscriminator(nn.Layer):
    """Logits [B, heads x tokens] of images [B, 3, H, W] on [-1, 1] (`forward`: DiffAugment first; `classify`:
    as they are). `backbone_path`: the frozen DINO ViT (BACKBONE_EXPECTED)."""

    def __init__(self, backbone_path: str):
        super().__init__()
        vit = load_dino_vit(backbone_path)
        self._vit = (vit,)  # a tuple: not a sublayer, so never saved, cast or all-reduced
        self.key_blocks = tuple(i for i in KEY_BLOCKS if i < len(vit.blocks))
        width = vit.feature_dim
        self.heads = nn.LayerList([
            nn.Sequential(_block(width, 1), _Residual(_block(width, HEAD_KERNEL)), _conv(width, 1, 1))
            for _ in range(len(self.key_blocks) + 1)])
        mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
        self.register_buffer("pixel_scale", paddle.to_tensor((0.5 / std).reshape([1, 3, 1, 1])), persistable=False)
        self.register_buffer("pixel_shift", paddle.to_tensor(((0.5 - mean) / std).reshape([1, 3, 1, 1])),
                             persistable=False)

    def forward(self, images: paddle.Tensor) -> paddle.Tensor:
        generator_pass = not images.stop_gradient
        if not generator_pass:  # the discriminator's own step: 8-bit images, as the authors feed it
            images = quantized(images)
        return self.classify(diff_augment(images), power_iteration=self.training and not generator_pass)

    def classify(self, images: paddle.Tensor, power_iteration: bool = False) -> paddle.Tensor:
        """The heads' logits of un-augmented images; `power_iteration`: the spectral norms update their vectors."""
        vit = self._vit[0]  # its [B, C, L] patch tokens after the last block, then after each key block, get the heads
        x = F.interpolate(images.astype("float32"), size=[VIT_SIZE, VIT_SIZE], mode="bilinear", align_corners=False)
        x = vit.embed(x * self.pixel_scale + self.pixel_shift)
        skip, taps = 1 + vit.registers, []
        for index, block in enumerate(vit.blocks):
            x = block(x)
            if index in self.key_blocks:
                taps.append(x[:, skip:].transpose([0, 2, 1]))
        was_training = self.heads.training
        self.heads.train(power_iteration)  # the spectral norms' hooks iterate in training mode only
        try:
            outputs = [head(tokens).reshape([images.shape[0], -1])
                       for head, tokens in zip(self.heads, [x[:, skip:].transpose([0, 2, 1])] + taps)]
        finally:
            self.heads.train(was_training)
        return paddle.concat(outputs, axis=1)


def load_dino_vit(path: str) -> Dinov2:
    """The frozen DINO ViT of `path`, as the authors build it (no layer scale: ones; LayerNorm eps 1e-6, tanh
    GELU); errors name the file and what was expected."""
    try:
        state, arch = read_dinov2(path)
    except (FileNotFoundError, ValueError) as error:
        raise type(error)(f"--disc_backbone_path: {error} (expected {BACKBONE_EXPECTED})") from None
    if arch["swiglu"]:
        raise ValueError(f"--disc_backbone_path {path}: a SwiGLU ViT (DINOv2 giant?), not {BACKBONE_EXPECTED}")
    vit = Dinov2(arch["width"], arch["depth"], arch["heads"], arch["patch"], arch["registers"], arch["hidden"],
                 positions=arch["positions"], eps=NORM_EPS, resize_mode=arch["resize_mode"])
    for i in range(arch["depth"]):
        for scale in ("ls1", "ls2"):  # DINO v1 has no layer scale
            state.setdefault(f"blocks.{i}.{scale}", np.ones([arch["width"]], np.float32))
        vit.blocks[i].approximate_gelu = True
    freeze(vit, state, f"--disc_backbone_path {path}")
    if vit.stored_grid * arch["patch"] != VIT_SIZE:
        raise ValueError(f"--disc_backbone_path {path}: its positions cover {vit.stored_grid * arch['patch']} px, "
                         f"the discriminator feeds it {VIT_SIZE} px (expected {BACKBONE_EXPECTED})")
    vit.eval()
    return vit
