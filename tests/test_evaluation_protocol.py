"""The evaluation protocol as stated is the one followed: images decoded at full size (no JPEG draft mode)
then resized and centre-cropped; the printed and stored protocol names only the metrics measured; every
evaluation during training is recorded in OUTPUT_DIR/eval_metrics.jsonl (a resumed run replaces its steps)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from PIL import Image
from ppdiffusers import AutoencoderKL
from skimage import data as skimage_data
from conftest import PLAIN_NETWORKS

from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.data.images import RESAMPLING, crop, load_rgb, open_image, to_float
from vae_trainer.evaluation import EvalProtocol, TrainingEvaluator, evaluate_vae
from vae_trainer.objectives.equivariance import DIAGNOSTICS

SIZE = 64
paddle.set_device("cpu")


@pytest.fixture(scope="module")
def big_jpeg(tmp_path_factory):
    """A 512x384 JPEG photo: at 64 px, draft mode would decode it at 1/4 scale."""
    folder = tmp_path_factory.mktemp("jpeg")
    Image.fromarray(skimage_data.astronaut()[64:448]).save(folder / "astronaut.jpg", quality=92)
    return folder


def documented_preprocessing(path) -> np.ndarray:
    """The protocol written out with plain PIL: full decode, shorter side to SIZE (bicubic), centre crop."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    scale = SIZE / min(width, height)
    resized = image.resize((round(width * scale), round(height * scale)), Image.Resampling.BICUBIC)
    left, top = (resized.width - SIZE) // 2, (resized.height - SIZE) // 2
    return np.asarray(resized.crop((left, top, left + SIZE, top + SIZE)))


def test_the_protocol_resamples_with_bicubic():
    assert RESAMPLING == Image.Resampling.BICUBIC  # what documented_preprocessing uses


def test_evaluation_images_are_decoded_at_full_size(big_jpeg):
    expected = documented_preprocessing(big_jpeg / "astronaut.jpg")
    [batch] = list(build_eval_dataloader(str(big_jpeg), SIZE, 1, 0, 1, None))
    np.testing.assert_array_equal(batch["pixel_values"].numpy()[0], to_float(expected))
    # What draft-mode decoding (training's fast path) gives instead: other pixels, so other metrics.
    data = (big_jpeg / "astronaut.jpg").read_bytes()
    drafted = crop(load_rgb(open_image(data, 2**30), cover=(SIZE, SIZE)), (SIZE, SIZE), None, False)
    assert np.abs(drafted.astype(int) - expected.astype(int)).mean() > 1.0


def test_metrics_of_a_jpeg_equal_those_of_the_documented_preprocessing(big_jpeg):
    paddle.seed(0)
    vae = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        block_out_channels=[8, 8], layers_per_block=1, latent_channels=4, norm_num_groups=8)
    expected = to_float(documented_preprocessing(big_jpeg / "astronaut.jpg"))[None]
    by_loader = evaluate_vae(vae, build_eval_dataloader(str(big_jpeg), SIZE, 1, 0, 1, None))
    by_hand = evaluate_vae(vae, [paddle.to_tensor(expected)])
    assert set(by_loader.metrics) == {"psnr", "ssim", *DIAGNOSTICS}
    for name, value in by_hand.metrics.items():
        assert by_loader.metrics[name] == value, name


def test_the_protocol_states_only_the_metrics_measured():
    measured = EvalProtocol(resolution=SIZE, metrics=("psnr", "ssim")).describe()
    assert {"psnr", "ssim"} <= set(measured) and not {"lpips", "rfid"} & set(measured)
    assert "LPIPS" not in measured["value range"] and "rFID" not in measured["value range"]
    with_lpips = EvalProtocol(resolution=SIZE, metrics=("ssim", "lpips", "psnr")).describe()
    assert "lpips" in with_lpips and "rfid" not in with_lpips and "LPIPS on [-1, 1]" in with_lpips["value range"]
    assert list(with_lpips)[-3:] == ["psnr", "ssim", "lpips"]  # stated in a fixed order
    assert "decoded at full size (no JPEG draft mode)" in measured["images"]


