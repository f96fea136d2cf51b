"""Evaluation at large sizes (issue 17, item 6): the evaluation batch follows the training batch / the resolution
unless given, results do not depend on it, and --eval_tiled runs ppdiffusers' tiled encode/decode for the
evaluation only (stated in the protocol, switched off again afterwards)."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from conftest import PLAIN_NETWORKS, load_script, read_scalars, run_entry_point, tiny_args
from PIL import Image
from ppdiffusers import AutoencoderKL
from skimage import data as skimage_data
from skimage.transform import resize

import vae_trainer.data.dataset as dataset
import vae_trainer.evaluation as evaluation
from vae_trainer.argument_parser import parse_arguments
from vae_trainer.evaluation import (EvalProtocol, TrainingEvaluator, eval_batch_size, evaluate_vae,
                                    measure_latents, measure_latents_of)
from vae_trainer.models.families.kl import KL

paddle.set_device("cpu")
SIZE = 64
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")


def _vae(**config) -> AutoencoderKL:
    """A tiny AutoencoderKL with downsampling factor 4 (3 blocks), as the SD VAE's in miniature."""
    paddle.seed(0)
    return AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                         block_out_channels=[8, 16, 16], layers_per_block=1, latent_channels=4, norm_num_groups=8,
                         sample_size=SIZE, **config)


@pytest.fixture(scope="module")
def vae() -> AutoencoderKL:
    return _vae()


@pytest.fixture(scope="module")
def images() -> paddle.Tensor:
    photos = [resize(getattr(skimage_data, name)(), (SIZE, SIZE), anti_aliasing=True) for name in PHOTOS[:4]]
    return paddle.to_tensor(np.stack(photos).transpose(0, 3, 1, 2).astype(np.float32) * 2 - 1)


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("eval_photos")
    for name in PHOTOS:
        Image.fromarray(getattr(skimage_data, name)()).resize((80, 72)).save(root / f"{name}.png")
    return str(root)


# ------------------------------------------------------------------------------------ the batch rule
def test_the_evaluation_batch_follows_the_training_batch_or_the_resolution_unless_given():
    assert eval_batch_size(1024, given=6, train_batch_size=1) == 6  # the user's flag wins
    assert eval_batch_size(1024, train_batch_size=1) == 1  # in training: the batch that fits a training step
    assert eval_batch_size(64, train_batch_size=16) == 16
    # Standalone: the pixels of 8 images of 256 px, 1 to 8 images.
    assert [eval_batch_size(size) for size in (32, 256, 512, 768, 1024, 2048)] == [8, 8, 2, 1, 1, 1]
    # What README.md, evaluation.py and the scripts' --batch_size help state: 8 up to 256 px, 4 up to 362 px,
    # 2 from 419 to 512 px, 1 above 512 px.
    assert [eval_batch_size(size) for size in (257, 362, 363, 418, 419, 513, 600)] == [7, 4, 3, 3, 2, 1, 1]
    with pytest.raises(ValueError, match="--per_device_eval_batch_size must be >= 1"):
        eval_batch_size(256, given=0)
    with pytest.raises(ValueError, match="--batch_size must be >= 1"):  # the scripts' flag, named as such
        eval_batch_size(256, given=0, flag="--batch_size")


def test_an_evaluation_batch_below_1_is_refused_when_parsing(tmp_path, capsys):
    """Before anything is built (so before --overwrite_output_dir deletes a run), in both entry points' parser
    and in eval_vae.py's, each naming its own flag."""
    argv = ["--file_list", "x.filelist", "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2",
            "--output_dir", str(tmp_path), "--overwrite_output_dir", "--per_device_eval_batch_size", "0"]
    (tmp_path / "earlier_run.txt").write_text("kept")
    with pytest.raises(ValueError, match=re.escape("--per_device_eval_batch_size must be >= 1, got 0")):
        parse_arguments(argv)
    assert (tmp_path / "earlier_run.txt").exists()
    with pytest.raises(SystemExit):
        load_script("eval_vae").parse_args(["--vae", "v", "--data", "d", "--output_dir", "o", "--batch_size", "0"])
    assert "--batch_size must be >= 1, got 0" in capsys.readouterr().err


