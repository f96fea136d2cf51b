"""DINOv2 (ViT) in Paddle: `load_dinov2(path)` of a transformers folder or a timm / torch-hub state dict (renamed to
timm's keys), and the frozen model's `patch_tokens`. Position embeddings are resized as the file's own library does
(docs/techniques.md, section 12). Keep the model outside any saved layer, so checkpoints never hold it.
`read_dinov2(path)`: its weights and the shapes read from them, for models built on a DINOv2 (autoencoder_rae.py)."""

from __future__ import annotations

import functools
import math
import os
import re

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..checkpoint import read_json
from .lpips import freeze
from .torch_files import read_state_dict

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEFAULT_SIZE = 224
# What DINOv2 is fed (docs/techniques.md, section 12): "imagenet", [0, 1] with ImageNet's mean and std (as DINOv2 was
# trained), or "vavae", VA-VAE's [-1, 1] images as they are (LightningDiT's forward_dinov2); both resized bilinearly.
INPUT_CONVENTIONS = ("imagenet", "vavae")
EXPECTED = ("a transformers DINOv2 folder (config.json + model.safetensors or pytorch_model.bin) or a timm / "
            "torch-hub DINOv2 state dict (.safetensors, .pth, .bin)")
# transformers (and torch hub) names -> timm names; q/k/v and gate/up are concatenated afterwards. Also transformers'
# ViTModel's (DINO v1, the DINO discriminator's backbone: layernorm_before, intermediate.dense, ...).
_RENAMES = [(r"^(dinov2|dinov2_with_registers|model|vit)\.", ""),
            (r"embeddings\.patch_embeddings\.projection", "patch_embed.proj"),
            (r"embeddings\.cls_token", "cls_token"), (r"(embeddings\.)?register_tokens", "reg_token"),
            (r"embeddings\.position_embeddings", "pos_embed"), (r"encoder\.layer\.", "blocks."),
            (r"attention\.attention\.(query|key|value)", lambda match: "attn." + match.group(1)[0]),
            (r"attention\.([qkv])_proj", r"attn.\1"), (r"attention\.(output\.dense|o_proj)", "attn.proj"),
            (r"(layer_scale|ls)(\d)\.(lambda1|gamma)", r"ls\2"), (r"mlp\.(weights_in|w12)", "mlp.fc1"),
            (r"mlp\.(weights_out|w3|down_proj)", "mlp.fc2"), (r"mlp\.gate_proj", "mlp.g"), (r"mlp\.up_proj", "mlp.u"),
            (r"^layernorm\.", "norm."), (r"layernorm_before", "norm1"), (r"layernorm_after", "norm2"),
            (r"intermediate\.dense", "mlp.fc1"), (r"^(blocks\.\d+)\.output\.dense", r"\1.mlp.fc2")]


@functools.lru_cache(maxsize=64)
def resize_matrix(size_in: int, size_out: int, mode: str) -> np.ndarray:
    """[size_out, size_in] weights of torch's 1-D bicubic resize (align_corners=False). mode: "bicubic", "offset"
    (the hub's scale_factor (size_out + 0.1) / size_in), "antialias" (PIL's kernel, a = -0.5)."""
    matrix = np.zeros((size_out, size_in))
    scale = size_in / (size_out + (0.1 if mode == "offset" else 0.0))
    for i in range(size_out):
        if mode == "antialias":
            support = 2.0 * max(scale, 1.0)
            center = scale * (i + 0.5)
            lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), size_in)
            weights = _cubic((np.arange(lo, hi) - center + 0.5) / max(scale, 1.0), -0.5)
            matrix[i, lo:hi] = weights / weights.sum()
        else:
            real = scale * (i + 0.5) - 0.5
            base = math.floor(real)
            for k in range(-1, 3):
                matrix[i, min(max(base + k, 0), size_in - 1)] += _cubic(real - (base + k), -0.75)
    return matrix.astype(np.float32)


