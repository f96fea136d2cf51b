"""evaluate_vae on a tiny random AutoencoderKL, compared with the metrics computed directly, and
scripts/eval_vae.py on a saved VAE and a folder of real photos (in-process; once on two processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from conftest import load_script
from PIL import Image
from ppdiffusers import AutoencoderKL
from skimage import data as skimage_data
from skimage.transform import resize

from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.evaluation import EvalProtocol, evaluate_vae, make_grid
from vae_trainer.objectives.equivariance import DIAGNOSTICS
from vae_trainer.metrics import frechet_distance, psnr, ssim, to_unit_range
from vae_trainer.models.inception import FIDInceptionV3

REPO_ROOT = Path(__file__).resolve().parents[1]
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")
SIZE = 32
paddle.set_device("cpu")


def _tiny_vae() -> AutoencoderKL:
    paddle.seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[32, 32],
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=SIZE,
    )


@pytest.fixture(scope="module")
def vae() -> AutoencoderKL:
    return _tiny_vae()


@pytest.fixture(scope="module")
def images() -> paddle.Tensor:
    """Five real photos, [5, 3, 32, 32] in [-1, 1]."""
    photos = [resize(getattr(skimage_data, n)(), (SIZE, SIZE), anti_aliasing=True) for n in PHOTOS]
    return paddle.to_tensor(np.stack(photos).transpose(0, 3, 1, 2).astype(np.float32) * 2 - 1)


def _direct_reconstruction(vae, images):
    with paddle.no_grad():
        latents = vae.encode(images).latent_dist.mode()
        return latents, vae.decode(latents).sample.clip(-1.0, 1.0)


def _dict_batches(images, sizes):
    start = 0
    for size in sizes:
        yield {"pixel_values": images[start:start + size]}
        start += size


def test_metrics_equal_those_computed_directly_on_the_reconstructions(vae, images):
    _, recons = _direct_reconstruction(vae, images)
    result = evaluate_vae(vae, _dict_batches(images, (2, 3)), grid_images=3)

    assert result.num_images == 5
    assert set(result.metrics) == {"psnr", "ssim", *DIAGNOSTICS}  # no LPIPS, no Inception given
    unit_images, unit_recons = to_unit_range(images), to_unit_range(recons)
    assert result.metrics["psnr"] == pytest.approx(psnr(unit_images, unit_recons).numpy().mean(), rel=1e-5)
    assert result.metrics["ssim"] == pytest.approx(ssim(unit_images, unit_recons).numpy().mean(), rel=1e-5)
    # Latent statistics are those of posterior samples (exact expectation), whatever was decoded (the mode).
    posterior = vae.encode(images).latent_dist
    means, variances = posterior.mean.numpy().astype(np.float64), posterior.var.numpy().astype(np.float64)
    np.testing.assert_allclose(result.latent_mean, means.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.latent_std, np.sqrt(means.var(axis=(0, 2, 3)) + variances.mean(axis=(0, 2, 3))),
                               rtol=1e-5)
    assert result.scaling_factor == pytest.approx(1 / np.sqrt(means.var() + variances.mean()), rel=1e-5)
    assert result.shift_factor == pytest.approx(means.mean(), rel=1e-4, abs=1e-6)
    np.testing.assert_array_equal(result.grid, make_grid(images[:3], recons[:3]))


class _Brighter(paddle.nn.Layer):
    """A stand-in VAE whose latent is the image and whose reconstruction is it `shift` brighter ([-1, 1] units)."""

    config = {}  # read as an AutoencoderKL's (models/families/)

    def __init__(self, shift: float):
        super().__init__()
        self.shift = shift

    def encode(self, pixels):
        return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: pixels, mean=pixels, var=0 * pixels))

    def decode(self, latents):
        return SimpleNamespace(sample=latents + self.shift)


def test_reported_psnr_and_ssim_are_scikit_images_on_unit_range_images():
    """A mid-grey photo reconstructed 0.15 too bright: SSIM ~0.96 in the field's convention, not ~0.16."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    from test_metrics import mid_grey_pair

    image, brighter = mid_grey_pair()
    pixels = paddle.to_tensor(image.transpose(2, 0, 1)[None].astype(np.float32) * 2 - 1)
    result = evaluate_vae(_Brighter(0.3), [pixels])
    expected_ssim = structural_similarity(image, brighter, gaussian_weights=True, sigma=1.5,
                                          use_sample_covariance=False, data_range=1.0, channel_axis=-1)
    assert expected_ssim > 0.9
    assert result.metrics["ssim"] == pytest.approx(expected_ssim, abs=1e-3)
    assert result.metrics["psnr"] == pytest.approx(peak_signal_noise_ratio(image, brighter, data_range=1.0), abs=1e-3)