def test_the_parse_time_checks_do_not_import_the_evaluation_module():
    """flag_checks.py holds the parse-time tiling checks; evaluation.py (metrics, data) is not imported
    to make them, and importing flag_checks imports no Paddle (the VAE's family, read from its config, does)."""
    import subprocess
    import sys

    code = ("import sys; from types import SimpleNamespace as N; from vae_trainer import flag_checks as f; "
            "assert 'paddle' not in sys.modules, 'paddle imported'; "
            "f.check_tiling_flags(N(input_size=None, eval_tiled=True, eval_tile_size=64), "
            "{'down_block_types': ['D'] * 4}, 'x'); "
            "assert 'vae_trainer.evaluation' not in sys.modules, 'imported'")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_per_device_eval_batch_size_defaults_to_the_training_batch():
    base = ["--file_list", "x.filelist", "--vae_config_file", "configs/vae_micro.json", "--max_steps", "2",
            "--output_dir", "/tmp/vae_trainer_args", "--resolution", "1024", "--per_device_train_batch_size", "1"]
    _, data_args, _, training_args = parse_arguments(base)
    assert training_args.per_device_eval_batch_size is None  # PaddleNLP's default was a fixed 8
    assert TrainingEvaluator(data_args, training_args, PLAIN_NETWORKS).batch_size == 1
    _, data_args, _, training_args = parse_arguments(base + ["--per_device_eval_batch_size", "3"])
    assert TrainingEvaluator(data_args, training_args, PLAIN_NETWORKS).batch_size == 3


def _evaluator(folder, train_batch, eval_batch=None, num_images=5) -> TrainingEvaluator:
    data_args = SimpleNamespace(resolution=SIZE, eval_file_list=folder, eval_num_images=num_images,
                                latent_stats_num_images=None, file_list=folder, eval_tiled=False, eval_tile_size=None)
    args = SimpleNamespace(output_dir="unused", metric_for_best_model=None, eval_steps=1, max_steps=1,
                           per_device_train_batch_size=train_batch, per_device_eval_batch_size=eval_batch,
                           num_logged_images=2)
    return TrainingEvaluator(data_args, args, PLAIN_NETWORKS, lpips=_lpips(), inception=_features())


def _lpips():
    from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS

    return LPIPS(DEFAULT_LPIPS_WEIGHTS) if os.path.isfile(DEFAULT_LPIPS_WEIGHTS) else None


def _features() -> paddle.nn.Layer:
    """A small random conv feature extractor standing in for Inception (its 2048-d sqrtm is slow)."""
    paddle.seed(1)
    return paddle.nn.Sequential(paddle.nn.Conv2D(3, 24, 3, stride=2), paddle.nn.ReLU(),
                                paddle.nn.AdaptiveAvgPool2D(1), paddle.nn.Flatten())


@pytest.fixture()
def loader_batches(monkeypatch):
    """The batch size every evaluation loader was built with."""
    sizes, build = [], dataset.build_eval_dataloader

    def recording(data, resolution, batch_size, *args, **kwargs):
        sizes.append(batch_size)
        return build(data, resolution, batch_size, *args, **kwargs)

    monkeypatch.setattr(dataset, "build_eval_dataloader", recording)
    monkeypatch.setattr(evaluation, "build_eval_dataloader", recording)  # (evaluation.py imports it by name)
    return sizes


def test_evaluation_and_latent_statistics_do_not_depend_on_the_batch(vae, photo_folder, loader_batches):
    """Batch 1 (the training batch) and batch 4 (given) on 5 images: metrics (per-image averages, rFID from
    pooled features) and latent statistics (sums) agree to float tolerance; both passes use the batch."""
    by_one, by_four = _evaluator(photo_folder, train_batch=1), _evaluator(photo_folder, train_batch=1, eval_batch=4)
    one, four = by_one.evaluate(vae), by_four.evaluate(vae)
    stats_one, _ = by_one.latent_stats(vae, None, step=7)  # not evaluated at step 7: an encoder-only pass
    stats_four, _ = by_four.latent_stats(vae, None, step=7)
    assert loader_batches == [1, 4, 1, 4]
    assert one.num_images == four.num_images == stats_one.num_images == 5
    assert set(one.metrics) >= {"psnr", "ssim", "rfid"}
    for name, value in one.metrics.items():
        assert four.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for a, b in ((one, four), (stats_one, stats_four), (one, stats_one)):
        np.testing.assert_allclose(a.latent_mean, b.latent_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.latent_std, b.latent_std, rtol=1e-5)
        assert a.scaling_factor == pytest.approx(b.scaling_factor, rel=1e-5)


