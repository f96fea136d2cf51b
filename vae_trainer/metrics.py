"""Metric math: PSNR (of the alpha channel too, its MSE floored) and SSIM (on [0, 1] images, data range 1; of RGBA
images over all four channels), the Frechet distance and streaming accumulators (an objective's own metrics are its
part's: flicker in objectives/clips.py, the latent diagnostics in objectives/equivariance.py). These keep sums, never
means, all in one MetricAccumulator whose `reduce()` sums them over ranks (a collective: every rank calls it, having
fed the same names)."""

import logging

import numpy as np
import paddle
import paddle.nn.functional as F
from scipy import linalg, signal

from .distributed import sum_over_ranks

logger = logging.getLogger(__name__)

# The metrics an evaluation reports, and which way is better (--metric_for_best_model).
HIGHER_IS_BETTER = {"psnr": True, "ssim": True, "lpips": False, "rfid": False, "alpha_psnr": True,
                    "scale_equivariance_psnr": True, "rotation_equivariance_psnr": True,
                    "latent_high_frequency_share": False, "vf_alignment_cka": True, "flicker": False,  # alignment.py
                    "psnr_vs_teacher": True, "ssim_vs_teacher": True, "lpips_vs_teacher": False, "latent_mse": False}

SSIM_WINDOW_SIZE, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03
# alpha_psnr's floor of the MSE (a ceiling of 100 dB): exact alpha is common (an opaque image decoded opaque, the
# decode clamped to 1), and one image's +inf would make the mean over images +inf.
ALPHA_MSE_FLOOR = 1e-10


def to_unit_range(images: paddle.Tensor) -> paddle.Tensor:
    """[-1, 1] model images -> [0, 1] float32, the range PSNR and SSIM are reported on."""
    return (images.astype("float32") + 1.0) / 2.0


def psnr(x: paddle.Tensor, y: paddle.Tensor, mse_floor: float | None = None) -> paddle.Tensor:
    """PSNR in dB per [0, 1] image, shape [B]: scikit-image's peak_signal_noise_ratio; identical images give +inf,
    unless the MSE is floored at `mse_floor`."""
    mse = ((x.astype("float32") - y.astype("float32")) ** 2).flatten(1).mean(axis=1)
    return 10.0 * paddle.log10(1.0 / (mse if mse_floor is None else paddle.clip(mse, min=mse_floor)))


def fold_frames(clips: paddle.Tensor) -> paddle.Tensor:
    """[B, C, T, H, W] clips -> [B*T, C, H, W] frames, clip-major (frame t of clip b at b*T + t); images as they are."""
    if clips.ndim == 4:
        return clips
    return clips.transpose([0, 2, 1, 3, 4]).flatten(0, 1)