def test_num_images_limits_the_count(vae, held_out_32):
    """The loader caps the images (--eval_num_images, eval_vae.py's --num_images); the pass takes what it gives."""
    everything = paddle.concat([b["pixel_values"] for b in build_eval_dataloader(held_out_32, SIZE, 3, 0, 1, None)])
    _, recons = _direct_reconstruction(vae, everything[:4])
    result = evaluate_vae(vae, build_eval_dataloader(held_out_32, SIZE, 3, 0, 1, 4))
    assert result.num_images == 4
    assert result.metrics["psnr"] == pytest.approx(
        psnr(to_unit_range(everything[:4]), to_unit_range(recons)).numpy().mean(), rel=1e-5)


def test_the_encoder_only_pass_encodes_under_half_precision_autocast_as_evaluation_does(vae, images, monkeypatch):
    """An O2 (half-precision) VAE takes float32 images only under autocast: measure_latents encodes as evaluate_vae
    does (a half-precision conv has no CPU kernel, so the autocast is observed, not run)."""
    from contextlib import contextmanager

    import vae_trainer.evaluation as evaluation

    inside, seen = [], []

    @contextmanager
    def autocast(layer):
        inside.append(layer)
        yield
        inside.pop()

    encode = vae.encode
    monkeypatch.setattr(evaluation, "half_precision_autocast", autocast)
    monkeypatch.setattr(vae, "encode", lambda x: seen.append(bool(inside)) or encode(x))
    for measure in (evaluation.measure_latents, evaluate_vae):
        seen.clear()
        measure(vae, [images[:2], images[2:]])
        assert seen == [True, True], measure.__name__


def test_training_mode_is_restored_and_sampling_is_seeded(vae, images):
    vae.train()
    first = evaluate_vae(vae, [images], sample_posterior=True, seed=3)
    assert vae.training
    again = evaluate_vae(vae, [images], sample_posterior=True, seed=3)
    other_seed = evaluate_vae(vae, [images], sample_posterior=True, seed=4)
    mode = evaluate_vae(vae, [images])
    vae.eval()
    assert first.metrics == again.metrics
    assert first.metrics["psnr"] != other_seed.metrics["psnr"]
    assert first.metrics["psnr"] != mode.metrics["psnr"]


def _small_feature_network() -> paddle.nn.Layer:
    """A real (random) conv feature extractor with 24-d output.

    FIDInceptionV3 would work the same but its 2048x2048 matrix square root costs tens of seconds
    on these CPUs; the Inception port itself is tested in test_inception.py.
    """
    paddle.seed(1)
    return paddle.nn.Sequential(
        paddle.nn.Conv2D(3, 24, 3, stride=2), paddle.nn.ReLU(), paddle.nn.AdaptiveAvgPool2D(1),
        paddle.nn.Flatten(),
    )


def test_rfid_uses_features_of_inputs_and_reconstructions(vae, images):
    features = _small_feature_network()
    _, recons = _direct_reconstruction(vae, images)
    with paddle.no_grad():
        real = features(images).numpy().astype(np.float64)
        fake = features(recons).numpy().astype(np.float64)
    expected = frechet_distance(real.mean(0), np.cov(real, rowvar=False),
                                fake.mean(0), np.cov(fake, rowvar=False))
    result = evaluate_vae(vae, [images[:2], images[2:]], inception=features)
    assert expected > 0
    assert result.metrics["rfid"] == pytest.approx(expected, rel=1e-4)


def test_eval_script_loads_converted_inception_weights(tmp_path):
    eval_vae = load_script("eval_vae")
    paddle.seed(2)
    saved = FIDInceptionV3()
    path = tmp_path / "fid_inception_v3.pdparams"
    paddle.save(saved.state_dict(), str(path))
    loaded = eval_vae.load_inception(eval_vae.parse_args(
        ["--vae", "v", "--data", "d", "--output_dir", "o", "--inception_weights", str(path)]))
    name = "Mixed_7c.branch_pool.bn._variance"
    np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), saved.state_dict()[name].numpy())
    assert not loaded.training


def test_lpips_is_the_mean_of_the_per_image_distances(vae, images):
    lpips_module = pytest.importorskip("vae_trainer.models.lpips")
    if not os.path.exists(lpips_module.DEFAULT_LPIPS_WEIGHTS):
        pytest.skip(f"no LPIPS weights at {lpips_module.DEFAULT_LPIPS_WEIGHTS} (make setup)")
    lpips = lpips_module.LPIPS()
    _, recons = _direct_reconstruction(vae, images)
    with paddle.no_grad():
        expected = lpips(images, recons).numpy().mean()
    result = evaluate_vae(vae, [images[:3], images[3:]], lpips=lpips)
    assert result.metrics["lpips"] == pytest.approx(expected, rel=1e-5)


