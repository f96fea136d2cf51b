"""RGBA data for 4-channel VAEs (issue 52, part 3): the reader keeps the alpha of every source kind and reads an image
without alpha as opaque, counted and logged (a note, not a skip); what LPIPS and the discriminator see of RGBA images;
RGBA PSNR / SSIM and alpha PSNR with their protocol; grids on a checkerboard; the channel count from the family's
geometry and the flags it refuses. Qwen-Image 2.1 trained end to end: tests/test_qwenimage21.py."""

import base64
import functools
import gzip
import io
import logging

import numpy as np
import paddle
import pytest
from conftest import REPO, write_tar
from PIL import Image

from vae_trainer.data.dataset import build_eval_dataloader, build_train_dataloader
from vae_trainer.data.position import OPAQUE, SKIP_REASONS, StreamPosition
from vae_trainer.evaluation import CHECKER_LEVELS, CHECKER_SQUARE, EvalProtocol, make_grid
from vae_trainer.metrics import ALPHA_MSE_FLOOR, psnr, ssim

paddle.set_device("cpu")
RES = 32
QWEN21 = dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
              temperal_downsample=[False, True], scale_factor_spatial=4)


def rgba_pixels(seed: int) -> np.ndarray:
    """uint8 [RES, RES, 4]: noise colours under an alpha ramp from 0 (left column) to 255 (right column)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (RES, RES, 4), dtype=np.uint8)
    pixels[..., 3] = np.round(np.linspace(0, 255, RES))[None, :]
    return pixels


def encoded(image: Image.Image, kind: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


def unit(rgba: np.ndarray) -> np.ndarray:
    """uint8 [H, W, C] -> what the reader gives, float32 [C, H, W] on [-1, 1]."""
    return rgba.transpose(2, 0, 1).astype(np.float32) / 127.5 - 1.0


def read_all(path: str, channels: int) -> np.ndarray:
    return np.concatenate([batch["pixel_values"].numpy()
                           for batch in build_eval_dataloader(path, RES, 8, 0, 1, None, channels=channels)])


@pytest.fixture
def transparent_sources(tmp_path) -> dict:
    """{source: (path, its images as PIL opened them)}: a folder of PNG (RGBA, grey + alpha, a palette with a
    transparent index) and lossless WebP, a LAION part file of base64 PNGs with alpha, a WebDataset shard."""
    images = {"a_rgba.png": Image.fromarray(rgba_pixels(0), "RGBA"),
              "b_la.png": Image.fromarray(rgba_pixels(1)[..., [0, 3]], "LA"),
              "c_palette.png": Image.fromarray(rgba_pixels(2)[..., 0] // 64, "L").convert("P"),
              "d_rgba.webp": Image.fromarray(rgba_pixels(3), "RGBA")}
    options = {"c_palette.png": {"transparency": 1}, "d_rgba.webp": {"lossless": True, "exact": True}}
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, image in images.items():
        (folder / name).write_bytes(encoded(image, name.split(".")[1].upper(), **options.get(name, {})))
    part = tmp_path / "part-00000.gz"
    part.write_bytes(gzip.compress(b"".join(b"caption\t-\t" + base64.b64encode((folder / name).read_bytes()) + b"\n"
                                            for name in ("a_rgba.png", "b_la.png"))))
    (tmp_path / "parts.filelist").write_text("part-00000.gz\n")
    shard = write_tar(tmp_path / "shard.tar", [("000.png", (folder / "a_rgba.png").read_bytes()), ("000.txt", b"x"),
                                               ("001.webp", (folder / "d_rgba.webp").read_bytes())])
    opened = {name: Image.open(folder / name) for name in images}
    return {"folder": (str(folder), list(opened.values())),
            "parts": (str(tmp_path / "parts.filelist"), [opened["a_rgba.png"], opened["b_la.png"]]),
            "tar": (str(shard), [opened["a_rgba.png"], opened["d_rgba.webp"]])}


@pytest.mark.parametrize("source", ["folder", "parts", "tar"])
def test_every_source_keeps_the_alpha_for_four_channels_and_composites_it_on_white_for_three(transparent_sources,
                                                                                              source):
    path, images = transparent_sources[source]
    rgba = [np.asarray(image.convert("RGBA")) for image in images]
    np.testing.assert_array_equal(read_all(path, 4), np.stack([unit(pixels) for pixels in rgba]))
    assert min(pixels[..., 3].min() for pixels in rgba) == 0  # really transparent somewhere
    # 3 channels, as before: the alpha composited on white
    white = [np.asarray(Image.alpha_composite(Image.new("RGBA", (RES, RES), (255,) * 4), Image.fromarray(p)))[..., :3]
             for p in rgba]
    np.testing.assert_allclose(read_all(path, 3), np.stack([unit(pixels) for pixels in white]), rtol=0, atol=1e-6)


def mixed_folder(tmp_path):
    """2 RGBA PNGs, an RGB JPEG and a greyscale PNG: two images without alpha."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.png").write_bytes(encoded(Image.fromarray(rgba_pixels(0), "RGBA")))
    (folder / "b.jpg").write_bytes(encoded(Image.fromarray(rgba_pixels(1)[..., :3]), "JPEG"))
    (folder / "c.png").write_bytes(encoded(Image.fromarray(rgba_pixels(2), "RGBA")))
    (folder / "d.png").write_bytes(encoded(Image.fromarray(rgba_pixels(3)[..., 0], "L")))
    return str(folder)


