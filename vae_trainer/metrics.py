"""Reconstruction metric math: PSNR, SSIM, the Frechet distance, and streaming accumulators.

This module owns the numbers only (paddle tensors in, tensors or floats out). Running a VAE over a
dataset, the evaluation protocol and deciding which metrics to report live in ``vae_trainer.evaluation``.

PSNR and SSIM follow the field's convention (scikit-image, BasicSR, published VAE tables): images in
[0, 1] with data range 1. The model works in [-1, 1]; ``to_unit_range`` maps its images first. PSNR
is the same number in either range (it depends on the error relative to the range), SSIM is not: its
constants K1, K2 are fixed fractions of the range and its luminance term depends on the absolute mean:
a low-contrast mid-grey image reconstructed 0.15 too bright scores above 0.9 on [0, 1] and below 0.2 on
[-1, 1] (tests/test_metrics.py).

The accumulators keep sums (never means) so that uneven batches and uneven shards across ranks
combine exactly; ``compute()`` all-reduces the sums when ``paddle.distributed`` is initialised with
more than one process. Every rank must call ``compute()`` (it is a collective) and must have fed the
same metric names.
"""

from __future__ import annotations

import logging

import numpy as np
import paddle
import paddle.nn.functional as F
from scipy import linalg

logger = logging.getLogger(__name__)

# The metrics an evaluation reports, and which way is better (--metric_for_best_model).
HIGHER_IS_BETTER = {"psnr": True, "ssim": True, "lpips": False, "rfid": False,
                    # the latent diagnostics (latent_diagnostics.py)
                    "scale_equivariance_psnr": True, "rotation_equivariance_psnr": True,
                    "latent_high_frequency_share": False,
                    "vf_alignment_cka": True}  # alignment.py

SSIM_WINDOW_SIZE = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def to_unit_range(images: paddle.Tensor) -> paddle.Tensor:
    """[-1, 1] model images -> [0, 1] float32, the range PSNR and SSIM are reported on."""
    return (images.astype("float32") + 1.0) / 2.0


def psnr(x: paddle.Tensor, y: paddle.Tensor, data_range: float = 1.0) -> paddle.Tensor:
    """Peak signal-to-noise ratio per image, in dB, shape [B]: 10 log10(data_range^2 / MSE).

    ``x`` and ``y`` are NCHW images in [0, 1] (hence ``data_range=1``); equals scikit-image's
    ``peak_signal_noise_ratio(a, b, data_range=1)`` per image. Clamping a reconstruction before
    calling is the caller's job: an unclamped decoder output would otherwise be scored on values no
    saved image can hold. Identical images give +inf.
    """
    squared_error = (x.astype("float32") - y.astype("float32")) ** 2
    mse = squared_error.reshape([squared_error.shape[0], -1]).mean(axis=1)
    return 10.0 * paddle.log10(data_range**2 / mse)


def _gaussian_window_1d(size: int, sigma: float) -> np.ndarray:
    offsets = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    weights = np.exp(-0.5 * (offsets / sigma) ** 2)
    return weights / weights.sum()


def _depthwise_gaussian_blur(images: paddle.Tensor, window_1d: np.ndarray) -> paddle.Tensor:
    """Separable Gaussian filter over H and W of NCHW, 'valid' mode (no padding)."""
    channels = images.shape[1]
    size = window_1d.shape[0]
    kernel = paddle.to_tensor(window_1d.astype(np.float32))
    horizontal = kernel.reshape([1, 1, 1, size]).tile([channels, 1, 1, 1])
    vertical = kernel.reshape([1, 1, size, 1]).tile([channels, 1, 1, 1])
    blurred = F.conv2d(images, horizontal, groups=channels)
    return F.conv2d(blurred, vertical, groups=channels)


