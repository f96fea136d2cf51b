"""Fine-tuning the Wan / Qwen-Image VAEs on video clips, end to end (issue 43): mp4 clips written at test time
(scripts/make_demo_clips.py: pans and zooms over photos), a tiny Qwen-Image-layout VAE made by diffusers 0.42.1,
decoder-only with the temporal term, a 3-D PatchGAN, images mixed in and clip evaluation, by both entry points;
the export in diffusers' own class; resume. The reader's rules are tests/test_clips.py's, the objective's
tests/test_clip_losses.py's, the metrics' tests/test_clip_eval.py's: here, the trainer around them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import DRIVERS, load_script, read_scalars, run_entry_point, run_in_process
from family_parity import DiffusersBatch, make_in_diffusers, mean_psnr, trainer_args
from safetensors.numpy import load_file

from vae_trainer.models.vae_loading import build_vae

TINY_QWEN = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                 latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
TORCH_WEIGHTS = "diffusion_pytorch_model.safetensors"
FRAMES = 5


def _photos(folder, names) -> str:
    import skimage.data
    from PIL import Image

    folder.mkdir()
    for name in names:  # a file of skimage's data folder, or one of its loaders
        photo = (Image.open(os.path.join(os.path.dirname(skimage.data.__file__), name)) if "." in name
                 else Image.fromarray(getattr(skimage.data, name)()))
        photo.convert("RGB").save(folder / f"{name.split('.')[0]}.png")
    return str(folder)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    """{train: 8 H.264 clips of 13 frames at 40 px (a keyframe every 6) beside 2 photos; eval: 3 clips of 9 frames
    at 32 px of other photos}."""
    root = tmp_path_factory.mktemp("clip_data")
    make = load_script("make_demo_clips").main
    train = _photos(root / "train", ("astronaut", "chelsea"))  # the photos stay: images mixed in
    make(["--image_dir", _photos(root / "train_photos", ("coffee", "rocket", "astronaut", "chelsea")),
          "--output_dir", train, "--num_clips", "8", "--frames", "13", "--size", "40", "--keyframe_interval", "6",
          "--seed", "1"])
    make(["--image_dir", _photos(root / "eval_photos", ("motorcycle_left.png", "hubble_deep_field.jpg")), "--output_dir",
          str(root / "eval"), "--num_clips", "3", "--frames", "9", "--size", "32", "--seed", "2"])
    return {"train": train, "eval": str(root / "eval")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A pipeline download whose vae/ is a tiny Qwen-Image-layout VAE diffusers made with seeded weights."""
    root = tmp_path_factory.mktemp("clip_source")
    make_in_diffusers("AutoencoderKLQwenImage", root / "vae", TINY_QWEN, seed=3)
    return str(root)


def clip_args(data: dict, source: str, output_dir, **overrides) -> list[str]:
    """Decoder-only on 5-frame clips 2 frames apart (a quarter single frames), the temporal term, LPIPS on 2 frames
    of each clip, a 3-D PatchGAN from step 2, clip evaluation every 2 steps: 4 steps at 32 px."""
    flags = dict(pretrained_model_name_or_path=source, subfolder="vae", freeze_encoder="true", num_frames=FRAMES,
                 frame_stride=2, video_image_ratio=0.25, temporal_loss_weight=0.5, lpips_num_frames=2,
                 disc_type="patchgan3d", disc_weight_warmup_steps=0, eval_file_list=data["eval"], eval_steps=2,
                 eval_num_images=3, image_logging_steps=2, save_steps=2)
    return trainer_args(data["train"], output_dir, **{**flags, **overrides})


@pytest.fixture(scope="module")
def runs(clips, source, tmp_path_factory) -> dict:
    """{driver: output folder} of both entry points on the same flags, and "resumed": the loop resumed at step 2
    from a copy of the Trainer's checkpoint-2."""
    out = {}
    for driver in DRIVERS:
        out[driver] = str(tmp_path_factory.mktemp(f"clips_{driver.split('.')[0]}"))
        run_in_process(driver, clip_args(clips, source, out[driver]))
    resumed = tmp_path_factory.mktemp("clips_resumed")
    shutil.copytree(os.path.join(out[DRIVERS[0]], "checkpoint-2"), resumed / "checkpoint-2")
    run_in_process(DRIVERS[1], clip_args(clips, source, str(resumed), resume_from_checkpoint="latest"))
    out["resumed"] = str(resumed)
    return out


def test_both_drivers_train_on_clips_to_the_same_numbers_and_resume_exactly(runs):
    trainer, loop = runs[DRIVERS[0]], runs[DRIVERS[1]]
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/temporal", "loss/kl", "loss/discriminator",
                "eval/psnr", "eval/flicker", "eval/psnr_position_4"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    # Clips and single frames both came: the temporal term is logged on clip batches only.
    assert 0 < len(read_scalars(os.path.join(loop, "logs"), "loss/temporal")) < 4
    for other in (loop, runs["resumed"]):
        wa, wb = weights(os.path.join(trainer, "vae")), weights(os.path.join(other, "vae"))
        assert wa.keys() == wb.keys()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=f"{other}: {name}")


def weights(folder) -> dict:
    return load_file(os.path.join(folder, TORCH_WEIGHTS))