def _cubic(x, a: float):
    x = np.abs(x)
    return np.where(x <= 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


class _Block(nn.Layer):
    """A transformer block with timm's parameter names; the MLP is fc1 -> GELU -> fc2, or SwiGLU (fc1 packs gate and
    up: silu(first half) * second half)."""

    def __init__(self, width: int, heads: int, hidden: int, swiglu: bool, eps: float):
        super().__init__()
        self.heads, self.swiglu = heads, swiglu
        self.approximate_gelu = False  # the DINO discriminator's ViT: tanh GELU, as RAE's authors run it
        self.norm1, self.attn = nn.LayerNorm(width, epsilon=eps), nn.Layer()
        self.attn.qkv, self.attn.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm2, self.mlp = nn.LayerNorm(width, epsilon=eps), nn.Layer()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(width, 2 * hidden if swiglu else hidden), nn.Linear(hidden, width)
        one = nn.initializer.Constant(1.0)  # (overwritten by the file; a constant draws no random numbers)
        self.ls1, self.ls2 = (self.create_parameter([width], default_initializer=one) for _ in range(2))  # layer scales

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.attn.qkv(self.norm1(x)).reshape([b, n, 3, self.heads, c // self.heads]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        scores = paddle.matmul(q * (c // self.heads) ** -0.5, k, transpose_y=True)
        attn = F.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
        x = x + self.ls1 * self.attn.proj(paddle.matmul(attn, v).transpose([0, 2, 1, 3]).reshape([b, n, c]))
        hidden = self.mlp.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = hidden.chunk(2, axis=-1)
            return x + self.ls2 * self.mlp.fc2(F.silu(gate) * up)
        return x + self.ls2 * self.mlp.fc2(F.gelu(hidden, approximate=self.approximate_gelu))


class Dinov2(nn.Layer):
    """DINOv2 ViT with timm's parameter names. `half_dtype`: `patch_tokens`' autocast dtype on GPU (None: float32)."""

    def __init__(self, width, depth, heads, patch, registers=0, hidden=None, swiglu=False, positions=257,
                 eps=1e-6, resize_mode="bicubic"):
        super().__init__()
        self.feature_dim, self.patch, self.registers, self.resize_mode = width, patch, registers, resize_mode
        self.stored_grid = math.isqrt(positions)
        self.cls_pos = positions != self.stored_grid ** 2  # timm's reg4 files fold the cls position into cls_token
        self.patch_embed = nn.Layer()
        self.patch_embed.proj = nn.Conv2D(3, width, patch, stride=patch)
        self.cls_token = self.create_parameter([1, 1, width])
        self.reg_token = self.create_parameter([1, registers, width]) if registers else None
        self.pos_embed = self.create_parameter([1, positions, width])
        self.blocks = nn.LayerList([_Block(width, heads, hidden or 4 * width, swiglu, eps) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, epsilon=eps)
        self.half_dtype, self.input_convention = None, "imagenet"
        if paddle.device.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
            self.half_dtype = "bfloat16" if paddle.amp.is_bfloat16_supported() else "float16"

    def _positions(self, height: int, width: int):
        """Patch position embeddings [1, h*w, C] for an input of height x width pixels (float32)."""
        h, w = height // self.patch, width // self.patch
        pos = self.pos_embed[:, 1:] if self.cls_pos else self.pos_embed
        if (h, w) == (self.stored_grid,) * 2 and height == width:  # the libraries' own shortcut
            return pos
        g, c = self.stored_grid, self.feature_dim
        with paddle.amp.auto_cast(enable=False):
            grid = pos.astype("float32").reshape([g, g, c]).transpose([2, 0, 1])  # [C, g, g]
            rows = paddle.to_tensor(resize_matrix(g, h, self.resize_mode))
            cols = paddle.to_tensor(resize_matrix(g, w, self.resize_mode))
            grid = paddle.matmul(paddle.matmul(rows, grid), cols, transpose_y=True)  # [C, h, w]
        return grid.reshape([c, h * w]).transpose([1, 0]).unsqueeze(0).astype(pos.dtype)

    def forward(self, pixels: paddle.Tensor) -> paddle.Tensor:
        """All tokens [B, 1 + registers + h*w, C] after the final norm, of the pixels `patch_tokens` prepared."""
        x = self.embed(pixels)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def embed(self, pixels: paddle.Tensor) -> paddle.Tensor:
        """The tokens [B, 1 + registers + h*w, C] the first block takes."""
        b = pixels.shape[0]
        x = self.patch_embed.proj(pixels).flatten(2).transpose([0, 2, 1])
        x = x + self._positions(pixels.shape[2], pixels.shape[3]).astype(x.dtype)
        cls = self.cls_token + (self.pos_embed[:, :1] if self.cls_pos else 0)
        tokens = [cls.astype(x.dtype).expand([b, 1, -1])]
        if self.reg_token is not None:
            tokens.append(self.reg_token.astype(x.dtype).expand([b, self.registers, -1]))
        return paddle.concat(tokens + [x], axis=1)

    def patch_tokens(self, images: paddle.Tensor, size: int | None = DEFAULT_SIZE):
        """(patch tokens [B, h*w, C] float32, (h, w)) of images in [-1, 1] resized (bilinear) to size x size (None:
        as they are), then as `input_convention` says. Gradients reach `images` only if they require them."""
        imagenet = self.input_convention == "imagenet"
        x = (images.astype("float32") + 1.0) / 2.0 if imagenet else images.astype("float32")
        if size is not None and tuple(x.shape[2:]) != (size, size):
            x = F.interpolate(x, size=[size, size], mode="bilinear", align_corners=False)  # torch's, no antialias
        if imagenet:
            mean = paddle.to_tensor(IMAGENET_MEAN, dtype="float32").reshape([1, 3, 1, 1])
            x = (x - mean) / paddle.to_tensor(IMAGENET_STD, dtype="float32").reshape([1, 3, 1, 1])
        with paddle.amp.auto_cast(enable=self.half_dtype is not None, level="O1", dtype=self.half_dtype or "float16"):
            tokens = self(x)
        grid = (x.shape[2] // self.patch, x.shape[3] // self.patch)
        return tokens[:, 1 + self.registers:].astype("float32"), grid


def load_dinov2(path: str, input_convention: str = "imagenet") -> Dinov2:
    """The frozen DINOv2 in `path` (errors name it and what was expected); heads from config.json, else width / 64.
    `input_convention` (INPUT_CONVENTIONS): what `patch_tokens` feeds it, for the VF loss and the CKA alike."""
    state, arch = read_dinov2(path)
    model = Dinov2(arch["width"], arch["depth"], arch["heads"], arch["patch"], arch["registers"], arch["hidden"],
                   arch["swiglu"], arch["positions"], arch["eps"], arch["resize_mode"])
    freeze(model, state, path)
    model.input_convention = input_convention
    return model


def read_dinov2(path: str) -> tuple[dict, dict]:
    """(numpy state in timm's names and Paddle's layout, its architecture: width, depth, heads, patch, registers,
    hidden (MLP width), swiglu, positions (stored, with the cls one unless timm folded it in), eps, resize_mode)."""
    state, config = _read(path)
    origin = ("transformers" if any(re.match(r"(dinov2\w*\.)?embeddings\.", k) for k in state) else
              "hub" if "mask_token" in state or "register_tokens" in state else "timm")
    state = _to_timm(state)
    try:
        width, patch = state["cls_token"].shape[-1], state["patch_embed.proj.weight"].shape[-1]
        depth = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1)
        hidden = state["blocks.0.mlp.fc2.weight"].shape[0]
        positions = state["pos_embed"].shape[1]
    except KeyError as error:
        raise ValueError(f"{path} is not a DINOv2 checkpoint (no {error}); expected {EXPECTED}") from None
    heads = config.get("num_attention_heads") or (width // 64 if width % 64 == 0 else None)
    if not heads or width % heads:
        raise ValueError(f"{path}: cannot tell the attention heads of width {width}")
    registers = state["reg_token"].shape[1] if "reg_token" in state else 0
    # How the file's own library resizes position embeddings.
    mode = "antialias" if registers or config.get("model_type") == "dinov2_with_registers" else {
        "transformers": "bicubic", "hub": "offset"}.get(origin, "antialias")
    if math.isqrt(positions) ** 2 not in (positions, positions - 1):
        raise ValueError(f"{path}: {positions} position embeddings are not a square grid (+ cls)")
    swiglu = state["blocks.0.mlp.fc1.weight"].shape[1] == 2 * hidden
    return state, dict(width=width, depth=depth, heads=heads, patch=patch, registers=registers, hidden=hidden,
                       swiglu=swiglu, positions=positions, eps=config.get("layer_norm_eps", 1e-6), resize_mode=mode)


def _read(path: str) -> tuple[dict, dict]:
    """(numpy state dict, config.json of a folder or {})."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"DINOv2 weights not found: {path}; expected {EXPECTED}")
    config, file = {}, path
    if os.path.isdir(path):
        names = ("model.safetensors", "pytorch_model.bin")
        found = [os.path.join(path, name) for name in names if os.path.isfile(os.path.join(path, name))]
        if not found or not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} holds no config.json + {' / '.join(names)}; expected {EXPECTED}")
        config, file = read_json(os.path.join(path, "config.json")), found[0]
    try:
        state = read_state_dict(file)
    except Exception as error:
        raise ValueError(f"cannot read {file} ({type(error).__name__}: {error}); expected {EXPECTED}") from None
    for key in ("model", "teacher", "state_dict"):  # training checkpoints wrap the weights
        state = state[key] if isinstance(state.get(key), dict) else state
    return state, config


def _to_timm(state: dict) -> dict:
    """timm's names, q/k/v and gate/up concatenated, Linear weights [in, out] as paddle holds them, floats float32."""
    out = {}
    for key, value in state.items():
        for pattern, replacement in _RENAMES:
            key = re.sub(pattern, replacement, key)
        out[key] = np.asarray(value)
    for fused, parts in (("attn.qkv.", ("attn.q.", "attn.k.", "attn.v.")), ("mlp.fc1.", ("mlp.g.", "mlp.u."))):
        for key in [k for k in out if parts[0] in k]:
            out[key.replace(parts[0], fused)] = np.concatenate([out.pop(key.replace(parts[0], p)) for p in parts])
    for key, value in out.items():
        if value.dtype.kind == "f":
            value = value.T if value.ndim == 2 and key.endswith(".weight") else value
            out[key] = np.ascontiguousarray(value, dtype=np.float32)
    return out