@pytest.mark.parametrize("channels", [4, 3])
def test_images_without_alpha_are_opaque_counted_logged_and_summarised_not_skipped(tmp_path, caplog, channels):
    from vae_trainer.arguments import VAETrainingArguments
    from vae_trainer.train_logging import TrainMonitor

    loader = build_train_dataloader(mixed_folder(tmp_path), RES, 4, 0, 0, 0, 1, channels=channels, random_flip=False)
    tracker = StreamPosition(0, 1, 0, 1000)
    with caplog.at_level(logging.INFO):
        batch = next(iter(loader))
        tracker.update(batch["position"])
    pixels, position = batch["pixel_values"].numpy(), [int(value) for value in batch["position"]]
    assert pixels.shape == (4, channels, RES, RES)  # all four used: nothing skipped
    counted = dict(zip(SKIP_REASONS, position[3:3 + len(SKIP_REASONS)]))
    assert counted[OPAQUE] == (2 if channels == 4 else 0) and sum(counted.values()) == counted[OPAQUE]
    noted = [r.getMessage() for r in caplog.records if "no alpha channel, read as opaque" in r.getMessage()]
    assert len(noted) == (channels == 4)  # the first one only
    if channels == 4:
        alphas = sorted(np.unique(image[3]).size == 1 and image[3].min() == 1.0 for image in pixels)
        assert alphas == [False, False, True, True]  # the JPEG and the grey PNG: alpha 1 everywhere
    args = VAETrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, logging_steps=1, report_to=[])
    monitor = TrainMonitor(args, global_batch_size=4, is_main_process=True)
    monitor.data_position = tracker
    scalars = monitor.optimizer_step_end(1, {})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        monitor.close()
    assert "data/skipped_opaque" not in scalars and scalars["data/skipped_not_image"] == 0
    assert scalars.get("data/opaque_images") == (2.0 if channels == 4 else None)
    summary = caplog.text
    assert ("data: 2 training images had no alpha channel and were read as opaque" in summary) == (channels == 4)
    assert "data: no training record was skipped" in summary


@pytest.mark.parametrize("channels", [4, 3])
def test_a_four_channel_vaes_clips_are_opaque_rgba_and_counted(tmp_path, channels):
    """Video has no alpha: each frame of a 4-channel VAE's clip is opaque RGBA (counted as an image without alpha is),
    in training and in evaluation; a 3-channel VAE's clips are RGB as before."""
    import av

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width = stream.height = RES
        stream.pix_fmt = "yuv420p"
        for i in range(7):
            frame = np.full((RES, RES, 3), 30 * i, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    batch = next(iter(build_train_dataloader(str(tmp_path), RES, 1, 0, 0, 0, 1, channels=channels, num_frames=5)))
    clip = batch["pixel_values"].numpy()
    assert clip.shape == (1, channels, 5, RES, RES)
    counted = dict(zip(SKIP_REASONS, [int(value) for value in batch["position"]][3:3 + len(SKIP_REASONS)]))
    assert counted[OPAQUE] == (1 if channels == 4 else 0)
    if channels == 4:
        assert np.all(clip[:, 3] == 1.0)  # opaque alpha in every frame
    held_out = next(iter(build_eval_dataloader(str(tmp_path), RES, 1, 0, 1, 1, num_frames=5, channels=channels)))
    assert held_out["pixel_values"].shape[:3] == [1, channels, 5]


# ---- what the objective's RGB networks and the discriminator see

def random_rgba(seed=0, size=16) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).uniform(-1, 1, (2, 4, size, size)).astype(np.float32))