def test_clips_train_the_decoder_s_temporal_weights_and_leave_the_encoder(runs, source):
    source_dir = os.path.join(source, "vae")
    before, after = weights(source_dir), weights(os.path.join(runs[DRIVERS[1]], "vae"))
    changed = {name for name in before if not np.array_equal(after[name], before[name])}
    assert changed and all(name.startswith(("decoder.", "post_quant_conv.")) for name in changed)
    # What images never reach, clips do: the decoder's time_convs and earlier-frame taps moved.
    video_only = build_vae(os.path.join(source_dir, "config.json")).video_only_weights()
    moved = [w.name for w in video_only if not np.array_equal(w.part(after[w.name]), w.part(before[w.name]))]
    assert any(".time_conv." in name for name in moved) and all(name.startswith("decoder.") for name in moved)
    config = json.load(open(os.path.join(runs[DRIVERS[1]], "vae", "config.json")))
    assert {k: config[k] for k in ("latents_mean", "latents_std")} == \
        {k: TINY_QWEN[k] for k in ("latents_mean", "latents_std")}


def test_clip_evaluation_is_recorded_with_its_protocol(runs):
    records = [json.loads(line) for line in open(os.path.join(runs[DRIVERS[0]], "eval_metrics.jsonl"))]
    metrics = records[-1]["metrics"]
    assert {"psnr", "ssim", "lpips", "flicker", *(f"psnr_position_{p}" for p in range(5))} <= set(metrics)
    assert 0 < metrics["flicker"] < 1 and records[-1]["num_images"] == 3
    assert "clips" in json.dumps(records[-1]["protocol"])


@pytest.fixture(scope="module")
def improved(clips, source, tmp_path_factory) -> str:
    """The output folder of 8 decoder-only steps on clips, pixel-led (LPIPS at 0.1, no GAN, no EMA)."""
    output_dir = str(tmp_path_factory.mktemp("clips_improved"))
    run_in_process(DRIVERS[1], clip_args(clips, source, output_dir, max_steps=8, disc_start=100, disc_type=None,
                                         perceptual_weight=0.1, use_ema=None, ema_decay=None, eval_file_list=None,
                                         eval_steps=None, eval_num_images=None, save_steps=0))
    return output_dir


def test_the_export_improves_held_out_clips_in_diffusers_as_eval_vae_says(improved, clips, source, tmp_path):
    eval_vae = load_script("eval_vae").main
    flags = ["--data", clips["eval"], "--resolution", "32", "--num_frames", str(FRAMES), "--frame_stride", "2",
             "--num_images", "3", "--skip_lpips"]
    vae_dir = os.path.join(improved, "vae")
    before = eval_vae(["--vae", os.path.join(source, "vae"), *flags, "--output_dir", str(tmp_path / "before")])
    after = eval_vae(["--vae", vae_dir, *flags, "--output_dir", str(tmp_path / "after")])
    assert after.metrics["psnr"] > before.metrics["psnr"] + 0.2  # measured: 10.22 -> 10.62 dB
    assert after.metrics["flicker"] < 0.75 * before.metrics["flicker"]  # 0.197 -> 0.108
    # diffusers' own class decodes the held-out clips as our evaluation measured.
    from vae_trainer.data.dataset import build_eval_dataloader

    x = np.concatenate([batch["pixel_values"].numpy() for batch in build_eval_dataloader(
        clips["eval"], 32, 3, 0, 1, 3, num_frames=FRAMES, frame_stride=2)])
    assert x.shape == (3, 3, FRAMES, 32, 32)
    batch = DiffusersBatch(tmp_path)
    theirs = batch.run("AutoencoderKLQwenImage", vae_dir, x, tmp_path)
    batch.flush()
    as_frames = lambda clip: clip.transpose(0, 2, 1, 3, 4).reshape(-1, 3, 32, 32)  # noqa: E731
    assert after.metrics["psnr"] == pytest.approx(mean_psnr(as_frames(theirs()["decoded"]), as_frames(x)), abs=1e-3)


def test_two_processes_train_on_clips_and_single_frames_meeting_in_one_step(clips, source, tmp_path):
    """Batch 1 per rank and a half of the samples single frames: in some steps one rank decodes a clip while the
    other decodes a frame, whose pass leaves the decoder's time_convs without a gradient. Both ranks must still
    all-reduce the same buffers (they did not: gloo aborted) and stay in sync (checked at each checkpoint)."""
    output_dir = tmp_path / "two"
    flags = clip_args(clips, source, str(output_dir), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                      video_image_ratio=0.5, max_steps=4, save_steps=2, eval_file_list=None, eval_steps=None,
                      eval_num_images=None, lpips_num_frames=None, dataloader_num_workers=1)
    run_entry_point(DRIVERS[1], flags, nproc=2, log_dir=tmp_path / "launch")
    before, after = weights(os.path.join(source, "vae")), weights(output_dir / "vae")
    changed = {name for name in before if not np.array_equal(after[name], before[name])}
    assert any(".time_conv." in name for name in changed)
    assert all(name.startswith(("decoder.", "post_quant_conv.")) for name in changed)


def test_a_gradient_is_zero_filled_only_where_another_rank_has_one(monkeypatch):
    """AdamW skips a parameter without a gradient but moves one with a zero gradient (its momentum): a parameter no
    rank has a gradient for must stay without one, as on a single process."""
    import paddle

    from vae_trainer import distributed

    sent = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "fused_allreduce_gradients", lambda parameters, _: sent.append(parameters))
    # The other rank holds a gradient for b alone.
    monkeypatch.setattr(distributed, "sum_over_ranks", lambda flags: flags + paddle.to_tensor([0, 1, 0], "int32"))
    a, b, c = (paddle.create_parameter([2], "float32") for _ in range(3))
    (a * 2).sum().backward()
    distributed.sync_gradients([a, b, c], fill_missing=True)
    assert sent == [[a, b]] and b.grad.numpy().tolist() == [0.0, 0.0] and c.grad is None
    assert a.grad.numpy().tolist() == [2.0, 2.0]
