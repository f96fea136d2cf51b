"""Reconstruction metric math: PSNR, SSIM, the Frechet distance, and streaming accumulators.

Numbers only (paddle tensors in, tensors or floats out); evaluation.py runs the VAE and states the protocol.
PSNR and SSIM are on [0, 1] images with data range 1, the field's convention (`to_unit_range` maps the model's
[-1, 1] first; docs/measuring.md says why it matters for SSIM). The accumulators keep sums, never means, so
uneven batches and shards combine exactly; their `compute()` sums over ranks, so every rank must call it
having fed the same metric names.
"""

from __future__ import annotations

import logging

import numpy as np
import paddle
import paddle.nn.functional as F
from scipy import linalg

from .distributed import sum_over_ranks

logger = logging.getLogger(__name__)

# The metrics an evaluation reports, and which way is better (--metric_for_best_model).
HIGHER_IS_BETTER = {"psnr": True, "ssim": True, "lpips": False, "rfid": False,
                    "scale_equivariance_psnr": True, "rotation_equivariance_psnr": True,  # latent_diagnostics.py
                    "latent_high_frequency_share": False, "vf_alignment_cka": True}  # alignment.py

SSIM_WINDOW_SIZE = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def to_unit_range(images: paddle.Tensor) -> paddle.Tensor:
    """[-1, 1] model images -> [0, 1] float32, the range PSNR and SSIM are reported on."""
    return (images.astype("float32") + 1.0) / 2.0


def psnr(x: paddle.Tensor, y: paddle.Tensor, data_range: float = 1.0) -> paddle.Tensor:
    """PSNR per image in dB, shape [B]: 10 log10(data_range^2 / MSE), as scikit-image's peak_signal_noise_ratio.
    Callers clamp reconstructions first; identical images give +inf."""
    squared_error = (x.astype("float32") - y.astype("float32")) ** 2
    mse = squared_error.reshape([squared_error.shape[0], -1]).mean(axis=1)
    return 10.0 * paddle.log10(data_range**2 / mse)


def _gaussian_blur(images: paddle.Tensor, window_1d: np.ndarray) -> paddle.Tensor:
    """Separable depthwise Gaussian filter over H and W of NCHW, 'valid' mode (no padding)."""
    channels, size = images.shape[1], window_1d.shape[0]
    kernel = paddle.to_tensor(window_1d.astype(np.float32))
    horizontal = kernel.reshape([1, 1, 1, size]).tile([channels, 1, 1, 1])
    vertical = kernel.reshape([1, 1, size, 1]).tile([channels, 1, 1, 1])
    return F.conv2d(F.conv2d(images, horizontal, groups=channels), vertical, groups=channels)


def ssim(x: paddle.Tensor, y: paddle.Tensor, data_range: float = 1.0) -> paddle.Tensor:
    """SSIM per image, shape [B], averaged over channels, of NCHW images of at least 11 px. Equals scikit-image's
    structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range): its
    cropped border leaves exactly the pixels whose window lies inside the image, a 'valid' convolution."""
    x, y = x.astype("float32"), y.astype("float32")
    if min(x.shape[-2:]) < SSIM_WINDOW_SIZE:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW_SIZE} px, got {x.shape}")
    offsets = np.arange(SSIM_WINDOW_SIZE, dtype=np.float64) - (SSIM_WINDOW_SIZE - 1) / 2.0
    window = np.exp(-0.5 * (offsets / SSIM_SIGMA) ** 2)
    window /= window.sum()
    mean_x, mean_y = _gaussian_blur(x, window), _gaussian_blur(y, window)
    var_x = _gaussian_blur(x * x, window) - mean_x**2
    var_y = _gaussian_blur(y * y, window) - mean_y**2
    cov_xy = _gaussian_blur(x * y, window) - mean_x * mean_y
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    ssim_map = ((2 * mean_x * mean_y + c1) * (2 * cov_xy + c2)) / ((mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2))
    return ssim_map.reshape([ssim_map.shape[0], -1]).mean(axis=1)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """|mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 sqrt(sigma1 sigma2)), as pytorch-fid computes it: `eps` on the
    diagonals when the product is singular, a negligible imaginary part dropped, a large one an error."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError("mean vectors and covariances of the two sets must have the same shapes")
    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        logger.warning("fid: singular product of covariances; adding %s to the diagonals", eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"imaginary component {np.max(np.abs(covmean.imag))} in sqrtm")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def all_reduce_sum(array: np.ndarray) -> np.ndarray:
    """A float64 array summed over ranks (a collective); unchanged in a single process."""
    return sum_over_ranks(paddle.to_tensor(np.asarray(array, dtype=np.float64))).numpy()


def _to_numpy64(values: paddle.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(values, paddle.Tensor):
        values = values.detach().astype("float64").numpy()
    return np.asarray(values, dtype=np.float64)


class MetricAccumulator:
    """Streaming means of per-sample metrics (sum and count per name)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def update(self, name: str, per_sample_values: paddle.Tensor | np.ndarray) -> None:
        """Add one batch of per-sample values (every element is one sample)."""
        values = _to_numpy64(per_sample_values).reshape(-1)
        self._sums[name] = self._sums.get(name, 0.0) + float(values.sum())
        self._counts[name] = self._counts.get(name, 0) + values.size

    def compute(self) -> dict[str, float]:
        """Mean of each metric over everything seen, on all ranks together."""
        names = sorted(self._sums)  # the same order on every rank, so one all-reduce lines up
        packed = all_reduce_sum(np.array([[self._sums[n], self._counts[n]] for n in names]).reshape(-1, 2))
        return {name: float(total / count) for name, (total, count) in zip(names, packed)}


