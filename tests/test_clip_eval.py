"""Evaluation and logging on video clips (issue 43): psnr / ssim / lpips over every frame of every clip, flicker,
the per-position PSNR of the causal layout (frame 0, then places 1..4 of each group of 4), the in-training evaluator
(eval_metrics.jsonl, VisualDL scalars and frame strips), training's clip logging and throughput, and
scripts/eval_vae.py on clips. The clip reader is stood in for: batches are fed directly or its loader patched."""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from conftest import PLAIN_NETWORKS, REPO, load_script
from PIL import Image

from vae_trainer import evaluation
from vae_trainer.arguments import VAETrainingArguments
from vae_trainer.evaluation import TrainingEvaluator, evaluate_vae
from vae_trainer.objectives.clips import flicker
from vae_trainer.metrics import fold_frames, ssim
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.families.wan import WAN
from vae_trainer.train_logging import TrainMonitor

SIZE, FRAMES = 16, 9
# Wan 2.1's layout, tiny: spatial factor 4, one temporal downsample (5 frames -> 2 latent frames, 9 -> 3).
TINY_WAN = dict(_class_name="AutoencoderKLWan", base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True], scale_factor_spatial=4, latents_mean=[0.0] * 4,
                latents_std=[1.0] * 4)
CLIP_KEYS = {"psnr", "ssim", "flicker", *(f"psnr_position_{p}" for p in range(5))}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """(the tiny Wan VAE, its config file)."""
    path = tmp_path_factory.mktemp("wan") / "tiny_wan.json"
    path.write_text(json.dumps(TINY_WAN))
    paddle.seed(0)
    return build_vae(vae_config_file=str(path)), str(path)


def moving_clips(clips=2, frames=FRAMES, size=SIZE, seed=0) -> np.ndarray:
    """[B, 3, T, H, W] in [-0.5, 0.5]: a random texture shifting one pixel per frame (so frames differ)."""
    texture = np.random.default_rng(seed).uniform(-0.5, 0.5, (clips, 3, size, size + frames)).astype(np.float32)
    return np.stack([texture[..., t:t + size] for t in range(frames)], axis=2)


def frame_offsets(clips: np.ndarray, offsets) -> np.ndarray:
    """`clips` with frame t of clip b brighter by offsets[b, t] (offsets[t]: in every clip) on [0, 1] (2 x that on
    [-1, 1]), the same over every pixel."""
    offsets = np.broadcast_to(np.asarray(offsets, np.float32), clips.shape[:1] + clips.shape[2:3])
    return clips + 2 * offsets[:, None, :, None, None]


class FrameMeanError(paddle.nn.Layer):
    """An LPIPS stand-in: the mean absolute error of each image, shape [N, 1, 1, 1] as LPIPS gives."""

    def forward(self, x, y):
        return (x - y).abs().mean(axis=[1, 2, 3], keepdim=True)


def reconstructing_as(monkeypatch, recons: np.ndarray) -> None:
    """The Wan family decodes any latent to `recons` (the encoder still runs)."""
    monkeypatch.setattr(WAN, "decode", lambda vae, latents: paddle.to_tensor(recons))