def test_rgb_networks_see_rgba_over_mid_grey_and_the_patchgan_sees_alpha_too():
    from vae_trainer.objectives.gan import discriminator_view
    from vae_trainer.objectives.reconstruction import over_grey

    x = random_rgba()
    a = (x[:, 3:].numpy() + 1) / 2
    composite = over_grey(x).numpy()
    np.testing.assert_allclose(composite, a * x[:, :3].numpy() + (1 - a) * 0.0, rtol=0, atol=1e-7)  # grey: 0
    transparent = paddle.concat([x[:, :3], -paddle.ones_like(x[:, 3:])], axis=1)
    assert np.abs(over_grey(transparent).numpy()).max() == 0  # colour under alpha 0 is not seen
    np.testing.assert_array_equal(discriminator_view(x, 3).numpy(), composite)
    np.testing.assert_array_equal(discriminator_view(x, 4).numpy(), np.concatenate([composite, x[:, 3:]], axis=1))
    rgb = x[:, :3]
    assert over_grey(rgb) is rgb and discriminator_view(rgb, 3) is rgb  # 3 channels: as they are
    # The composite passes gradients to alpha: an error in alpha is an error LPIPS sees.
    x.stop_gradient = False
    over_grey(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy()[:, 3:], x[:, :3].numpy().sum(axis=1, keepdims=True) / 2, atol=1e-6)


def test_a_four_channel_patchgan_and_a_discriminator_path_of_other_channels(tmp_path):
    from vae_trainer.models.discriminator import build_discriminator, init_discriminator_from, save_discriminator
    from vae_trainer.objectives.gan import discriminate

    rgb_config = {"disc_type": "patch", "norm": "batch", "num_layers": 3, "base_channels": 8}
    rgba_config = {**rgb_config, "in_channels": 4}
    disc = build_discriminator(**rgba_config)
    assert disc.main[0].weight.shape[1] == 4 and disc.in_channels == 4
    assert discriminate(disc, random_rgba(size=32)).shape == [2, 1, 2, 2]
    # A conditioned scorer (a distillation's: a functools.partial) is read as its layer: it still sees alpha.
    conditioned = build_discriminator(**rgba_config, condition_channels=2)
    condition = paddle.zeros([2, 2, 4, 4])
    assert discriminate(functools.partial(conditioned, condition=condition), random_rgba(size=32)).shape == [2, 1, 2, 2]
    save_discriminator(build_discriminator(**rgb_config), rgb_config, str(tmp_path / "rgb"))  # saved without the key
    with pytest.raises(ValueError, match=r"image channels it sees \(the VAE's: 4 for RGBA\) 3 \(this run: 4\)"):
        init_discriminator_from(disc, rgba_config, str(tmp_path / "rgb"))


# ---- metrics, protocol, grids

def test_rgba_psnr_ssim_and_alpha_psnr():
    x, y = ((random_rgba(seed) + 1) / 2 for seed in (1, 2))
    xn, yn = x.numpy().astype(np.float64), y.numpy().astype(np.float64)
    expected = 10 * np.log10(1 / ((xn - yn) ** 2).reshape(2, -1).mean(axis=1))  # over all four channels
    np.testing.assert_allclose(psnr(x, y).numpy(), expected, rtol=1e-5)
    alpha_only = 10 * np.log10(1 / ((xn[:, 3] - yn[:, 3]) ** 2).reshape(2, -1).mean(axis=1))
    np.testing.assert_allclose(psnr(x[:, 3:], y[:, 3:], ALPHA_MSE_FLOOR).numpy(), alpha_only, rtol=1e-5)  # as evaluated
    assert not np.allclose(alpha_only, expected, rtol=1e-3)
    same_alpha = paddle.concat([y[:, :3], x[:, 3:]], axis=1)
    np.testing.assert_allclose(psnr(x[:, 3:], same_alpha[:, 3:], ALPHA_MSE_FLOOR).numpy(), [100.0, 100.0],
                               rtol=1e-6)  # the ceiling, not inf
    per_channel = [ssim(x[:, c:c + 1], y[:, c:c + 1]).numpy() for c in range(4)]
    np.testing.assert_allclose(ssim(x, y).numpy(), np.mean(per_channel, axis=0), rtol=1e-5)


