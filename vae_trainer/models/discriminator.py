"""GAN discriminators for VAE training: the PatchGAN of pix2pix / taming-transformers used by LDM.

Owns: `PatchDiscriminator` (NLayerDiscriminator with batch, group, spectral+group or no norm),
`VGGFeatureDiscriminator` (frozen ImageNet VGG16 features with a trained head per stage),
the `build_discriminator` factory (by type name, open for more types), saving/loading a
discriminator as `config.json` + `model_state.pdparams` in its own folder, reading one back from there or
from a checkpoint-N (`read_discriminator`, `load_discriminator`), starting one from a saved one
(`init_discriminator_from`, --discriminator_path), and BatchNorm ->
SyncBatchNorm conversion for data-parallel training.

Spectral norm uses `paddle.nn.utils.spectral_norm` (checked on paddle 3.3.1 dygraph: its power
iteration vectors `weight_u`/`weight_v` update in train mode only, and are saved in state_dict).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Tuple

import paddle
from paddle import nn

from ..checkpoint import DISCRIMINATOR_CONFIG_NAME, MODEL_NAME, read_json
from .lpips import LPIPS_CHANNELS, LPIPS_SCALE, LPIPS_SHIFT, load_vgg16_features

NORM_TYPES = ("batch", "group", "spectral_group", "none")
DISCRIMINATOR_TYPES = ("patch", "vgg")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model_state.pdparams"

_KERNEL_SIZE = 4
_PADDING = 1
_MAX_CHANNEL_MULTIPLIER = 8
_GROUP_NORM_GROUPS = 32
_LEAKY_SLOPE = 0.2
_INIT_STD = 0.02


def _norm_layer(norm: str, channels: int) -> nn.Layer:
    if norm == "batch":
        return nn.BatchNorm2D(channels)
    # gcd keeps GroupNorm valid for narrow test-sized discriminators.
    return nn.GroupNorm(math.gcd(_GROUP_NORM_GROUPS, channels), channels)


def _init_weights(layer: nn.Layer) -> None:
    """taming-transformers' weights_init: conv N(0, 0.02), norm scale N(1, 0.02), biases 0."""
    normal = nn.initializer.Normal
    zeros = nn.initializer.Constant(0.0)
    if isinstance(layer, nn.Conv2D):
        normal(0.0, _INIT_STD)(layer.weight)
        if layer.bias is not None:
            zeros(layer.bias)
    elif isinstance(layer, (nn.BatchNorm2D, nn.GroupNorm)):
        normal(1.0, _INIT_STD)(layer.weight)
        zeros(layer.bias)


class PatchDiscriminator(nn.Layer):
    """PatchGAN: `num_layers` stride-2 convs, one stride-1 conv, then a 1-channel conv of patch logits."""

    def __init__(self, in_channels: int = 3, base_channels: int = 64, num_layers: int = 3, norm: str = "batch") -> None:
        super().__init__()
        if norm not in NORM_TYPES:
            raise ValueError(f"norm must be one of {NORM_TYPES}, got {norm!r}")
        self.norm = norm
        widths = [base_channels * min(2**n, _MAX_CHANNEL_MULTIPLIER) for n in range(num_layers + 1)]
        layers = [self._conv(in_channels, widths[0], stride=2, bias=True), nn.LeakyReLU(_LEAKY_SLOPE)]
        for n in range(1, num_layers + 1):
            stride = 2 if n < num_layers else 1
            layers += self._conv_norm_act(widths[n - 1], widths[n], stride)
        layers.append(self._conv(widths[-1], 1, stride=1, bias=True))
        self.main = nn.Sequential(*layers)

    def _conv(self, in_channels: int, out_channels: int, stride: int, bias: bool) -> nn.Layer:
        conv = nn.Conv2D(in_channels, out_channels, _KERNEL_SIZE, stride=stride, padding=_PADDING,
                         bias_attr=None if bias else False)
        _init_weights(conv)
        # Initialise before wrapping: spectral_norm re-registers the weight as `weight_orig`.
        return nn.utils.spectral_norm(conv) if self.norm == "spectral_group" else conv

    def _conv_norm_act(self, in_channels: int, out_channels: int, stride: int) -> list[nn.Layer]:
        # A bias in front of a normalisation is cancelled by it (taming drops it for BatchNorm too).
        has_norm = self.norm != "none"
        layers = [self._conv(in_channels, out_channels, stride, bias=not has_norm)]
        if has_norm:
            norm = _norm_layer(self.norm.replace("spectral_", ""), out_channels)
            _init_weights(norm)
            layers.append(norm)
        return layers + [nn.LeakyReLU(_LEAKY_SLOPE)]

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """Patch logits [B, 1, h, w] of images [B, C, H, W]."""
        return self.main(x)