def test_clip_metrics_of_a_known_pair_per_frame_and_per_position(wan, monkeypatch):
    """Frame t of clip b off by d = 0.01 (t + 1)(b + 1) on [0, 1]: its PSNR is -20 log10(d); position 0 is frame 0,
    position p frames p and p + 4 (of both clips); flicker is |d_{t+1} - d_t| = 0.01 (b + 1); ssim and lpips are
    the means over all 18 frames."""
    clips = moving_clips()
    offsets = 0.01 * np.arange(1, FRAMES + 1)[None] * np.array([[1], [2]])
    recons = frame_offsets(clips, offsets)
    reconstructing_as(monkeypatch, recons)
    result = evaluate_vae(wan[0], [paddle.to_tensor(clips)], lpips=FrameMeanError(), grid_images=1)
    per_frame = (-20 * np.log10(offsets)).mean(axis=0)  # over the two clips
    metrics = result.metrics
    assert set(metrics) == CLIP_KEYS | {"lpips", "latent_high_frequency_share"}
    assert metrics["psnr"] == pytest.approx(per_frame.mean(), abs=1e-3)
    assert metrics["psnr_position_0"] == pytest.approx(per_frame[0], abs=1e-3)
    for place in range(1, 5):
        assert metrics[f"psnr_position_{place}"] == pytest.approx((per_frame[place] + per_frame[place + 4]) / 2,
                                                                  abs=1e-3), place
    assert metrics["flicker"] == pytest.approx(0.015, rel=1e-4)
    assert metrics["lpips"] == pytest.approx(2 * offsets.mean(), rel=1e-5)  # on [-1, 1]
    unit = lambda x: paddle.to_tensor((x + 1) / 2)  # noqa: E731
    by_frame = [ssim(unit(clips[:, :, t]), unit(recons[:, :, t])).numpy() for t in range(FRAMES)]  # [2] each
    assert metrics["ssim"] == pytest.approx(np.mean(by_frame), abs=1e-5)
    assert result.num_images == 2 and result.grid.shape == (2 * SIZE, FRAMES * SIZE, 3)  # one clip's strips


def test_flicker_is_zero_for_an_error_constant_in_time_and_exact_for_one_that_alternates():
    clips = moving_clips()
    constant = frame_offsets(clips, [0.05] * FRAMES)
    alternating = frame_offsets(clips, 0.05 * (-1.0) ** np.arange(FRAMES))  # the same PSNR in every frame
    unit = lambda x: paddle.to_tensor((x + 1) / 2)  # noqa: E731
    np.testing.assert_allclose(flicker(unit(clips), unit(constant)).numpy(), [0, 0], atol=1e-6)
    np.testing.assert_allclose(flicker(unit(clips), unit(alternating)).numpy(), [0.1, 0.1], rtol=1e-5)
    folded = fold_frames(paddle.to_tensor(clips)).numpy()  # frame t of clip b at b * T + t
    np.testing.assert_array_equal(folded[FRAMES + 3], clips[1, :, 3])


def vdl_reader(logdir):
    from visualdl import LogReader

    files = [f for f in os.listdir(logdir) if f.startswith("vdlrecords")]
    return LogReader(file_path=os.path.join(logdir, files[0]))


def image_size(record) -> tuple[int, int]:
    """(width, height) of a VisualDL image record (a PNG)."""
    return Image.open(io.BytesIO(record.image.encoded_image_string)).size


def test_the_training_evaluator_measures_clips_into_eval_metrics_and_visualdl(wan, tmp_path, monkeypatch):
    clips = paddle.to_tensor(moving_clips(clips=3, frames=5))
    asked = {}

    def clip_loader(path, resolution, batch_size, rank, world_size, num_images, sample=None, **frames):
        asked.update(frames)
        yield {"pixel_values": clips[:2]}
        yield {"pixel_values": clips[2:]}

    monkeypatch.setattr(evaluation, "build_eval_dataloader", clip_loader)
    held_out = tmp_path / "held_out"  # (read by the stand-in loader above; the evaluator checks it names videos)
    held_out.mkdir()
    (held_out / "still.png").write_bytes(b"")
    data_args = SimpleNamespace(resolution=SIZE, eval_file_list=str(held_out), eval_num_images=3,
                                latent_stats_num_images=None, file_list=str(held_out), eval_tiled=False,
                                eval_tile_size=None,
                                num_frames=5, frame_stride=2)
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=4, eval_steps=2, per_device_eval_batch_size=2,
                                num_logged_images=2, report_to=["visualdl"])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    with pytest.raises(ValueError, match="held_out names no video file, and --num_frames 5 reads clips"):
        # a start-up error, not one at the first evaluation
        TrainingEvaluator(data_args, args, PLAIN_NETWORKS, lpips=FrameMeanError())
    (held_out / "clip.mp4").write_bytes(b"")
    evaluator = TrainingEvaluator(data_args, args, PLAIN_NETWORKS, lpips=FrameMeanError())
    evaluator.run(2, wan[0], None, monitor, SimpleNamespace(log_history=[], best_metric=None))
    monitor.close()
    assert asked == {"num_frames": 5, "frame_stride": 2, "channels": 3}  # Wan: RGB
    record = json.loads((tmp_path / "eval_metrics.jsonl").read_text())
    assert CLIP_KEYS | {"lpips"} <= set(record["metrics"]) and record["num_images"] == 3
    assert "frames 0, 2, ..., 8 (--num_frames 5, --frame_stride 2)" in record["protocol"]["clips"]
    assert "flicker" in record["protocol"] and "psnr_position_4" in record["protocol"]
    reader = vdl_reader(args.logging_dir)
    for name in CLIP_KEYS:
        assert [r.value for r in reader.get_data("scalar", f"eval/{name}")] == pytest.approx(
            [record["metrics"][name]], rel=1e-5), name
    strips = reader.get_data("image", "eval/reconstructions")
    assert [image_size(r) for r in strips] == [(5 * SIZE, 2 * 2 * SIZE)]  # 2 clips: frames x width, 2 rows each


