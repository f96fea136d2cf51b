"""GAN discriminators (the PatchGAN of pix2pix / taming-transformers, its 3-D form over clips, one on VGG16 features,
RAE's on a DINO ViT): saving one as OUTPUT_DIR/discriminator, reading one back (--discriminator_path), BatchNorm ->
SyncBatchNorm on several GPUs.

RAE's discriminator (`--disc_type dino`), ported from the authors' DinoDisc (bytetriper/RAE, src/disc): trainable
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

import json
import math
import os
import warnings
from typing import Optional

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..checkpoint import DISCRIMINATOR_CONFIG_NAME, MODEL_NAME, read_json
from .dinov2 import IMAGENET_MEAN, IMAGENET_STD, Dinov2, read_dinov2
from .lpips import LPIPS_CHANNELS, freeze, load_vgg16_features

NORM_TYPES = ("batch", "group", "spectral_group", "none")
PATCH_TYPES = ("patch", "patchgan3d")  # the PatchGANs: --disc_norm, --disc_num_layers apply
CONFIG_NAME = "config.json"
_LEAKY_SLOPE = 0.2
VIT_SIZE = 224  # the ViT's input side (DINO's 28 x 28 patches of 8 px: its stored positions, never resized)
KEY_BLOCKS = (2, 5, 8, 11)  # blocks whose tokens get a head, besides the last block's
HEAD_KERNEL = 9  # the residual conv's width over the tokens (RAE's config: ks 9)
NORM_EPS = 1e-6
TRANSLATION = 0.125  # DiffAugment: shifts of up to 1/8 of a side, zeros shifted in
BACKBONE_EXPECTED = ("a DINO ViT (torch-hub / timm dino_vits8 state dict, or a transformers ViTModel folder of "
                     "facebook/dino-vits8)")


def _init_weights(layer: nn.Layer) -> nn.Layer:
    """taming-transformers' weights_init: conv N(0, 0.02), norm scale N(1, 0.02), biases 0."""
    is_norm = isinstance(layer, (nn.layer.norm._BatchNormBase, nn.GroupNorm))
    nn.initializer.Normal(1.0 if is_norm else 0.0, 0.02)(layer.weight)
    if layer.bias is not None:
        nn.initializer.Constant(0.0)(layer.bias)
    return layer


class PatchDiscriminator(nn.Layer):
    """PatchGAN: `num_layers` stride-2 convs, one stride-1 conv, then a 1-channel conv of patch logits."""

    takes_clips = False  # a 2-D discriminator scores a clip's frames one by one (objectives.gan.discriminate)
    _conv_layer, _batch_norm = nn.Conv2D, nn.BatchNorm2D
    kernel, strided = 4, 2  # conv kernel size; the stride of a strided layer

    def __init__(self, in_channels: int = 3, base_channels: int = 64, num_layers: int = 3, norm: str = "batch",
                 condition_channels: int = 0) -> None:
        super().__init__()
        self.in_channels, self.condition_channels = in_channels, condition_channels  # image channels (RGBA: 4)
        in_channels += condition_channels
        if norm not in NORM_TYPES:
            raise ValueError(f"norm must be one of {NORM_TYPES}, got {norm!r}")
        widths = [in_channels] + [base_channels * min(2**n, 8) for n in range(num_layers + 1)]
        layers = []
        for n in range(num_layers + 1):
            has_norm = n > 0 and norm != "none"  # a bias in front of a normalisation would be cancelled by it
            stride = self.strided if n < num_layers or n == 0 else 1
            layers.append(self._conv(widths[n], widths[n + 1], stride, not has_norm, norm == "spectral_group"))
            if has_norm:
                width = widths[n + 1]  # gcd keeps GroupNorm valid for narrow test-sized discriminators
                norm_layer = self._batch_norm(width) if norm == "batch" else nn.GroupNorm(math.gcd(32, width), width)
                layers.append(_init_weights(norm_layer))
            layers.append(nn.LeakyReLU(_LEAKY_SLOPE))
        layers.append(self._conv(widths[-1], 1, 1, True, norm == "spectral_group"))
        self.main = nn.Sequential(*layers)

    def _conv(self, in_channels: int, out_channels: int, stride, bias: bool, spectral: bool) -> nn.Layer:
        conv = self._conv_layer(in_channels, out_channels, self.kernel, stride, 1, bias_attr=None if bias else False)
        conv = _init_weights(conv)
        # Initialised before wrapping: spectral_norm re-registers the weight as `weight_orig`.
        return nn.utils.spectral_norm(conv) if spectral else conv

    def forward(self, x: paddle.Tensor, condition: paddle.Tensor | None = None) -> paddle.Tensor:
        """Patch logits [B, 1, h, w] of images [B, C, H, W] (with `condition_channels`: and of their latents). The 3-D
        form's: [B, 1, T, h, w] of clips [B, C, T, H, W]; images [B, C, H, W] are one-frame clips (their condition
        [B, c, h, w], a clip's [B, c, t, h, w])."""
        x = self._conditioned(x, condition)
        return self.main(x.unsqueeze(2) if self.takes_clips and x.ndim == 4 else x)

    def _conditioned(self, x: paddle.Tensor, condition: paddle.Tensor | None) -> paddle.Tensor:
        """`x` with `condition` (latents) nearest-upsampled to its size appended as channels."""
        if (condition is None) != (self.condition_channels == 0):
            raise ValueError(f"this discriminator takes {self.condition_channels} condition channels, given "
                             f"{'none' if condition is None else condition.shape[1]}")
        if condition is None:
            return x
        layout = "NCDHW" if x.ndim == 5 else "NCHW"
        upsampled = nn.functional.interpolate(condition.astype(x.dtype), size=x.shape[2:], mode="nearest",
                                              data_format=layout)
        return paddle.concat([x, upsampled], axis=1)