class VGGFeatureDiscriminator(nn.Layer):
    """Frozen ImageNet VGG16 features (the LPIPS backbone) with a small trained conv head per stage.

    Each of the 5 stages (relu1_2 ... relu5_3) feeds conv3x3 -> LeakyReLU -> conv1x1 to one logit map;
    the logits are the sum over stages of each map's spatial mean, shape [B, 1]. The last conv of
    every head starts at zero, so training starts from D = 0 on every image. Inputs are in [-1, 1]
    and get LPIPS' ImageNet scaling. Only the heads are trainable.
    """

    def __init__(self, head_channels: int = 64, weights_path: str | None = None) -> None:
        super().__init__()
        self.backbone = load_vgg16_features(weights_path)  # frozen (stop_gradient) and in eval mode
        self.register_buffer("shift", paddle.to_tensor(LPIPS_SHIFT, "float32").reshape([1, 3, 1, 1]), persistable=False)
        self.register_buffer("scale", paddle.to_tensor(LPIPS_SCALE, "float32").reshape([1, 3, 1, 1]), persistable=False)
        self.heads = nn.LayerList([self._head(channels, head_channels) for channels in LPIPS_CHANNELS])

    @staticmethod
    def _head(in_channels: int, width: int) -> nn.Layer:
        hidden = nn.Conv2D(in_channels, width, 3, padding=1)
        _init_weights(hidden)
        last = nn.Conv2D(width, 1, 1, weight_attr=nn.initializer.Constant(0.0), bias_attr=nn.initializer.Constant(0.0))
        return nn.Sequential(hidden, nn.LeakyReLU(_LEAKY_SLOPE), last)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """Logits [B, 1] of images [B, 3, H, W] in [-1, 1]."""
        features = self.backbone((x - self.shift.astype(x.dtype)) / self.scale.astype(x.dtype))
        stage_logits = [head(f).mean(axis=[2, 3]) for head, f in zip(self.heads, features)]
        return paddle.add_n(stage_logits)


def build_discriminator(disc_type: str = "patch", norm: str = "batch", num_layers: int = 3,
                        base_channels: int = 64, in_channels: int = 3, weights_path: str | None = None) -> nn.Layer:
    """A discriminator by type name: "patch" (PatchGAN) or "vgg" (VGG16 features + heads of width
    base_channels, backbone weights from the LPIPS file `weights_path`; norm and num_layers unused)."""
    if disc_type == "patch":
        return PatchDiscriminator(in_channels, base_channels, num_layers, norm)
    if disc_type == "vgg":
        if in_channels != 3:
            raise ValueError("the VGG16 discriminator needs RGB inputs")
        return VGGFeatureDiscriminator(base_channels, weights_path)
    raise ValueError(f"disc_type must be one of {DISCRIMINATOR_TYPES}, got {disc_type!r}")


