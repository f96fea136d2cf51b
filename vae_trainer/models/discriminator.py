"""GAN discriminators (the PatchGAN of pix2pix / taming-transformers, its 3-D form over clips, one on VGG16 features,
RAE's on a DINO ViT: dino_discriminator.py): saving one as OUTPUT_DIR/discriminator, reading one back
(--discriminator_path), BatchNorm -> SyncBatchNorm on several GPUs."""

from __future__ import annotations

import json
import math
import os
import warnings

import paddle
from paddle import nn

from ..checkpoint import DISCRIMINATOR_CONFIG_NAME, MODEL_NAME, read_json
from .dino_discriminator import DinoDiscriminator
from .lpips import LPIPS_CHANNELS, load_vgg16_features

NORM_TYPES = ("batch", "group", "spectral_group", "none")
PATCH_TYPES = ("patch", "patchgan3d")  # the PatchGANs: --disc_norm, --disc_num_layers apply
CONFIG_NAME = "config.json"
_LEAKY_SLOPE = 0.2


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
    if os.path.isfile(os.path.join(path, DISCRIMINATOR_CONFIG_NAME)) and os.path.isfile(weights):
        prefix = "discriminator."
        state = {k[len(prefix):]: v for k, v in paddle.load(weights).items() if k.startswith(prefix)}
        saved_config = read_json(os.path.join(path, DISCRIMINATOR_CONFIG_NAME))
    elif os.path.isfile(os.path.join(path, CONFIG_NAME)) and os.path.isfile(weights):
        saved_config, state = read_json(os.path.join(path, CONFIG_NAME)), paddle.load(weights)
    else:
        hint = ""
        if os.path.isdir(os.path.join(path, "discriminator")):  # a run's OUTPUT_DIR
            hint = f" It is a run's output folder: give --discriminator_path {os.path.join(path, 'discriminator')}."
        raise FileNotFoundError(
            f"--discriminator_path {path}: expected an earlier run's OUTPUT_DIR/discriminator ({CONFIG_NAME} + "
            f"{MODEL_NAME}) or a checkpoint-N folder ({DISCRIMINATOR_CONFIG_NAME} + {MODEL_NAME}).{hint}")
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