def ssim(x: paddle.Tensor, y: paddle.Tensor, data_range: float = 1.0) -> paddle.Tensor:
    """Structural similarity per image, shape [B], averaged over channels, of NCHW images in [0, 1].

    Matches ``skimage.metrics.structural_similarity(a, b, gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=data_range, channel_axis=-1)``: 11x11 Gaussian window,
    K1=0.01, K2=0.03. scikit-image filters the whole image and then drops a border of
    (11 - 1) // 2 pixels before averaging; the remaining pixels are exactly those whose window lies
    inside the image, so a 'valid' convolution gives the same map without any padding choice.
    Images must be at least 11 pixels on each side.
    """
    x = x.astype("float32")
    y = y.astype("float32")
    if min(x.shape[-2:]) < SSIM_WINDOW_SIZE:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW_SIZE} px, got {x.shape}")
    window = _gaussian_window_1d(SSIM_WINDOW_SIZE, SSIM_SIGMA)
    mean_x = _depthwise_gaussian_blur(x, window)
    mean_y = _depthwise_gaussian_blur(y, window)
    var_x = _depthwise_gaussian_blur(x * x, window) - mean_x**2
    var_y = _depthwise_gaussian_blur(y * y, window) - mean_y**2
    cov_xy = _depthwise_gaussian_blur(x * y, window) - mean_x * mean_y
    c1 = (SSIM_K1 * data_range) ** 2
    c2 = (SSIM_K2 * data_range) ** 2
    ssim_map = ((2 * mean_x * mean_y + c1) * (2 * cov_xy + c2)) / (
        (mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2)
    )
    return ssim_map.reshape([ssim_map.shape[0], -1]).mean(axis=1)


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6
) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), computed as pytorch-fid does.

    d^2 = |mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 sqrt(sigma1 sigma2)). When the product is singular
    (fewer samples than feature dimensions) ``eps`` is added to both diagonals; a square root with a
    significant imaginary part is an error, a tiny one is numerical noise and is dropped.
    """
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError("mean vectors and covariances of the two sets must have the same shapes")
    diff = mu1 - mu2
    # No ``disp=False``: deprecated in SciPy 1.16; the default call returns the root alone everywhere.
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


def _is_distributed() -> bool:
    return paddle.distributed.is_initialized() and paddle.distributed.get_world_size() > 1


def all_reduce_sum(array: np.ndarray) -> np.ndarray:
    """Sum a float64 array over ranks (a collective); a no-op in a single process."""
    if not _is_distributed():
        return array
    tensor = paddle.to_tensor(array)
    paddle.distributed.all_reduce(tensor)
    return tensor.numpy()


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
        """Add one batch of per-sample values (any shape; every element is one sample)."""
        values = _to_numpy64(per_sample_values).reshape(-1)
        self._sums[name] = self._sums.get(name, 0.0) + float(values.sum())
        self._counts[name] = self._counts.get(name, 0) + values.size

    def compute(self) -> dict[str, float]:
        """Mean of each metric over everything seen, on all ranks together."""
        names = sorted(self._sums)  # the same order on every rank, so one all-reduce lines up
        packed = np.array([[self._sums[n], self._counts[n]] for n in names], dtype=np.float64)
        packed = all_reduce_sum(packed.reshape(-1, 2))
        return {name: float(total / count) for name, (total, count) in zip(names, packed)}


class FeatureStatistics:
    """Running mean and covariance of feature vectors (e.g. 2048-d Inception pool features).

    Keeps the sum and the sum of outer products in float64, which is exact enough for FID and lets
    shards of any size be merged by summation.
    """

    def __init__(self, num_features: int | None = None) -> None:
        """``num_features`` None: taken from the first batch (2048 for FIDInceptionV3)."""
        self.num_features = num_features
        self._count = 0
        self._sum: np.ndarray | None = None
        self._outer_sum: np.ndarray | None = None

    def update(self, features: paddle.Tensor | np.ndarray) -> None:
        """Add a batch of features, shape [B, num_features]."""
        batch = _to_numpy64(features)
        batch = batch.reshape(batch.shape[0], -1)
        if self._sum is None:
            self.num_features = self.num_features or batch.shape[1]
            self._sum = np.zeros(self.num_features, dtype=np.float64)
            self._outer_sum = np.zeros((self.num_features, self.num_features), dtype=np.float64)
        if batch.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {batch.shape[1]}")
        self._count += batch.shape[0]
        self._sum += batch.sum(axis=0)
        self._outer_sum += batch.T @ batch

    def compute(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) over all ranks; sigma is the unbiased covariance, as ``np.cov`` gives."""
        if self._sum is None:
            raise ValueError("FeatureStatistics has seen no features")
        count = all_reduce_sum(np.array([self._count], dtype=np.float64))[0]
        total = all_reduce_sum(self._sum)
        outer_total = all_reduce_sum(self._outer_sum)
        if count < 2:
            raise ValueError(f"need at least 2 feature vectors for a covariance, got {int(count)}")
        mu = total / count
        sigma = (outer_total - count * np.outer(mu, mu)) / (count - 1)
        return mu, sigma