class FeatureStatistics:
    """Running mean and covariance of feature vectors (e.g. 2048-d Inception pool features), as float64 sums."""

    def __init__(self) -> None:
        self._count, self._sum, self._outer_sum = 0, None, None

    def update(self, features: paddle.Tensor | np.ndarray) -> None:
        """Add a batch of features, shape [B, D]."""
        batch = _to_numpy64(features)
        batch = batch.reshape(batch.shape[0], -1)
        if self._sum is None:
            self._sum, self._outer_sum = np.zeros(batch.shape[1]), np.zeros((batch.shape[1], batch.shape[1]))
        if batch.shape[1] != self._sum.shape[0]:
            raise ValueError(f"expected {self._sum.shape[0]} features, got {batch.shape[1]}")
        self._count += batch.shape[0]
        self._sum += batch.sum(axis=0)
        self._outer_sum += batch.T @ batch

    def compute(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) over all ranks; sigma is the unbiased covariance, as `np.cov` gives."""
        if self._sum is None:
            raise ValueError("FeatureStatistics has seen no features")
        count = all_reduce_sum(np.array([self._count]))[0]
        total, outer_total = all_reduce_sum(self._sum), all_reduce_sum(self._outer_sum)
        if count < 2:
            raise ValueError(f"need at least 2 feature vectors for a covariance, got {int(count)}")
        mu = total / count
        return mu, (outer_total - count * np.outer(mu, mu)) / (count - 1)


class LatentStatistics:
    """Per-channel mean and std of latents [B, C, h, w] over a whole set. Given the posterior variances with the
    means, those of posterior samples, exactly in expectation (E[z^2] = mean^2 + variance).

    `suggested_factors()` = (scaling_factor, shift_factor) = (1 / std, mean) over all channels and positions,
    for z_model = (z - shift_factor) * scaling_factor (FLUX-style; SD uses the scale alone, shift 0).
    """

    def __init__(self) -> None:
        self._count = 0  # elements per channel
        self._sum: np.ndarray | None = None
        self._squared_sum: np.ndarray | None = None

    def update(self, latents: paddle.Tensor | np.ndarray, variances: paddle.Tensor | np.ndarray | None = None) -> None:
        """Add a batch of latents [B, C, h, w] (posterior means when `variances` are given)."""
        per_channel = np.moveaxis(_to_numpy64(latents), 1, 0).reshape(latents.shape[1], -1)
        if self._sum is None:
            self._sum, self._squared_sum = np.zeros(per_channel.shape[0]), np.zeros(per_channel.shape[0])
        self._count += per_channel.shape[1]
        self._sum += per_channel.sum(axis=1)
        self._squared_sum += (per_channel**2).sum(axis=1)
        if variances is not None:
            self._squared_sum += _to_numpy64(variances).sum(axis=(0, 2, 3))

    def _reduced(self) -> tuple[float, np.ndarray, np.ndarray]:
        if self._sum is None:
            raise ValueError("LatentStatistics has seen no latents")
        count = all_reduce_sum(np.array([self._count]))[0]
        return count, all_reduce_sum(self._sum), all_reduce_sum(self._squared_sum)

    def compute(self) -> tuple[np.ndarray, np.ndarray]:
        """(per-channel mean, per-channel population std) over all ranks."""
        count, total, squared_total = self._reduced()
        mean = total / count
        return mean, np.sqrt(np.maximum(squared_total / count - mean**2, 0.0))

    def suggested_factors(self) -> tuple[float, float]:
        """(scaling_factor, shift_factor) = (1 / std, mean) over all channels together."""
        count, total, squared_total = self._reduced()
        elements = count * total.shape[0]
        mean = total.sum() / elements
        std = np.sqrt(max(squared_total.sum() / elements - mean**2, 0.0))
        return float(1.0 / std), float(mean)