def test_make_grid_puts_inputs_over_reconstructions():
    inputs = -np.ones((3, 3, 4, 5), dtype=np.float32)
    recons = np.full((3, 3, 4, 5), 2.0, dtype=np.float32)  # out of range: clipped to white
    recons[1] = 0.0
    grid = make_grid(inputs, recons, max_images=2)
    assert grid.shape == (8, 10, 3) and grid.dtype == np.uint8
    assert (grid[:4] == 0).all()
    assert (grid[4:, :5] == 255).all()
    assert (grid[4:, 5:] == 128).all()  # 0.0 -> 127.5, rounded


def test_eval_script_end_to_end(tmp_path, vae, capsys):
    vae.save_pretrained(str(tmp_path / "vae"))
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for name in PHOTOS:
        Image.fromarray(getattr(skimage_data, name)()).resize((48, 40)).save(image_dir / f"{name}.png")

    output_dir = tmp_path / "out"
    load_script("eval_vae").main(["--vae", str(tmp_path / "vae"), "--data", str(image_dir), "--resolution", str(SIZE),
                                  "--num_images", "4", "--batch_size", "3", "--skip_lpips",
                                  "--output_dir", str(output_dir)])
    stdout = capsys.readouterr().out
    summary = json.loads((output_dir / "metrics.json").read_text())
    assert summary["num_images"] == 4
    assert set(summary["metrics"]) == {"psnr", "ssim", *DIAGNOSTICS}
    assert all(np.isfinite(v) for v in summary["metrics"].values())
    assert len(summary["latent_mean"]) == len(summary["latent_std"]) == 4
    assert summary["scaling_factor"] == pytest.approx(1 / np.sqrt(
        np.mean(np.square(summary["latent_std"]) + np.square(summary["latent_mean"]))
        - summary["shift_factor"] ** 2), rel=1e-4)
    grid = Image.open(output_dir / "reconstructions.png")
    assert grid.size == (4 * SIZE, 2 * SIZE)
    assert "psnr" in stdout
    assert "LPIPS skipped" in stdout and "rFID skipped" in stdout
    # The protocol is printed and recorded with the numbers, stating the metrics measured (LPIPS skipped).
    protocol = EvalProtocol(resolution=SIZE, metrics=("psnr", "ssim", *DIAGNOSTICS))
    assert summary["protocol"] == protocol.describe() and "lpips" not in summary["protocol"]
    assert stdout.count(protocol.text()) == 1  # printed once
    assert "data range 1" in summary["protocol"]["value range"] and "posterior mode" in summary["protocol"]["latents"]


def test_the_readme_quotes_the_protocol_the_code_uses():
    """docs/measuring.md, "The protocol" (the README links to it)."""
    page = (REPO_ROOT / "docs" / "measuring.md").read_text()
    assert EvalProtocol(resolution=256).text() + "\n```" in page  # every metric, vf_alignment_cka last


def test_eval_script_gives_the_same_numbers_on_two_processes(tmp_path, vae):
    """Two processes under the launcher, each decoding its share, evaluate the images one process does (the
    first 4 usable, past a broken and a truncated file) and report the same numbers."""
    vae.save_pretrained(str(tmp_path / "vae"))
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for index, name in enumerate(PHOTOS):
        Image.fromarray(getattr(skimage_data, name)()).resize((48, 40)).save(image_dir / f"{index}_{name}.png")
    (image_dir / "0_broken.png").write_bytes(b"broken")
    (image_dir / "1_truncated.png").write_bytes((image_dir / "1_coffee.png").read_bytes()[:800])
    flags = ["--vae", str(tmp_path / "vae"), "--data", str(image_dir), "--resolution", str(SIZE), "--num_images", "4",
             "--batch_size", "2", "--skip_lpips", "--output_dir"]
    load_script("eval_vae").main(flags + [str(tmp_path / "out1")])
    completed = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
         str(REPO_ROOT / "scripts" / "eval_vae.py"), *flags, str(tmp_path / "out2")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("out1", "out2"))
    assert one["num_images"] == two["num_images"] == 4
    assert one["metrics"] == pytest.approx(two["metrics"], rel=1e-5)
    np.testing.assert_allclose(one["latent_mean"] + one["latent_std"], two["latent_mean"] + two["latent_std"],
                               rtol=1e-5, atol=1e-7)
