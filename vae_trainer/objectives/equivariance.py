"""EQ-VAE's spatial transforms of a latent and its image alike (a downscale or a quarter turn), drawn from (seed,
step, micro-batch) alone; also the latent diagnostics' halved pair, and the refusals of its flags. docs/techniques.md,
sections 9-10."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import paddle

from ..refusals import FROZEN_LATENT

TRANSFORMS = ("scale", "rotate")
MIN_SCALED_SIDE = 24  # px: the smallest image the default 3-layer PatchGAN scores (3 * 2 ** layers)
DEFAULT_TRANSFORMS = ",".join(TRANSFORMS)
HALF_NYQUIST = 0.25  # cycles per sample: the latent diagnostics' high-frequency band starts there
# How its diagnostics are made (evaluation.py states them in the protocol).
DEFINITIONS = {
    "scale_equivariance_psnr": "PSNR on [0, 1] of decode(down2(z)) against down2(x), z the posterior mode, down2 "
                               "the 0.5x antialiased bilinear downscale (latent h x w -> h//2 x w//2)",
    "rotation_equivariance_psnr": "PSNR on [0, 1] of decode(rot90(z)) against rot90(x), z the posterior mode",
    "latent_high_frequency_share": "share of the posterior modes' spatial energy (|FFT2|^2 per image and channel, "
                                   f"mean removed) at radial frequencies above {HALF_NYQUIST} cycles/sample (half "
                                   "Nyquist), summed over images and channels before dividing",
}
DIAGNOSTICS = tuple(DEFINITIONS)
_STREAM = 0x45515641  # "EQVA": keeps these draws apart from any other use of the seed


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("equivariance_prob",), lambda f: not 0 <= f.equivariance_prob <= 1, "it is a probability in [0, 1]"),
    (("equivariance_min_scale",), lambda f: not 0 < f.equivariance_min_scale < 1,
     "it is the smallest downscale factor, in (0, 1)"),
    (("equivariance_prob",), lambda f: f.equivariance_prob > 0 and f.freeze_encoder,
     "it shapes the latent space, and the latent space belongs to the encoder, which --freeze_encoder keeps as it "
     "is: drop one of them (an equivariance fine-tune trains the encoder and the decoder together)"),
    (("equivariance_prob",), lambda f: f.equivariance_prob > 0 and f.frozen_latent,
     f"it shapes the latent space, and {FROZEN_LATENT}: drop it"),
    (("equivariance_min_scale", "equivariance_transforms"), lambda f: f.equivariance_prob == 0,
     "it shapes the transforms of --equivariance_prob, which is 0 (off): add --equivariance_prob 0.5, or drop it"),
    (("equivariance_min_scale",),
     lambda f: f.equivariance_prob > 0 and "scale" not in parse_transforms(f.equivariance_transforms),
     "it is the range of the scale transform, which --equivariance_transforms leaves out: add scale, or drop it"),
)


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
    min_side: int = 1  # the smallest latent side the decoder takes (Geometry.min_latent_side: LTX-2's reflect pads)

    def latent_size(self, height: int, width: int, factors: Sequence[int]) -> Tuple[int, int]:
        """A scale's latent size for a `height` x `width` latent whose images are `factors` (H / h, W / w) larger."""
        return (scaled_size(height, self.scale, max(-(-MIN_SCALED_SIDE // factors[0]), self.min_side)),
                scaled_size(width, self.scale, max(-(-MIN_SCALED_SIDE // factors[1]), self.min_side)))

    def __call__(self, tensor: paddle.Tensor, latent_size: Sequence[int], image_size: Sequence[int]) -> paddle.Tensor:
        """tau of a [B, C, H, W] `tensor`, the latent or the images of a clean latent of `latent_size` (h, w) whose
        images are `image_size` (H, W): a scale keeps the tensor's own multiple of the latent's sides."""
        if self.kind == "rotate":
            return paddle.rot90(tensor, k=self.quarter_turns, axes=[2, 3])
        (h, w), factors = latent_size, (image_size[0] // latent_size[0], image_size[1] // latent_size[1])
        new_h, new_w = self.latent_size(h, w, factors)
        return resize(tensor, (new_h * (tensor.shape[2] // h), new_w * (tensor.shape[3] // w)))


def scaled_size(size: int, scale: float, minimum: int = 1) -> int:
    """round(scale * size) within [minimum, size - 1]; a size that cannot shrink and stay >= minimum is kept."""
    return size if size - 1 < minimum else max(minimum, min(size - 1, int(round(scale * size))))


def draw(seed: int, step: int, micro_batch: int, prob: float, min_scale: float,
         transforms: Sequence[str], min_side: int = 1) -> Optional[Transform]:
    """The transform of micro-batch `micro_batch` of optimizer step `step`, or None (the plain objective); a scale
    keeps latent sides of at least `min_side`."""
    rng = np.random.default_rng([_STREAM, seed, step, micro_batch])
    if rng.random() >= prob:
        return None
    kind = transforms[int(rng.integers(len(transforms)))]
    if kind == "rotate":
        return Transform("rotate", quarter_turns=int(rng.integers(1, 4)))
    return Transform("scale", scale=float(rng.uniform(min_scale, 1.0)), min_side=min_side)


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


def equivariance_pairs(decode: Callable[[paddle.Tensor], paddle.Tensor], images: paddle.Tensor,
                       latents: paddle.Tensor, scale: bool = True) -> dict[str, tuple[paddle.Tensor, paddle.Tensor]]:
    """{diagnostic: (decode(tau(z)), tau(x))} for the two equivariance PSNRs, one decode each; the scale one only if
    `scale` (not for a decoder of one input grid and output size: RAE's). The scale one's tau halves the latent
    (sides >= 1) and the images alike (H / h per axis: the decoder's factor)."""
    pairs, rotation = {}, Transform("rotate", quarter_turns=1)
    (h, w), (height, width) = latents.shape[2:], images.shape[2:]
    half = max(1, h // 2), max(1, w // 2)
    with paddle.amp.auto_cast(enable=False):  # the targets in float32, as the plain metrics' images
        target = resize(images, (half[0] * (height // h), half[1] * (width // w))) if scale else None
        rotated = rotation(images, (h, w), (height, width))
    if scale:
        pairs["scale_equivariance_psnr"] = (decode(resize(latents, half)), target)
    pairs["rotation_equivariance_psnr"] = (decode(rotation(latents, (h, w), (height, width))), rotated)
    return pairs


def spectrum_energies(latents: paddle.Tensor) -> tuple[float, float]:
    """(energy above half Nyquist, all energy) of [B, C, h, w] latents, each channel's mean removed."""
    z = latents.astype("float32")
    z = z - z.mean(axis=[2, 3], keepdim=True)
    power = paddle.abs(paddle.fft.fft2(z)) ** 2
    fy, fx = np.fft.fftfreq(z.shape[2])[:, None], np.fft.fftfreq(z.shape[3])[None, :]
    mask = paddle.to_tensor((np.sqrt(fx**2 + fy**2) > HALF_NYQUIST).astype(np.float32))
    return float((power * mask).sum()), float(power.sum())


def high_frequency_share(energies: tuple[float, float] | np.ndarray) -> float:
    """`latent_high_frequency_share` of `spectrum_energies` (summed over batches): 0 for constant latents."""
    high, total = energies
    return float(high / total) if total > 0 else 0.0