def test_the_standalone_latent_measurement_follows_the_resolution(vae, photo_folder, loader_batches):
    measure_latents_of(vae, None, photo_folder, SIZE, None, 2)  # export_vae.py without --batch_size
    measure_latents_of(vae, None, photo_folder, SIZE, 3, 2)
    assert loader_batches == [8, 3]


# ------------------------------------------------------------------------------------------- tiling
def _encoder_inputs(vae):
    """Spatial sizes the encoder and decoder are called on."""
    seen = {"encoder": [], "decoder": []}
    hooks = [getattr(vae, part).register_forward_pre_hook(
        lambda layer, inputs, part=part: seen[part].append(tuple(inputs[0].shape[2:]))) for part in seen]
    return seen, hooks


def _tiling_state(vae):
    return (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor)


def test_tiled_evaluation_runs_on_tiles_and_switches_tiling_off_again(vae, images):
    before = _tiling_state(vae)
    vae.train()
    with paddle.no_grad():
        training_output = vae(images).sample.numpy()
    untiled = evaluate_vae(vae, [images])
    seen, hooks = _encoder_inputs(vae)
    try:
        result = evaluate_vae(vae, [images[:3], images[3:]], tiling=32)
    finally:
        for hook in hooks:
            hook.remove()
    # 64 px images in 32 px tiles (starts 0, 24, 48): the encoder never saw more than a tile, the decoder
    # never more than a latent tile (32 / 4).
    assert max(max(shape) for shape in seen["encoder"]) == 32 and (32, 16) in seen["encoder"]
    assert max(max(shape) for shape in seen["decoder"]) == 8
    assert result.num_images == 4 and result.grid.shape == untiled.grid.shape
    assert result.metrics["psnr"] != untiled.metrics["psnr"]  # really tiled
    # Off again: the VAE's settings are back, training mode restored, and a training forward is unchanged.
    assert _tiling_state(vae) == before and vae.use_tiling is False and vae.training
    with paddle.no_grad():
        np.testing.assert_array_equal(vae(images).sample.numpy(), training_output)
    vae.eval()


def _stitched(tiles: list[list[np.ndarray]], blend: int, limit: int) -> np.ndarray:
    """The documented tiling: each tile's first `blend` rows/columns cross-faded linearly with the tile above /
    to the left (already blended), then cropped to `limit` and concatenated (numpy, written from the docs)."""
    tiles = [[tile.copy() for tile in row] for row in tiles]
    for i, row in enumerate(tiles):
        for j, tile in enumerate(row):
            if i > 0:
                above, extent = tiles[i - 1][j], min(tiles[i - 1][j].shape[2], tile.shape[2], blend)
                for y in range(extent):
                    tile[:, :, y] = above[:, :, -extent + y] * (1 - y / extent) + tile[:, :, y] * (y / extent)
            if j > 0:
                left, extent = row[j - 1], min(row[j - 1].shape[3], tile.shape[3], blend)
                for x in range(extent):
                    tile[:, :, :, x] = left[:, :, :, -extent + x] * (1 - x / extent) + tile[:, :, :, x] * (x / extent)
    return np.concatenate([np.concatenate([t[:, :, :limit, :limit] for t in row], axis=3) for row in tiles], axis=2)