def ssim(x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    """SSIM per [0, 1] NCHW image, shape [B], averaged over channels: scikit-image's structural_similarity(
    gaussian_weights=True, use_sample_covariance=False, data_range=1), whose cropped border is a 'valid' convolution."""
    x, y = x.astype("float32"), y.astype("float32")
    if min(x.shape[-2:]) < SSIM_WINDOW_SIZE:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW_SIZE} px, got {x.shape}")
    window = signal.windows.gaussian(SSIM_WINDOW_SIZE, SSIM_SIGMA)  # exp(-n^2 / (2 sigma^2)), n from the centre
    kernel = paddle.to_tensor((window / window.sum()).astype(np.float32)).tile([x.shape[1], 1, 1, 1])  # [C, 1, 1, K]

    def blur(images: paddle.Tensor) -> paddle.Tensor:  # separable depthwise Gaussian over H and W, 'valid' (no padding)
        horizontal = F.conv2d(images, kernel, groups=x.shape[1])
        return F.conv2d(horizontal, kernel.transpose([0, 1, 3, 2]), groups=x.shape[1])

    mean_x, mean_y = blur(x), blur(y)
    var_x = blur(x * x) - mean_x**2
    var_y = blur(y * y) - mean_y**2
    cov_xy = blur(x * y) - mean_x * mean_y
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    ssim_map = ((2 * mean_x * mean_y + c1) * (2 * cov_xy + c2)) / ((mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2))
    return ssim_map.reshape([ssim_map.shape[0], -1]).mean(axis=1)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """|mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 sqrt(sigma1 sigma2)), as pytorch-fid computes it: `eps` on the
    diagonals when the product is singular, a negligible imaginary part dropped, a large one an error."""
    diff, covmean = mu1 - mu2, linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        logger.warning("fid: singular product of covariances; adding %s to the diagonals", eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"imaginary component {np.max(np.abs(covmean.imag))} in sqrtm")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def _to_numpy64(values: paddle.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(values.astype("float64").numpy() if isinstance(values, paddle.Tensor) else values, np.float64)


class MetricAccumulator:
    """Float64 sums by name over a whole set (each a number or an array, its shape from the first batch): the sum and
    count of each per-sample metric (`update`) and any other sum (`add`: the moments below, a CKA's, a pass's), all
    summed over ranks in one collective (`reduce`)."""

    def __init__(self) -> None:
        self.totals: dict[str, np.ndarray] = {}  # name: its sum (a metric's: [sum, count])
        self.metrics: set[str] = set()  # the names `update` fed, whose means `means` gives

    def add(self, name: str, value: paddle.Tensor | np.ndarray | float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + _to_numpy64(value)

    def update(self, name: str, per_sample_values: paddle.Tensor | np.ndarray) -> None:
        """Add one batch of per-sample values (every element is one sample)."""
        values = _to_numpy64(per_sample_values).reshape(-1)
        self.metrics.add(name)
        self.add(name, np.array([values.sum(), values.size]))

    def reduce(self) -> dict[str, np.ndarray]:
        """Every sum over all ranks, by name: a collective (every rank calls it, having added the same names)."""
        names = sorted(self.totals)  # the same order on every rank, so one all-reduce lines up
        flat = np.concatenate([np.ravel(self.totals[name]) for name in names])
        flat = sum_over_ranks(paddle.to_tensor(flat)).numpy()
        parts = np.split(flat, np.cumsum([np.size(self.totals[name]) for name in names])[:-1])
        return {name: part.reshape(np.shape(self.totals[name])) for name, part in zip(names, parts)}

    def means(self, sums: dict[str, np.ndarray]) -> dict[str, float]:
        """Mean of each metric over everything seen, of `sums` (`reduce`'s: all ranks together)."""
        return {name: float(sums[name][0] / sums[name][1]) for name in sorted(self.metrics)}


def add_features(sums: MetricAccumulator, name: str, features: paddle.Tensor | np.ndarray) -> None:
    """Add a batch of feature vectors [B, D] (e.g. 2048-d Inception pool features) to `name`'s count, sum and sum of
    outer products, whose mean and covariance `feature_statistics` gives."""
    batch = _to_numpy64(features).reshape(features.shape[0], -1)
    sums.add(f"{name}.count", batch.shape[0])
    sums.add(f"{name}.sum", batch.sum(axis=0))
    sums.add(f"{name}.second", batch.T @ batch)


def feature_statistics(sums: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of `name`'s features in `sums` (reduced over ranks); sigma is the unbiased covariance, as `np.cov`
    gives."""
    count, total, outer_total = (sums[f"{name}.{part}"] for part in ("count", "sum", "second"))
    if count < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {int(count)}")
    mu = total / count
    return mu, (outer_total - count * np.outer(mu, mu)) / (count - 1)


def add_latents(sums: MetricAccumulator, name: str, latents: paddle.Tensor | np.ndarray,
                variances: paddle.Tensor | np.ndarray | None = None) -> None:
    """Add a batch of latents [B, C, h, w] or [B, C, t, h, w] (posterior means when `variances` are given) to
    `name`'s per-channel count, sum and sum of second moments, whose statistics `latent_statistics` gives."""
    per_channel = np.moveaxis(_to_numpy64(latents), 1, 0).reshape(latents.shape[1], -1)
    sums.add(f"{name}.count", per_channel.shape[1])
    sums.add(f"{name}.sum", per_channel.sum(axis=1))
    sums.add(f"{name}.second", (per_channel**2).sum(axis=1))
    if variances is not None:
        sums.add(f"{name}.second", np.moveaxis(_to_numpy64(variances), 1, 0).reshape(latents.shape[1], -1).sum(axis=1))


def latent_statistics(sums: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Per-channel mean and std of `name`'s latents over a whole set, of `sums` (reduced over ranks); given the
    posterior variances with the means, those of posterior samples, exactly in expectation (E[z^2] = mean^2 + var):
    (per-channel mean, per-channel population std), and the suggested (scaling_factor, shift_factor) = (1 / std, mean)
    over all channels together, for z_model = (z - shift_factor) * scaling_factor (FLUX-style; SD uses the scale
    alone)."""
    count, total, squared_total = (sums[f"{name}.{part}"] for part in ("count", "sum", "second"))
    mean, elements = total / count, count * total.shape[0]
    overall = total.sum() / elements
    scaling_factor = float(1.0 / np.sqrt(max(squared_total.sum() / elements - overall**2, 0.0)))  # 1 / std
    return mean, np.sqrt(np.maximum(squared_total / count - mean**2, 0.0)), scaling_factor, float(overall)
