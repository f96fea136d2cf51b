"""Metric math against scikit-image, SciPy/NumPy closed forms, and numpy over the whole set."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import paddle
import pytest
from PIL import Image
from skimage import data as skimage_data
from skimage.filters import gaussian
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from skimage.transform import resize

from vae_trainer.metrics import (MetricAccumulator, add_features, add_latents, feature_statistics, frechet_distance,
                                 latent_statistics, psnr, ssim, to_unit_range)

REPO_ROOT = Path(__file__).resolve().parents[1]
paddle.set_device("cpu")


def _photo(name: str, height: int, width: int) -> np.ndarray:
    """A real photo as float64 HWC in [0, 1]."""
    return resize(getattr(skimage_data, name)(), (height, width), anti_aliasing=True)


def _jpeg(image: np.ndarray, quality: int = 15) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(np.round(image * 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    return np.asarray(Image.open(buffer), dtype=np.float64) / 255.0


def _distortions(image: np.ndarray) -> list[np.ndarray]:
    noise = np.random.default_rng(0).normal(0.0, 0.08, image.shape)
    return [
        np.clip(image + noise, 0.0, 1.0),
        gaussian(image, sigma=1.2, channel_axis=-1),
        _jpeg(image),
    ]


def _pairs(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(clean, distorted) stacks in [0, 1], HWC float64, three photos x three distortions."""
    clean, distorted = [], []
    for name in ("astronaut", "coffee", "chelsea"):
        photo = _photo(name, height, width)
        for changed in _distortions(photo):
            clean.append(photo)
            distorted.append(changed)
    return np.stack(clean), np.stack(distorted)


def _as_nchw_tensor(images: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(images.transpose(0, 3, 1, 2).astype(np.float32))


def _skimage_ssim(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    return structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                                 data_range=data_range, channel_axis=-1)


@pytest.mark.parametrize("height,width", [(64, 64), (45, 37)])
def test_psnr_and_ssim_on_unit_range_images_agree_with_scikit_image(height, width):
    """The defaults are the field's convention: [0, 1] images, data range 1."""
    clean, distorted = _pairs(height, width)
    expected_psnr = [peak_signal_noise_ratio(a, b, data_range=1.0) for a, b in zip(clean, distorted)]
    expected_ssim = [_skimage_ssim(a, b) for a, b in zip(clean, distorted)]
    got_psnr = psnr(_as_nchw_tensor(clean), _as_nchw_tensor(distorted)).numpy()
    got_ssim = ssim(_as_nchw_tensor(clean), _as_nchw_tensor(distorted)).numpy()

    # The distortions must span a real range, or agreement would say little.
    assert np.ptp(expected_ssim) > 0.2 and np.ptp(expected_psnr) > 3
    np.testing.assert_allclose(got_psnr, expected_psnr, atol=1e-3)
    np.testing.assert_allclose(got_ssim, expected_ssim, atol=1e-3)


def mid_grey_pair(size: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """A low-contrast mid-grey photo in [0, 1] (HWC) and its reconstruction 0.15 too bright."""
    grey = resize(skimage_data.camera(), (size, size), anti_aliasing=True)
    image = np.clip(0.5 + 0.1 * (grey - grey.mean()) / grey.std(), 0, 1)
    image = np.repeat(image[..., None], 3, axis=-1)
    return image, np.clip(image + 0.15, 0, 1)


def test_the_two_conventions_differ_a_lot_on_a_mid_grey_image():
    """What the [0, 1] convention is for: SSIM is not shift-invariant, so [-1, 1] scores this near 0."""
    image, brighter = mid_grey_pair()
    unit = _skimage_ssim(image, brighter)
    symmetric = _skimage_ssim(2 * image - 1, 2 * brighter - 1, data_range=2.0)
    assert unit > 0.9 and symmetric < 0.2
    got = ssim(_as_nchw_tensor(image[None]), _as_nchw_tensor(brighter[None])).item()
    assert got == pytest.approx(unit, abs=1e-3)
    assert to_unit_range(paddle.to_tensor([-1.0, 0.0, 1.0])).numpy().tolist() == [0.0, 0.5, 1.0]


def test_ssim_of_identical_images_is_one_and_psnr_infinite():
    clean, _ = _pairs(32, 32)
    x = _as_nchw_tensor(clean[:2])
    # A full array, not the scalar 1.0: ppdiffusers sets ``np.bool = bool`` on import, which breaks
    # numpy's scalar-broadcast branch of assert_allclose.
    np.testing.assert_allclose(ssim(x, x).numpy(), np.ones(2), atol=1e-6)
    assert np.isinf(psnr(x, x).numpy()).all()


def test_frechet_distance_one_dimensional_closed_form():
    # For 1-D Gaussians d = (m1 - m2)^2 + (s1 - s2)^2.
    got = frechet_distance(np.array([1.5]), np.array([[4.0]]), np.array([-0.5]), np.array([[0.25]]))
    assert got == pytest.approx((1.5 + 0.5) ** 2 + (2.0 - 0.5) ** 2, abs=1e-9)


def test_frechet_distance_diagonal_closed_form():
    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    var1, var2 = rng.uniform(0.1, 3.0, 6), rng.uniform(0.1, 3.0, 6)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    got = frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2))
    assert got == pytest.approx(expected, rel=1e-9)