def save_discriminator(disc: nn.Layer, config: dict, out_dir: str) -> None:
    """Write `config.json` (build_discriminator kwargs) and `model_state.pdparams` into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    paddle.save(disc.state_dict(), os.path.join(out_dir, WEIGHTS_NAME))


def read_discriminator(path: str) -> Tuple[dict, dict, str]:
    """(config, weights, source) of a discriminator saved as OUTPUT_DIR/discriminator (config.json +
    model_state.pdparams, `save_discriminator`) or inside a checkpoint-N (discriminator_config.json + the
    `discriminator.` weights of its model_state.pdparams)."""
    if os.path.isfile(os.path.join(path, DISCRIMINATOR_CONFIG_NAME)) and os.path.isfile(os.path.join(path, MODEL_NAME)):
        prefix = "discriminator."
        state = paddle.load(os.path.join(path, MODEL_NAME))
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        return read_json(os.path.join(path, DISCRIMINATOR_CONFIG_NAME)), state, path
    if os.path.isfile(os.path.join(path, CONFIG_NAME)) and os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        return read_json(os.path.join(path, CONFIG_NAME)), paddle.load(os.path.join(path, WEIGHTS_NAME)), path
    hint = ""
    if os.path.isdir(os.path.join(path, "discriminator")):  # a run's OUTPUT_DIR
        hint = f" It is a run's output folder: give --discriminator_path {os.path.join(path, 'discriminator')}."
    raise FileNotFoundError(
        f"--discriminator_path {path}: expected an earlier run's OUTPUT_DIR/discriminator ({CONFIG_NAME} + "
        f"{WEIGHTS_NAME}) or a checkpoint-N folder ({DISCRIMINATOR_CONFIG_NAME} + {MODEL_NAME}).{hint}")


def load_discriminator(path: str) -> nn.Layer:
    """Rebuild a saved discriminator (weights and norm statistics) with its own config."""
    config, state, source = read_discriminator(path)
    disc = build_discriminator(**config)
    init_discriminator_from(disc, config, config, state, source)
    return disc


# What must agree between a saved discriminator and this run's flags, per type (the flag to change in brackets).
_MATCHING_FIELDS = {"patch": {"norm": "--disc_norm", "num_layers": "--disc_num_layers",
                              "base_channels": "--disc_base_channels"},
                    "vgg": {"base_channels": "--disc_base_channels"}}


def init_discriminator_from(disc: nn.Layer, config: dict, saved_config: dict, state: dict, source: str) -> None:
    """Start `disc` (built from `config`) from a saved discriminator (`saved_config`, weights `state`), after
    checking that both are the same kind of network: a clear error names the flags that differ."""
    fields = {"disc_type": "--disc_type", **_MATCHING_FIELDS.get(config.get("disc_type", "patch"), {})}
    differing = [f"{flag} {saved_config.get(key)!r} (this run: {config.get(key)!r})"
                 for key, flag in fields.items() if saved_config.get(key) != config.get(key)]
    if differing:
        raise ValueError(f"--discriminator_path {source} holds a different discriminator: {'; '.join(differing)}. "
                         "Pass the same flags as the run that trained it, or drop --discriminator_path.")
    missing, unexpected = disc.set_state_dict(state)
    if missing or unexpected:
        raise ValueError(f"--discriminator_path {source}: weights do not match (missing {missing}, unexpected {unexpected})")


def convert_batchnorm_to_sync(layer: nn.Layer, device: str | None = None) -> nn.Layer:
    """The layer with every BatchNorm replaced by SyncBatchNorm (statistics over all ranks).

    On CPU (device None means paddle's current device) the layer comes back unchanged, with a
    warning: paddle 3.3.1 has no CPU sync_batch_norm kernel, so each rank keeps its own statistics.
    """
    device = device or paddle.get_device()
    if device.startswith("cpu"):
        warnings.warn("SyncBatchNorm has no CPU kernel; BatchNorm statistics stay per rank", stacklevel=2)
        return layer
    return nn.SyncBatchNorm.convert_sync_batchnorm(layer)
