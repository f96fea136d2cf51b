"""The latent diagnostics (vae_trainer/metrics.py): right on constructed cases, and reported by
every evaluation with its protocol."""

import math

import numpy as np
import paddle
import pytest

from vae_trainer.evaluation import EvalProtocol, evaluate_vae, result_record
from vae_trainer.objectives.equivariance import DIAGNOSTICS, equivariance_pairs, high_frequency_share, spectrum_energies
from vae_trainer.metrics import psnr, to_unit_range


def _filtered_noise(keep_high: bool, shape=(4, 4, 32, 32), seed=0) -> paddle.Tensor:
    """Gaussian noise with its spectrum kept only above (or only at or below) half Nyquist."""
    noise = np.random.default_rng(seed).standard_normal(shape)
    fy, fx = np.fft.fftfreq(shape[2])[:, None], np.fft.fftfreq(shape[3])[None, :]
    high = np.sqrt(fx**2 + fy**2) > 0.25
    spectrum = np.fft.fft2(noise) * (high if keep_high else ~high)
    return paddle.to_tensor(np.fft.ifft2(spectrum).real.astype("float32"))


def _share(latents: paddle.Tensor) -> float:
    return high_frequency_share(spectrum_energies(latents))


def test_the_spectrum_share_of_constructed_latents():
    assert _share(_filtered_noise(keep_high=True)) > 0.999  # pure high-frequency noise
    assert _share(_filtered_noise(keep_high=False)) < 0.001
    white = paddle.to_tensor(np.random.default_rng(1).standard_normal((8, 4, 64, 64)).astype("float32"))
    assert _share(white) == pytest.approx(1 - math.pi / 16, abs=0.01)
    checkerboard = paddle.to_tensor(((-1.0) ** np.add.outer(np.arange(16), np.arange(16)))[None, None].astype("float32"))
    assert _share(checkerboard + 5.0) == pytest.approx(1.0)  # the mean is removed first
    assert _share(paddle.full([1, 4, 8, 8], 3.0)) == 0.0


def _scores(decode, images, latents):
    return {name: float(psnr(to_unit_range(target), to_unit_range(decoded.clip(-1, 1))).mean())
            for name, (decoded, target) in equivariance_pairs(decode, images, latents).items()}


def test_an_equivariant_decoder_scores_higher_than_one_that_is_not():
    """Two decoders (downsampling factor 1) that reconstruct x equally well: a per-pixel colour map, exactly
    equivariant, and the same map plus a pattern fixed in absolute pixel positions, which is not."""
    rng = np.random.default_rng(2)
    latents = paddle.to_tensor(rng.uniform(-0.5, 0.5, (2, 3, 24, 24)).astype("float32"))
    ramp = paddle.to_tensor((0.02 * np.arange(24)[None, None, :, None] * np.ones((1, 3, 1, 1))).astype("float32"))
    noise = paddle.to_tensor(rng.normal(0, 0.05, (2, 3, 24, 24)).astype("float32"))

    def equivariant(z):
        return 0.9 * z

    def positional(z):
        return 0.9 * z + ramp[:, :, : z.shape[2], :] - 0.1

    for decode in (equivariant, positional):
        images = (decode(latents) + noise).clip(-1, 1)  # each reconstructs its images to the same error
        plain = float(psnr(to_unit_range(images), to_unit_range(decode(latents).clip(-1, 1))).mean())
        scores = _scores(decode, images, latents)
        if decode is equivariant:
            eq_scores, eq_plain = scores, plain
    assert plain == pytest.approx(eq_plain, abs=0.3)
    for name in ("scale_equivariance_psnr", "rotation_equivariance_psnr"):
        assert eq_scores[name] > scores[name] + 3, (name, eq_scores, scores)
        assert eq_scores[name] > eq_plain - 0.5  # the equivariant one scores about its plain PSNR (or better)


def test_every_evaluation_reports_the_diagnostics_and_states_them():
    from ppdiffusers import AutoencoderKL

    from conftest import REPO

    paddle.seed(0)
    vae = AutoencoderKL.from_config(AutoencoderKL.load_config(f"{REPO}/configs/vae_micro.json"))
    images = paddle.to_tensor(np.random.default_rng(3).uniform(-1, 1, (3, 3, 32, 32)).astype("float32"))
    result = evaluate_vae(vae, [images[:2], images[2:]])
    for name in DIAGNOSTICS:
        assert math.isfinite(result.metrics[name]), name
    assert 0 < result.metrics["latent_high_frequency_share"] < 1
    # The same numbers by hand, over both batches: the share sums energies before dividing.
    with paddle.no_grad():
        modes = vae.encode(images).latent_dist.mode()
    assert result.metrics["latent_high_frequency_share"] == pytest.approx(_share(modes), rel=1e-5)
    with paddle.no_grad():
        by_hand = _scores(lambda z: vae.decode(z).sample, images, modes)
    for name, value in by_hand.items():
        assert result.metrics[name] == pytest.approx(value, abs=1e-3), name
    protocol = EvalProtocol(resolution=32, metrics=tuple(result.metrics))
    record = result_record(result, protocol)
    assert all(name in record["protocol"] and name in record["metrics"] for name in DIAGNOSTICS)
    assert "decode(rot90(z)) against rot90(x)" in protocol.text()