def _symmetric_sqrt(matrix: np.ndarray) -> np.ndarray:
    eigenvalues, eigenvectors = np.linalg.eigh(matrix)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0, None))) @ eigenvectors.T


def _trace_formula(mu1, sigma1, mu2, sigma2) -> float:
    """|mu1-mu2|^2 + Tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), via symmetric eigendecompositions."""
    root1 = _symmetric_sqrt(sigma1)
    cross = _symmetric_sqrt(root1 @ sigma2 @ root1)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(sigma1 + sigma2 - 2 * cross))


def test_frechet_distance_full_covariances_match_the_trace_formula():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(200, 12)), rng.normal(size=(200, 12)) @ rng.normal(size=(12, 12))
    mu1, sigma1 = a.mean(0), np.cov(a, rowvar=False)
    mu2, sigma2 = b.mean(0) + 0.3, np.cov(b, rowvar=False)
    expected = _trace_formula(mu1, sigma1, mu2, sigma2)
    assert frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-7)
    assert frechet_distance(mu1, sigma1, mu1, sigma1) == pytest.approx(0.0, abs=1e-6)


def test_frechet_distance_with_fewer_samples_than_dimensions_stays_finite_and_close():
    # Rank-deficient covariances, as rFID on a small set gives: sqrtm's product is singular.
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(5, 20)), rng.normal(size=(5, 20)) * 2
    mu1, sigma1, mu2, sigma2 = a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)
    got = frechet_distance(mu1, sigma1, mu2, sigma2)
    assert np.isfinite(got)
    assert got == pytest.approx(_trace_formula(mu1, sigma1, mu2, sigma2), rel=1e-3)


def _uneven_batches(values: np.ndarray, sizes=(3, 1, 5, 2)) -> list[np.ndarray]:
    return np.split(values, np.cumsum(sizes)[:-1])


def test_metric_accumulator_equals_the_mean_over_the_whole_set():
    rng = np.random.default_rng(4)
    psnr_values, ssim_values = rng.normal(30, 3, 11), rng.uniform(0, 1, 11)
    accumulator = MetricAccumulator()
    for psnr_batch, ssim_batch in zip(_uneven_batches(psnr_values), _uneven_batches(ssim_values)):
        accumulator.update("psnr", paddle.to_tensor(psnr_batch.astype(np.float32)))
        accumulator.update("ssim", ssim_batch)
    means = accumulator.means(accumulator.reduce())
    assert means["psnr"] == pytest.approx(psnr_values.mean(), rel=1e-6)
    assert means["ssim"] == pytest.approx(ssim_values.mean(), rel=1e-12)