def test_training_logs_clip_micro_batches_as_frame_strips_and_counts_frames(tmp_path):
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=2, image_logging_steps=2,
                                num_logged_images=3, report_to=["visualdl"])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    clips = paddle.to_tensor(moving_clips(clips=2, frames=5))
    batches = monitor.timed(iter([{"pixel_values": clips}, {"pixel_values": clips[:, :, 0]}]))  # a clip, then frames
    for step, _ in enumerate(batches, start=1):
        monitor.micro_step_end({"loss/total": paddle.ones([])})
        scalars = monitor.optimizer_step_end(step, {}, lambda: (clips, -clips))
    monitor.close()
    # (2 x 5 + 2 x 1) frames in 4 samples: 3 frames per sample
    assert scalars["perf/frames_per_second"] == pytest.approx(3 * scalars["perf/images_per_second"])
    strips = vdl_reader(args.logging_dir).get_data("image", "reconstructions")
    assert [image_size(r) for r in strips] == [(5 * SIZE, 2 * 2 * SIZE)]


def test_training_logging_of_images_shows_no_frame_rate(tmp_path):
    args = VAETrainingArguments(output_dir=str(tmp_path), max_steps=1, logging_steps=1, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=2, is_main_process=True)
    for _ in monitor.timed(iter([{"pixel_values": paddle.zeros([2, 3, 8, 8])}])):
        scalars = monitor.optimizer_step_end(1, {})
    assert "perf/frames_per_second" not in scalars and scalars["perf/images_per_second"] > 0


def test_eval_vae_on_clips_writes_the_clip_metrics_and_protocol(wan, tmp_path, monkeypatch):
    script = load_script("eval_vae")
    clips = moving_clips(clips=2, frames=5)
    asked = {}

    def clip_loader(path, resolution, batch_size, rank, world_size, num_images, sample=None, **frames):
        asked.update(frames, num_images=num_images)
        yield {"pixel_values": paddle.to_tensor(clips)}

    monkeypatch.setattr(script, "build_eval_dataloader", clip_loader)
    paddle.seed(0)  # as the script seeds an untrained baseline
    expected = evaluate_vae(build_vae(vae_config_file=wan[1]), [paddle.to_tensor(clips)]).metrics
    out = tmp_path / "eval"
    script.main(["--vae", wan[1], "--data", "clips_dir", "--resolution", str(SIZE), "--num_images", "2",
                 "--num_frames", "5", "--frame_stride", "3", "--output_dir", str(out),
                 "--lpips_weights", os.path.join(REPO, "weights", "lpips_vgg16.pdparams")])
    assert asked == {"num_frames": 5, "frame_stride": 3, "num_images": 2, "channels": 3}
    summary = json.loads((out / "metrics.json").read_text())
    assert CLIP_KEYS | {"lpips"} <= set(summary["metrics"])
    for name in CLIP_KEYS:
        assert summary["metrics"][name] == pytest.approx(expected[name], rel=1e-5), name
    assert "frames 0, 3, ..., 12 (--num_frames 5, --frame_stride 3)" in summary["protocol"]["clips"]
    assert f"centre crop {SIZE}x{SIZE}" in summary["protocol"]["images"]
    assert Image.open(out / "reconstructions.png").size == (5 * SIZE, 2 * 2 * SIZE)