def evaluator(output_dir, metric=None) -> TrainingEvaluator:
    data_args = SimpleNamespace(resolution=SIZE, eval_file_list="held_out", eval_num_images=4,
                                latent_stats_num_images=None, file_list="train", eval_tiled=False, eval_tile_size=None)
    args = SimpleNamespace(output_dir=str(output_dir), metric_for_best_model=metric, eval_steps=2, max_steps=8,
                           per_device_eval_batch_size=2, num_logged_images=2)
    return TrainingEvaluator(data_args, args, PLAIN_NETWORKS)


def fake_result(psnr: float):
    from vae_trainer.evaluation import EvalResult

    return EvalResult([0.1], [1.0], 1.0, 0.0, 4, metrics={"psnr": psnr, "ssim": 0.5},
                      grid=np.zeros((2, 2, 3), np.uint8))


def records(output_dir):
    with open(output_dir / "eval_metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_every_evaluation_is_recorded_and_a_resumed_run_replaces_its_steps(tmp_path, monkeypatch):
    """Steps 2, 4, 6 evaluated; a resumed run (from checkpoint-4) evaluates step 6 again: its record replaces
    the earlier attempt's. Each line: the step, the weights, the numbers, their protocol, the best flag."""
    monkeypatch.setattr(TrainingEvaluator, "evaluate", lambda self, vae, ema=None: fake_result(self.next_psnr))
    monitor = SimpleNamespace(log_scalars=lambda step, scalars: None, log_grid=lambda step, grid, tag: None)
    state = SimpleNamespace(log_history=[], best_metric=None)
    tmp_path = tmp_path / "not_made_yet"  # the plain loop writes nothing to --output_dir before its first save
    run = evaluator(tmp_path, metric="psnr")
    for step, value in ((2, 20.0), (4, 25.0), (6, 22.0)):
        run.next_psnr = value
        run.run(step, vae=SimpleNamespace(config={}), ema=object(), monitor=monitor, trainer_state=state)
    lines = records(tmp_path)
    assert [(r["step"], r["metrics"]["psnr"], r["is_best"]) for r in lines] == [(2, 20.0, True), (4, 25.0, True),
                                                                                 (6, 22.0, False)]
    assert lines[0]["weights"] == "ema" and lines[0]["metric_for_best_model"] == "psnr"
    assert lines[0]["protocol"] == EvalProtocol(resolution=SIZE, metrics=("psnr", "ssim")).describe()
    assert lines[0]["latent_std"] == [1.0] and lines[0]["num_images"] == 4
    resumed = evaluator(tmp_path)
    resumed.next_psnr = 30.0
    resumed.run(6, vae=SimpleNamespace(config={}), ema=None, monitor=monitor, trainer_state=SimpleNamespace(log_history=[], best_metric=25.0))
    lines = records(tmp_path)
    assert [(r["step"], r["metrics"]["psnr"], r["weights"]) for r in lines] == [(2, 20.0, "ema"), (4, 25.0, "ema"),
                                                                                 (6, 30.0, "raw")]
    assert "is_best" not in lines[-1]  # no --metric_for_best_model in that run


def test_eval_script_refuses_a_resolution_the_vae_cannot_take(tmp_path, big_jpeg):
    from conftest import REPO, load_script

    with pytest.raises(SystemExit) as stopped:
        load_script("eval_vae").main(["--vae", f"{REPO}/configs/vae_tiny.json", "--data", str(big_jpeg), "--resolution", "30",
                                      "--output_dir", str(tmp_path / "out"), "--skip_lpips"])
    assert stopped.value.code == "error: --resolution 30 must be a multiple of the VAE's downsampling factor 4 " \
                                 "(2 ** (down blocks - 1), the VAE's config)"
    assert not (tmp_path / "out").exists()