def test_feature_statistics_equal_numpy_mean_and_covariance():
    rng = np.random.default_rng(5)
    features = rng.normal(size=(11, 16)) @ rng.normal(size=(16, 16)) + 5.0
    statistics = MetricAccumulator()  # the dimension comes from the first batch
    for batch in _uneven_batches(features):
        add_features(statistics, "features", batch)
    mu, sigma = feature_statistics(statistics.reduce(), "features")
    np.testing.assert_allclose(mu, features.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(features, rowvar=False), rtol=1e-9, atol=1e-10)


def test_latent_statistics_equal_numpy_over_the_set():
    rng = np.random.default_rng(6)
    offsets = np.array([0.5, -1.0, 2.0, 0.0]).reshape(1, 4, 1, 1)
    scales = np.array([1.0, 3.0, 0.5, 2.0]).reshape(1, 4, 1, 1)
    latents = rng.normal(size=(11, 4, 3, 5)) * scales + offsets
    statistics = MetricAccumulator()
    for batch in _uneven_batches(latents):
        add_latents(statistics, "latents", paddle.to_tensor(batch.astype(np.float32)))
    mean, std, scaling_factor, shift_factor = latent_statistics(statistics.reduce(), "latents")
    as_float32 = latents.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(mean, as_float32.mean(axis=(0, 2, 3)), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(std, as_float32.std(axis=(0, 2, 3)), rtol=1e-9)
    assert scaling_factor == pytest.approx(1.0 / as_float32.std(), rel=1e-9)
    assert shift_factor == pytest.approx(as_float32.mean(), rel=1e-9)


WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np, paddle
    sys.path.insert(0, sys.argv[1])
    from vae_trainer.metrics import (MetricAccumulator, add_features, add_latents, feature_statistics,
                                     latent_statistics)
    paddle.set_device("cpu")
    paddle.distributed.init_parallel_env()
    rank = paddle.distributed.get_rank()
    data = np.load(sys.argv[2])
    shard = slice(0, 4) if rank == 0 else slice(4, None)  # uneven shards: 4 and 7 samples
    metrics = MetricAccumulator()  # all three in one reduction
    metrics.update("psnr", data["values"][shard])
    add_features(metrics, "features", data["features"][shard])
    add_latents(metrics, "latents", data["latents"][shard])
    sums = metrics.reduce()
    mu, sigma = feature_statistics(sums, "features")
    mean, std, _, _ = latent_statistics(sums, "latents")
    print("RESULT " + json.dumps({"psnr": metrics.means(sums)["psnr"], "mu": mu.tolist(),
          "sigma": sigma.tolist(), "mean": mean.tolist(), "std": std.tolist()}))
    from vae_trainer.distributed import run_and_exit
    run_and_exit(lambda: None)  # ends as the entry points do (no SIGABRT at exit)
    """
)


def test_accumulators_reduce_over_two_processes(tmp_path):
    rng = np.random.default_rng(7)
    values, features = rng.normal(size=11), rng.normal(size=(11, 8))
    latents = rng.normal(size=(11, 4, 2, 3)) + np.arange(4).reshape(1, 4, 1, 1)
    np.savez(tmp_path / "data.npz", values=values, features=features, latents=latents)
    (tmp_path / "worker.py").write_text(WORKER)
    subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
         "--log_dir", str(tmp_path / "log"), str(tmp_path / "worker.py"), str(REPO_ROOT),
         str(tmp_path / "data.npz")],
        check=True, cwd=tmp_path, capture_output=True, timeout=300,
    )
    for rank in (0, 1):
        log = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
        assert result["psnr"] == pytest.approx(values.mean(), rel=1e-12)
        np.testing.assert_allclose(result["mu"], features.mean(0), rtol=1e-12)
        np.testing.assert_allclose(result["sigma"], np.cov(features, rowvar=False), atol=1e-12)
        np.testing.assert_allclose(result["mean"], latents.mean(axis=(0, 2, 3)), rtol=1e-12)
        np.testing.assert_allclose(result["std"], latents.std(axis=(0, 2, 3)), rtol=1e-9)