@pytest.mark.parametrize("flags, words", [
    (["--vae", "configs/vae_tiny.json", "--num_frames", "5"],
     "--num_frames 5: AutoencoderKL encodes images, not clips"),
    (["--num_frames", "6"], "--num_frames 6: AutoencoderKLWan's causal layout codes the first frame alone, then "
                            "groups of 4: it takes 1 + 4k frames"),
    (["--frame_stride", "2"], "--frame_stride 2: it applies to clips"),
    (["--num_frames", "5", "--inception_weights", "x.pdparams"], "rFVD is not provided"),
    (["--num_frames", "5", "--input_size", "8", "8"], "--input_size: the encoder's input size is for images"),
])
def test_eval_vae_refuses_clips_it_cannot_measure(wan, tmp_path, capsys, flags, words):
    argv = ["--vae", wan[1], "--data", "clips_dir", "--resolution", str(SIZE), "--output_dir", str(tmp_path)] + flags
    argv = [os.path.join(REPO, a) if a.startswith("configs/") else a for a in argv]
    with pytest.raises(SystemExit) as stopped:
        load_script("eval_vae").main(argv)
    assert words in f"{stopped.value.code}{capsys.readouterr().err}"  # a start-up error, or argparse's
    assert not os.listdir(tmp_path)


def test_training_refuses_rfid_weights_and_input_size_with_clips_and_flicker_on_images(tmp_path):
    from vae_trainer.argument_parser import parse_arguments

    base = ["--vae_config_file", "configs/wan_tiny.json", "--file_list", str(tmp_path), "--max_steps", "1",
            "--device", "cpu", "--output_dir", str(tmp_path / "out")]
    for flags, words in ((["--num_frames", "5", "--inception_weights", "x.pdparams"], "rFVD is not provided"),
                         (["--num_frames", "5", "--input_size", "32", "32"], "clips are encoded at --resolution"),
                         (["--eval_file_list", str(tmp_path), "--eval_steps", "1", "--metric_for_best_model",
                           "flicker"], "flicker is measured on clips"),
                         (["--num_frames", "5", "--video_image_ratio", "1", "--temporal_loss_weight", "0.5"],
                          r"--temporal_loss_weight 0.5: it applies to clips, and every sample is one frame \(--num_"
                          r"frames 1, or --video_image_ratio 1\)"),
                         (["--num_frames", "5", "--video_image_ratio", "1"], None)):  # alone: frames of videos
        if words is None:
            parse_arguments(base + flags)
            continue
        with pytest.raises(ValueError, match=words):
            parse_arguments(base + flags)
    # Weight decay on a loaded video VAE: refused while every sample is one frame, taken on clips (all weights train).
    import shutil

    (tmp_path / "source").mkdir()
    shutil.copy("configs/wan_tiny.json", tmp_path / "source" / "config.json")
    loaded = base[2:] + ["--pretrained_model_name_or_path", str(tmp_path / "source"), "--weight_decay", "0.01"]
    for frames, refused in ((["--num_frames", "5", "--video_image_ratio", "1"], True), ([], True),
                            (["--num_frames", "5", "--video_image_ratio", "0.2"], False)):
        if refused:
            with pytest.raises(ValueError, match="--weight_decay 0.01: it would shrink the loaded temporal weights"):
                parse_arguments(loaded + frames)
        else:
            parse_arguments(loaded + frames)