def _per_channel(values: paddle.Tensor | np.ndarray) -> np.ndarray:
    """[B, C, h, w] -> [C, B*h*w] float64."""
    values = _to_numpy64(values)
    return np.moveaxis(values, 1, 0).reshape(values.shape[1], -1)


class LatentStatistics:
    """Per-channel mean and standard deviation of latents [B, C, h, w] over a whole set.

    ``suggested_factors()`` returns ``(scaling_factor, shift_factor)`` for the convention
    ``z_model = (z - shift_factor) * scaling_factor`` (diffusers/ppdiffusers: FLUX-style VAEs set
    both; Stable Diffusion sets only ``scaling_factor`` and uses ``z * scaling_factor``, i.e.
    shift 0). ``scaling_factor = 1 / global std`` and ``shift_factor = global mean``, both over all
    channels and positions. The shift is reported even for SD-style use so that a far-from-zero
    latent mean is visible.

    Given the posterior variances with the means (``update(means, variances)``), the statistics are
    those of posterior samples z ~ N(mean, variance), exactly in expectation: E[z^2] = mean^2 + variance,
    so per channel Var[z] = variance of the means + mean of the variances, without sampling noise.
    """

    def __init__(self) -> None:
        self._count = 0  # elements per channel
        self._sum: np.ndarray | None = None
        self._squared_sum: np.ndarray | None = None

    def update(self, latents: paddle.Tensor | np.ndarray, variances: paddle.Tensor | np.ndarray | None = None) -> None:
        """Add a batch of latents, shape [B, C, h, w] (posterior means when ``variances`` are given)."""
        per_channel = _per_channel(latents)
        if self._sum is None:
            self._sum = np.zeros(per_channel.shape[0])
            self._squared_sum = np.zeros(per_channel.shape[0])
        self._count += per_channel.shape[1]
        self._sum += per_channel.sum(axis=1)
        self._squared_sum += (per_channel**2).sum(axis=1)
        if variances is not None:
            self._squared_sum += _per_channel(variances).sum(axis=1)

    def _reduced(self) -> tuple[float, np.ndarray, np.ndarray]:
        if self._sum is None:
            raise ValueError("LatentStatistics has seen no latents")
        count = all_reduce_sum(np.array([self._count], dtype=np.float64))[0]
        return count, all_reduce_sum(self._sum), all_reduce_sum(self._squared_sum)

    def compute(self) -> tuple[np.ndarray, np.ndarray]:
        """(per-channel mean, per-channel population std) over all ranks."""
        count, total, squared_total = self._reduced()
        mean = total / count
        variance = np.maximum(squared_total / count - mean**2, 0.0)
        return mean, np.sqrt(variance)

    def suggested_factors(self) -> tuple[float, float]:
        """(scaling_factor, shift_factor) = (1 / std, mean) over all channels together."""
        count, total, squared_total = self._reduced()
        elements = count * total.shape[0]
        mean = total.sum() / elements
        std = np.sqrt(max(squared_total.sum() / elements - mean**2, 0.0))
        return float(1.0 / std), float(mean)