def test_a_tiled_reconstruction_is_whole_tile_reconstructions_blended(vae, images):
    """The tiled latent and reconstruction are exactly the per-tile encoder / decoder outputs, stitched with
    linear cross-fades over 25% of a tile: they differ from the untiled ones only by that (sanity bound)."""
    vae.eval()
    with paddle.no_grad():
        untiled_latent = vae.encode(images).latent_dist.mode()
        untiled = vae.decode(untiled_latent).sample.numpy()
        with KL.tiled(vae, 32):
            latent = vae.encode(images).latent_dist.mode()
            recon = vae.decode(latent).sample.numpy()
        # Whole tiles through the plain (untiled) encoder and decoder, 75% of a tile apart.
        tile_latents = [[vae.encode(images[:, :, i:i + 32, j:j + 32]).latent_dist.mode().numpy()
                         for j in range(0, SIZE, 24)] for i in range(0, SIZE, 24)]
        z = latent.numpy()
        tile_recons = [[vae.decode(paddle.to_tensor(z[:, :, i:i + 8, j:j + 8])).sample.numpy()
                        for j in range(0, 16, 6)] for i in range(0, 16, 6)]
    assert latent.shape == untiled_latent.shape and recon.shape == untiled.shape == tuple(images.shape)
    np.testing.assert_allclose(latent.numpy(), _stitched(tile_latents, blend=2, limit=6), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(recon, _stitched(tile_recons, blend=8, limit=24), rtol=1e-5, atol=1e-5)
    difference = np.abs(recon - untiled)
    assert difference.max() > 1e-3  # tiled for real
    assert difference.mean() < 2 * np.abs(untiled).mean() and np.isfinite(recon).all()  # not garbage


def test_tiling_a_vae_without_quant_convs_leaves_it_as_it_was(images):
    """FLUX-style (use_quant_conv false): ppdiffusers' tiled passes call the missing 1x1 convs; stand-ins serve
    them during the evaluation and are gone afterwards (same sublayers, same state dict)."""
    flux_like = _vae(use_quant_conv=False, use_post_quant_conv=False)
    keys = list(flux_like.state_dict())
    stats = measure_latents(flux_like, [images], tiling=32)
    result = evaluate_vae(flux_like, [images], tiling=32)
    assert stats.num_images == result.num_images == 4
    np.testing.assert_allclose(stats.latent_std, result.latent_std, rtol=1e-5)
    assert flux_like.quant_conv is None and flux_like.post_quant_conv is None
    assert "quant_conv" not in flux_like._sub_layers and list(flux_like.state_dict()) == keys
    assert flux_like.use_tiling is False


def test_tiling_is_switched_off_after_an_error(vae, images):
    before = _tiling_state(vae)
    with pytest.raises(RuntimeError, match="boom"):
        with KL.tiled(vae, 32):
            assert vae.use_tiling and vae.tile_sample_min_size == 32 and vae.tile_latent_min_size == 8
            raise RuntimeError("boom")
    assert _tiling_state(vae) == before


def test_the_protocol_says_when_tiling_was_used():
    plain = EvalProtocol(resolution=1024).describe()
    assert "tiling" not in plain
    used = EvalProtocol(resolution=1024, tiling=512).describe()["tiling"]
    assert used.startswith("tiled (--eval_tiled)") and "512x512-pixel tiles" in used and "25%" in used
    unused = EvalProtocol(resolution=256, tiling=512).describe()["tiling"]
    assert "not used" in unused and "512 px tile" in unused


@pytest.mark.parametrize("extra,message", [
    (["--eval_tile_size", "512"], "--eval_tile_size does nothing without --eval_tiled"),
    (["--eval_tiled", "--eval_tile_size", "40"], "--eval_tile_size 40 must be a multiple of 32 (4 x the VAE's "
                                                 "downsampling factor 8"),
    (["--eval_tiled", "--input_size", "128", "128"], "--eval_tiled cannot be combined with --input_size"),
])
def test_tiling_flags_the_vae_cannot_take_are_refused_when_parsing(extra, message):
    argv = ["--file_list", "x.filelist", "--vae_config_file", "configs/sd_vae.json", "--max_steps", "2",
            "--output_dir", "/tmp/vae_trainer_args", *extra]
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(argv)
    _, data_args, _, _ = parse_arguments(argv[:8] + ["--eval_tiled", "--eval_tile_size", "256"])
    assert data_args.eval_tiled and data_args.eval_tile_size == 256


def test_eval_script_tiles_and_says_so(tmp_path, photo_folder, capsys):
    vae = _vae()
    vae.save_pretrained(str(tmp_path / "vae"))
    eval_vae = load_script("eval_vae")
    result = eval_vae.main(["--vae", str(tmp_path / "vae"), "--data", photo_folder, "--resolution", str(SIZE),
                            "--num_images", "3", "--skip_lpips", "--eval_tiled", "--eval_tile_size", "32",
                            "--output_dir", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert summary["protocol"]["tiling"].startswith("tiled (--eval_tiled): encoder and decoder run on 32x32-pixel")
    assert summary["settings"]["batch_size"] == 8 and summary["num_images"] == 3  # the standalone rule at 64 px
    assert "tiling: tiled (--eval_tiled)" in capsys.readouterr().out
    untiled = eval_vae.main(["--vae", str(tmp_path / "vae"), "--data", photo_folder, "--resolution", str(SIZE),
                             "--num_images", "3", "--skip_lpips", "--output_dir", str(tmp_path / "plain")])
    assert result.metrics["psnr"] != untiled.metrics["psnr"]
    assert "tiling" not in json.loads((tmp_path / "plain" / "metrics.json").read_text())["protocol"]
    with pytest.raises(SystemExit, match="must be a multiple of 16"):
        eval_vae.main(["--vae", str(tmp_path / "vae"), "--data", photo_folder, "--resolution", str(SIZE),
                       "--eval_tiled", "--eval_tile_size", "24", "--skip_lpips", "--output_dir", str(tmp_path / "x")])


# ------------------------------------------------------------------------------ end to end, training
@pytest.fixture(scope="module")
def tiled_and_plain_runs(photo_filelist, held_out_folder, tmp_path_factory):
    """The same 4 steps with an evaluation (and the export's measurement) at 32 px, tiled in 16 px tiles or not."""
    out = {}
    for name, extra in (("tiled", {"eval_tiled": "true", "eval_tile_size": 16}), ("plain", {})):
        output_dir = str(tmp_path_factory.mktemp(name))
        flags = dict(eval_file_list=held_out_folder, eval_steps=2, eval_num_images=3, use_ema="false",
                     scaling_factor="measure", perceptual_weight=0, **extra)
        out[name] = (output_dir, run_entry_point("train_vae_no_trainer.py", tiny_args(photo_filelist, output_dir,
                                                                                      **flags)))
    return out


def test_a_run_with_eval_tiled_evaluates_tiled_and_trains_as_without(tiled_and_plain_runs):
    (tiled_dir, tiled_run), (plain_dir, _) = tiled_and_plain_runs["tiled"], tiled_and_plain_runs["plain"]
    records = [json.loads(line) for line in open(os.path.join(tiled_dir, "eval_metrics.jsonl"))]
    plain_records = [json.loads(line) for line in open(os.path.join(plain_dir, "eval_metrics.jsonl"))]
    assert [r["step"] for r in records] == [2, 4]
    for record, plain in zip(records, plain_records):
        assert "16x16-pixel tiles" in record["protocol"]["tiling"] and "tiling" not in plain["protocol"]
    assert "tiling: tiled (--eval_tiled)" in tiled_run.stdout + tiled_run.stderr
    assert records[0]["metrics"]["psnr"] != plain_records[0]["metrics"]["psnr"]  # the evaluation was tiled
    # Training after the tiled evaluation at step 2 is exactly the untiled run's: tiling was switched off.
    for tag in ("loss/total", "loss/pixel"):
        tiled_losses = read_scalars(os.path.join(tiled_dir, "logs"), tag)
        assert sorted(tiled_losses) == [1, 2, 3, 4]
        assert tiled_losses == read_scalars(os.path.join(plain_dir, "logs"), tag), tag
    # The exported scaling factor reuses the tiled evaluation at step 4, and says so.
    assert "the evaluation at step 4, tiled (16 px tiles)" in open(os.path.join(tiled_dir, "vae", "latent_stats.json")).read()
