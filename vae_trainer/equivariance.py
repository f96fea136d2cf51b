"""EQ-VAE's spatial transforms of a latent and its image alike (a downscale or a quarter turn), drawn from (seed,
step, micro-batch) alone; also the latent diagnostics' halved pair. docs/techniques.md, sections 9-10."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np
import paddle

TRANSFORMS = ("scale", "rotate")
MIN_SCALED_SIDE = 24  # px: the smallest image the default 3-layer PatchGAN scores (3 * 2 ** layers)
DEFAULT_TRANSFORMS = "scale,rotate"
_STREAM = 0x45515641  # "EQVA": keeps these draws apart from any other use of the seed


def parse_transforms(value: str) -> Tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in str(value).split(",") if name.strip()))
    if not names or any(name not in TRANSFORMS for name in names):
        raise ValueError(f"--equivariance_transforms takes a comma-separated list of {', '.join(TRANSFORMS)}, "
                         f"got {value!r}")
    return names


@dataclass(frozen=True)
class Transform:
    """`kind` "scale" with `scale` s, or "rotate" with `quarter_turns` k (1-3, counter-clockwise)."""

    kind: str
    scale: float = 1.0
    quarter_turns: int = 0

    def latent_size(self, height: int, width: int, factors: Sequence[int]) -> Tuple[int, int]:
        """tau's latent size for a `height` x `width` latent whose images are `factors` (H / h, W / w) larger."""
        if self.kind == "rotate":
            return (width, height) if self.quarter_turns % 2 else (height, width)
        return (scaled_size(height, self.scale, -(-MIN_SCALED_SIDE // factors[0])),
                scaled_size(width, self.scale, -(-MIN_SCALED_SIDE // factors[1])))

    def latent(self, latent: paddle.Tensor, image_size: Sequence[int]) -> paddle.Tensor:
        """tau(z) of a [B, C, h, w] latent of images of `image_size` (H, W)."""
        if self.kind == "rotate":
            return paddle.rot90(latent, k=self.quarter_turns, axes=[2, 3])
        h, w = latent.shape[2], latent.shape[3]
        return resize(latent, self.latent_size(h, w, (image_size[0] // h, image_size[1] // w)))

    def images(self, images: paddle.Tensor, latent_size: Sequence[int]) -> paddle.Tensor:
        """tau(x) of [B, C, H, W] images whose clean latent is `latent_size` (h, w), in float32 under any autocast."""
        with paddle.amp.auto_cast(enable=False):
            if self.kind == "rotate":
                return paddle.rot90(images, k=self.quarter_turns, axes=[2, 3])
            factors = (images.shape[2] // latent_size[0], images.shape[3] // latent_size[1])
            new_h, new_w = self.latent_size(*latent_size, factors)
            return resize(images, (new_h * factors[0], new_w * factors[1]))


def scaled_size(size: int, scale: float, minimum: int = 1) -> int:
    """round(scale * size) within [minimum, size - 1]; a size that cannot shrink and stay >= minimum is kept."""
    if size - 1 < max(1, minimum):
        return size
    return max(max(1, minimum), min(size - 1, int(round(scale * size))))


def draw(seed: int, step: int, micro_batch: int, prob: float, min_scale: float,
         transforms: Sequence[str]) -> Optional[Transform]:
    """The transform of micro-batch `micro_batch` of optimizer step `step`, or None (the plain objective)."""
    if prob <= 0:
        return None
    rng = np.random.default_rng([_STREAM, seed, step, micro_batch])
    if rng.random() >= prob:
        return None
    kind = transforms[int(rng.integers(len(transforms)))]
    if kind == "rotate":
        return Transform("rotate", quarter_turns=int(rng.integers(1, 4)))
    return Transform("scale", scale=float(rng.uniform(min_scale, 1.0)))


@lru_cache(maxsize=64)
def _resize_weights(in_size: int, out_size: int) -> np.ndarray:
    """[out, in] antialiased bilinear (triangle filter) weights, PIL's BILINEAR resize."""
    scale = in_size / out_size
    support = max(scale, 1.0)  # the triangle's half-width, in input samples
    weights = np.zeros((out_size, in_size), dtype=np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        low, high = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        values = np.maximum(0.0, 1.0 - np.abs((np.arange(low, high) + 0.5 - center) / support))
        weights[i, low:high] = values / values.sum()
    return weights.astype(np.float32)


def resize(tensor: paddle.Tensor, size: Tuple[int, int]) -> paddle.Tensor:
    """Antialiased bilinear resize of [B, C, H, W] to `size` = (H', W'): two matrix products, differentiable."""
    height, width = tensor.shape[2], tensor.shape[3]
    if (height, width) == tuple(size):
        return tensor
    rows = paddle.to_tensor(_resize_weights(height, size[0])).astype(tensor.dtype)
    cols = paddle.to_tensor(_resize_weights(width, size[1])).astype(tensor.dtype)
    return paddle.matmul(paddle.matmul(rows, tensor), cols, transpose_y=True)


def halved_pair(latent: paddle.Tensor, images: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(down2(z), down2(x)) of the scale-equivariance diagnostic: the latent halved (sides >= 1), the images alike."""
    (h, w), (height, width) = latent.shape[2:], images.shape[2:]
    half = max(1, h // 2), max(1, w // 2)
    with paddle.amp.auto_cast(enable=False):  # the target in float32, as the plain metrics' images
        target = resize(images, (half[0] * (height // h), half[1] * (width // w)))
    return resize(latent, half), target