class PatchDiscriminator3D(PatchDiscriminator):
    """`--disc_type patchgan3d`: the PatchGAN's layers and widths over a whole clip, its convs 3-D with a temporal
    kernel of 3 (padded 1, never strided: short clips keep their frames), so it sees motion as well as texture."""

    takes_clips = True
    _conv_layer, _batch_norm = nn.Conv3D, nn.BatchNorm3D
    kernel, strided = (3, 4, 4), (1, 2, 2)


class VGGFeatureDiscriminator(nn.Layer):
    """The frozen VGG16 of the LPIPS file with a trained head per stage (conv3x3 -> LeakyReLU -> conv1x1, the last
    conv zero, so D starts at 0); logits [B, 1] = the sum over stages of each head's spatial mean."""

    def __init__(self, head_channels: int = 64, weights_path: str | None = None) -> None:
        super().__init__()
        self.backbone = load_vgg16_features(weights_path)
        self.heads = nn.LayerList([
            nn.Sequential(_init_weights(nn.Conv2D(channels, head_channels, 3, padding=1)), nn.LeakyReLU(_LEAKY_SLOPE),
                          nn.Conv2D(head_channels, 1, 1, weight_attr=nn.initializer.Constant(0.0),
                                    bias_attr=nn.initializer.Constant(0.0)))
            for channels in LPIPS_CHANNELS])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """Logits [B, 1] of images [B, 3, H, W] in [-1, 1]."""
        return paddle.add_n([head(f).mean(axis=[2, 3]) for head, f in zip(self.heads, self.backbone(x))])


def diff_augment(images: paddle.Tensor, draws: Optional[paddle.Tensor] = None) -> paddle.Tensor:
    """DiffAugment's translation then colour (brightness, saturation, contrast), each image its own draw; `draws`:
    [5, B] uniforms on [0, 1) (default: Paddle's global generator). Differentiable in `images`."""
    b = images.shape[0]
    draws = paddle.rand([5, b]) if draws is None else draws
    x = F.pad(images.astype("float32"), [1, 1, 1, 1])  # the zeros a translation shifts in, read beyond the image
    for axis, draw in ((2, draws[0]), (3, draws[1])):  # rows, then columns: shifted by integers in +-round(side / 8)
        side = x.shape[axis] - 2
        delta = round(side * TRANSLATION)
        shift = paddle.floor(draw * (2 * delta + 1)).astype("int64") - delta  # [B]
        index = paddle.clip(paddle.arange(side, dtype="int64").unsqueeze(0) + shift.unsqueeze(1) + 1, 0, side + 1)
        index = index.reshape([b] + [side if d == axis else 1 for d in (1, 2, 3)])  # [B, side] on `axis`
        x = paddle.take_along_axis(x, index.expand([side if d == axis else n for d, n in enumerate(x.shape)]), axis)
    x = x + (draws[2] - 0.5).reshape([b, 1, 1, 1])  # brightness
    mean = x.mean(axis=1, keepdim=True)
    x = (x - mean) * (2.0 * draws[3]).reshape([b, 1, 1, 1]) + mean  # saturation
    mean = x.mean(axis=[1, 2, 3], keepdim=True)
    return (x - mean) * (draws[4] + 0.5).reshape([b, 1, 1, 1]) + mean  # contrast


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


def _conv1d(channels_in: int, channels_out: int, kernel: int) -> nn.Layer:
    """A spectral-normalised Conv1D with torch's default initialisation, circular padding."""
    bound = 1.0 / math.sqrt(channels_in * kernel)
    conv = nn.Conv1D(channels_in, channels_out, kernel, padding=kernel // 2, padding_mode="circular",
                     weight_attr=nn.initializer.Uniform(-bound, bound), bias_attr=nn.initializer.Uniform(-bound, bound))
    return nn.utils.spectral_norm(conv, dim=0)