def test_the_protocol_states_rgba_only_for_four_channels():
    rgba = EvalProtocol(resolution=32, channels=4, metrics=("psnr", "alpha_psnr", "lpips")).describe()
    assert "psnr and ssim over all four channels" in rgba["channels"] and "mid-grey" in rgba["channels"]
    assert rgba["alpha_psnr"].startswith("10 log10(1 / max(MSE, 1e-10)) per image over the alpha channel alone")
    rgb = EvalProtocol(resolution=32, metrics=("psnr", "lpips")).describe()
    assert "channels" not in rgb and "alpha_psnr" not in rgb


def test_grids_show_rgba_on_a_checkerboard_and_rgb_as_before():
    colour = np.array([-0.5, 0.0, 0.5], np.float32)
    images = np.broadcast_to(colour[None, :, None, None], (2, 3, 24, 24)).copy()
    alpha = np.full((2, 1, 24, 24), -1.0, np.float32)  # transparent
    alpha[1] = 1.0  # the second image opaque
    grid = make_grid(np.concatenate([images, alpha], axis=1), np.concatenate([images, -alpha], axis=1), 2)
    assert grid.shape == (48, 48, 3) and grid.dtype == np.uint8
    light, dark = (round((level + 1) * 127.5) for level in CHECKER_LEVELS)
    square = CHECKER_SQUARE
    assert (grid[0, 0] == light).all() and (grid[0, square] == dark).all() and (grid[square, square] == light).all()
    opaque = np.round((colour + 1) * 127.5)
    assert (grid[0, 24] == opaque).all() and (grid[24, 0] == opaque).all()  # input 2 opaque, reconstruction 1 opaque
    assert (grid[24, 24 + square] == dark).all()  # reconstruction 2 transparent
    recons = np.random.default_rng(0).uniform(-1.2, 1.2, images.shape).astype(np.float32)
    rows = [np.concatenate(list(np.round((np.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8).transpose(0, 2, 3, 1)),
                           axis=1) for x in (images, recons)]  # the grid of RGB images before RGBA existed
    np.testing.assert_array_equal(make_grid(images, recons, 2), np.concatenate(rows, axis=0))


# ---- the channel count: the family's geometry, and what it refuses

def test_geometry_channels_count_image_channels_not_patchified_ones():
    from vae_trainer.models.families import family_for_config

    wan22 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], is_residual=True, patch_size=2, in_channels=12,
                 out_channels=12)  # (tests/test_wan.py's TINY_WAN22, shortened)

    def channels(config, class_name=None):
        config = {**config, **({"_class_name": class_name} if class_name else {})}
        return family_for_config(config).geometry(config).channels

    assert channels(wan22) == 3 and channels({**QWEN21, "input_channels": 3}) == 3  # Wan 2.2: RGB in 2x2 patches
    assert channels(QWEN21, "AutoencoderKLQwenImage21") == 4
    patched = {**QWEN21, "patch_size": 2, "in_channels": 16, "out_channels": 16}
    assert channels(patched, "AutoencoderKLQwenImage21") == 4


def test_alpha_psnr_as_the_best_model_metric_needs_an_rgba_vae(tmp_path):
    import json

    from vae_trainer.argument_parser import parse_arguments

    config = tmp_path / "q21.json"
    config.write_text(json.dumps({"_class_name": "AutoencoderKLQwenImage21", **QWEN21}))
    flags = ["--file_list", "x", "--max_steps", "1", "--output_dir", str(tmp_path / "o"), "--resolution", "32",
             "--eval_file_list", "y", "--eval_steps", "1", "--metric_for_best_model", "alpha_psnr"]
    parse_arguments(flags + ["--vae_config_file", str(config)])
    with pytest.raises(ValueError, match="alpha_psnr is measured for VAEs of RGBA images .4 channels., and this one "
                                         "takes RGB"):
        parse_arguments(flags + ["--vae_config_file", f"{REPO}/configs/vae_micro.json"])