def _block(channels: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(_conv1d(channels, channels, kernel), TokenNorm(channels), nn.LeakyReLU(_LEAKY_SLOPE))


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
            nn.Sequential(_block(width, 1), _Residual(_block(width, HEAD_KERNEL)), _conv1d(width, 1, 1))
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


def build_discriminator(disc_type: str = "patch", norm: str = "batch", num_layers: int = 3,
                        base_channels: int = 64, weights_path: str | None = None,
                        condition_channels: int = 0, in_channels: int = 3) -> nn.Layer:
    """"patch" (PatchGAN), "patchgan3d" (its 3-D form over clips), "vgg" (heads of width base_channels on the VGG16
    of the LPIPS file `weights_path`) or "dino" (RAE's heads on the DINO ViT of `weights_path`). A PatchGAN with
    `condition_channels` scores images with their latents (`forward(images, condition)`); one of `in_channels` 4
    sees RGBA images' alpha (objectives.gan.discriminator_view)."""
    if condition_channels and disc_type not in PATCH_TYPES:
        raise ValueError(f"condition_channels {condition_channels}: only the PatchGANs ({', '.join(PATCH_TYPES)}) "
                         f"take a latent condition, not disc_type {disc_type!r}")
    if disc_type in PATCH_TYPES:
        patchgan = PatchDiscriminator3D if disc_type == "patchgan3d" else PatchDiscriminator
        return patchgan(in_channels, base_channels, num_layers, norm, condition_channels)
    if disc_type == "vgg":
        return VGGFeatureDiscriminator(base_channels, weights_path)
    if disc_type == "dino":
        return DinoDiscriminator(weights_path)
    raise ValueError(f"disc_type must be 'patch', 'patchgan3d', 'vgg' or 'dino', got {disc_type!r}")


def save_discriminator(disc: nn.Layer, config: dict, out_dir: str) -> None:
    """Write `config.json` (build_discriminator kwargs) and `model_state.pdparams` into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    paddle.save(disc.state_dict(), os.path.join(out_dir, MODEL_NAME))


def init_discriminator_from(disc: nn.Layer, config: dict, path: str) -> None:
    """Start `disc` (built from `config`) from one saved by `save_discriminator` or inside a checkpoint-N at `path`
    (--discriminator_path); a FileNotFoundError says what was expected, a ValueError names the flags that differ."""
    weights = os.path.join(path, MODEL_NAME)
    configs = [name for name in (DISCRIMINATOR_CONFIG_NAME, CONFIG_NAME) if os.path.isfile(os.path.join(path, name))]
    if not configs or not os.path.isfile(weights):
        hint = ""
        if os.path.isdir(os.path.join(path, "discriminator")):  # a run's OUTPUT_DIR
            hint = f" It is a run's output folder: give --discriminator_path {os.path.join(path, 'discriminator')}."
        raise FileNotFoundError(
            f"--discriminator_path {path}: expected an earlier run's OUTPUT_DIR/discriminator ({CONFIG_NAME} + "
            f"{MODEL_NAME}) or a checkpoint-N folder ({DISCRIMINATOR_CONFIG_NAME} + {MODEL_NAME}).{hint}")
    saved_config = read_json(os.path.join(path, configs[0]))
    prefix = "discriminator." if configs[0] == DISCRIMINATOR_CONFIG_NAME else ""  # a checkpoint's: beside the VAE's
    state = {k[len(prefix):]: v for k, v in paddle.load(weights).items() if k.startswith(prefix)}
    must_agree = ["disc_type", "base_channels"] + (["norm", "num_layers", "condition_channels", "in_channels"]
                                                   if config["disc_type"] in PATCH_TYPES else [])
    defaults = {"condition_channels": 0, "in_channels": 3}  # configs without the key (saved before it existed; RGB)
    saved, this = ({key: given.get(key, defaults.get(key)) for key in must_agree} for given in (saved_config, config))
    flag = {"condition_channels": "latent channels it is conditioned on (a distillation's teacher's)",
            "in_channels": "image channels it sees (the VAE's: 4 for RGBA)"}
    differing = [f"{flag.get(key, '--disc_' + key.removeprefix('disc_'))} {saved[key]!r} (this run: {this[key]!r})"
                 for key in must_agree if saved[key] != this[key]]
    if differing:
        raise ValueError(f"--discriminator_path {path} holds a different discriminator: {'; '.join(differing)}. "
                         "Pass the same flags as the run that trained it, or drop --discriminator_path.")
    missing, unexpected = disc.set_state_dict(state)
    if missing or unexpected:
        raise ValueError(f"--discriminator_path {path}: weights do not match (missing {missing}, "
                         f"unexpected {unexpected})")


def convert_batchnorm_to_sync(layer: nn.Layer, device: str | None = None) -> nn.Layer:
    """The layer with every BatchNorm a SyncBatchNorm; on CPU (no kernel in paddle 3.3.1) unchanged, with a warning."""
    if (device or paddle.get_device()).startswith("cpu"):
        warnings.warn("SyncBatchNorm has no CPU kernel; BatchNorm statistics stay per rank", stacklevel=2)
        return layer
    return nn.SyncBatchNorm.convert_sync_batchnorm(layer)
