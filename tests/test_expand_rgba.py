"""--expand_to_rgba (vae_trainer/models/rgba.py): an RGB VAE grown to RGBA before training. At step 0 an opaque image
(alpha +1 on [-1, 1]) has the source's latents and decodes to the source's RGB with an opaque alpha, in every family
that grows; a frozen encoder keeps the source's latents through training; both entry points train the same weights;
PyTorch diffusers 0.42.1 loads the export as the source's class with 4 channels and no key missing or unexpected; the
flag is refused where it cannot apply. The training runs read RGB photos, which the reader gives a 4-channel VAE as
opaque RGBA (tests/test_rgba.py); the step's own batches are made here (`with_opaque_alpha`)."""

import json
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, run_in_process
from family_parity import DiffusersBatch, assert_loaded_exactly, random_images
from ppdiffusers import AutoencoderKL
from safetensors.numpy import load_file
from test_autoencoder_dc import CONFIGS as DC_CONFIGS
from test_autoencoder_kl_hunyuanvideo15 import TINY as TINY_HUNYUAN15
from test_autoencoder_kl_ltx2 import TINY as TINY_LTX2
from test_dc_ae import TINY_DC
from test_flux2 import TINY_FLUX2
from test_step import make_args
from test_wan import TINY_QWEN, TINY_WAN22

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.arguments import LossArguments, ModelArguments
from vae_trainer.build import build_networks, build_optimization
from vae_trainer.models.families import family_for_config, family_of
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae

paddle.set_device("cpu")
with open(os.path.join(REPO, "configs", "vae_micro.json")) as handle:
    MICRO = {k: v for k, v in json.load(handle).items() if not k.startswith("_")}
FLUX_LIKE = dict(MICRO, latent_channels=8, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                 shift_factor=0.1159)
# name: (class, config, image size, latents bit for bit at step 0). LTX-2's 4x4 patches make its first conv's sum run
# over 64 channels instead of 48 (x 9 taps), which Paddle's CPU GEMM blocks otherwise: float rounding there.
CASES = {
    "sd": ("AutoencoderKL", MICRO, 32, True),
    "flux": ("AutoencoderKL", FLUX_LIKE, 32, True),
    "flux2": ("AutoencoderKLFlux2", TINY_FLUX2, 32, True),
    "dc_ae": ("AutoencoderDC", TINY_DC, 32, True),
    "dc_ae_in_mix": ("AutoencoderDC", DC_CONFIGS["in_mix"], 32, True),  # pixel (un)shuffled first and last convs
    "qwen_image": ("AutoencoderKLQwenImage", TINY_QWEN, 32, True),
    "wan22": ("AutoencoderKLWan", TINY_WAN22, 32, True),  # 2x2 patches: 12 -> 16 channels in and out
    "ltx2": ("AutoencoderKLLTX2Video", TINY_LTX2, 64, False),
    "hunyuan15": ("AutoencoderKLHunyuanVideo15", TINY_HUNYUAN15, 32, True),
}
VIDEO = ("qwen_image", "wan22", "ltx2", "hunyuan15")  # diffusers takes their images as one-frame clips
DIFFUSERS_CASES = ("flux", "flux2", "dc_ae_in_mix", "qwen_image", "wan22", "ltx2", "hunyuan15")
ATOL = 1e-5  # PyTorch's step 0 against its source: float rounding (its CPU convs sum the longer rows otherwise)


def with_opaque_alpha(rgb: np.ndarray) -> np.ndarray:
    """NCHW (or NCTHW) RGB on [-1, 1] with an alpha channel of +1: opaque."""
    return np.concatenate([rgb, np.ones_like(rgb[:, :1])], axis=1)


def paddle_source(folder, case: str, seed: int = 0) -> str:
    """A ppdiffusers folder of CASES[case] whose every weight is seeded noise off its initialisation (no zero bias)."""
    class_name, config, _, _ = CASES[case]
    config = {**config, "_class_name": class_name}
    paddle.seed(seed)
    vae = family_for_config(config).build(config, case)
    rng = np.random.default_rng(seed)
    for param in vae.parameters():
        value = param.numpy()
        param.set_value(value + rng.normal(0, 0.05, value.shape).astype(value.dtype))
    vae.save_pretrained(str(folder))
    return str(folder)


def encoded(vae, rgb: np.ndarray):
    """The posterior (in eval mode, no graph) of NCHW images."""
    with paddle.no_grad():
        return family_of(vae).encode(vae.eval(), paddle.to_tensor(rgb))


def decoded(vae, latents) -> np.ndarray:
    with paddle.no_grad():
        return family_of(vae).decode(vae.eval(), latents).numpy()


# ---- step 0, every family that grows

@pytest.mark.parametrize("case", CASES)
def test_at_step_0_an_opaque_image_has_the_sources_latents_and_rgb_and_decodes_opaque(case, tmp_path):
    folder = paddle_source(tmp_path / "source", case)
    source = build_vae(pretrained_model_name_or_path=folder)
    grown = build_vae(pretrained_model_name_or_path=folder, expand_to_rgba=True)
    assert type(grown) is type(source) and family_of(grown).geometry(grown.config).channels == 4
    rgb = random_images(2, CASES[case][2], seed=1)
    theirs, ours = encoded(source, rgb), encoded(grown, with_opaque_alpha(rgb))
    for name in ("mean", "logvar"):
        if getattr(theirs, name) is None:  # a deterministic encoder (DC-AE)
            continue
        if CASES[case][3]:
            np.testing.assert_array_equal(getattr(ours, name).numpy(), getattr(theirs, name).numpy(), err_msg=name)
        else:
            np.testing.assert_allclose(getattr(ours, name).numpy(), getattr(theirs, name).numpy(), rtol=0, atol=1e-5)
    rgba = decoded(grown, theirs.mode())  # the expanded decoder on the source's latents
    np.testing.assert_array_equal(rgba[:, :3], decoded(source, theirs.mode()))
    assert rgba.shape[1] == 4 and np.all(rgba[:, 3] == 1.0)
    save_vae(grown, str(tmp_path / "export"))  # the export reloads as it is: every weight in its place
    reloaded = build_vae(pretrained_model_name_or_path=str(tmp_path / "export"))
    np.testing.assert_array_equal(decoded(reloaded, theirs.mode()), rgba)


@pytest.mark.parametrize("case", ["flux", "dc_ae_in_mix", "wan22"])
def test_a_frozen_encoder_keeps_the_sources_latents_bit_for_bit_while_the_decoder_trains(case, tmp_path):
    folder, size = paddle_source(tmp_path / "source", case), CASES[case][2]
    loss_args = LossArguments(perceptual_weight=0.0, disc_weight=0.0)
    training_args = make_args(tmp_path / "run", learning_rate=1e-3)
    networks = build_networks(ModelArguments(pretrained_model_name_or_path=folder, expand_to_rgba=True,
                                             freeze_encoder=True, disc_base_channels=8), loss_args, training_args,
                              resolution=size)
    step, vae = build_optimization(networks, loss_args, training_args), networks.model.vae
    last = family_of(vae).image_convs(vae).last
    before = last.weight.numpy()
    for k in range(3):
        step.forward_backward(paddle.to_tensor(with_opaque_alpha(random_images(2, size, seed=10 + k))), k, 0)
        step.optimizer_step(global_step=k)
    assert not np.array_equal(last.weight.numpy(), before)  # the decoder trained
    rgb = random_images(2, size, seed=9)
    theirs = encoded(build_vae(pretrained_model_name_or_path=folder), rgb)
    np.testing.assert_array_equal(encoded(vae, with_opaque_alpha(rgb)).mean.numpy(), theirs.mean.numpy())
    assert np.all(decoded(vae, theirs.mode())[:, 3] == 1.0)  # opaque targets: nothing moves the alpha off +1


# ---- both entry points, the export in ppdiffusers and PyTorch diffusers

@pytest.fixture(scope="module")
def diffusers_sources(tmp_path_factory) -> dict:
    """{case: a seeded folder made by diffusers 0.42.1}: the PyTorch layout users download."""
    root = tmp_path_factory.mktemp("diffusers_sources")
    batch = DiffusersBatch(root)
    for case in DIFFUSERS_CASES:
        batch.make(CASES[case][0], root / case, CASES[case][1], seed=3)
    batch.flush()
    return {case: str(root / case) for case in DIFFUSERS_CASES}


def run_flags(source: str, file_list: str, output_dir: str) -> list:
    """Three decoder-only steps of `source` grown to RGBA at 32 px on CPU, with the EMA, LPIPS, the GAN from step 2
    and an evaluation."""
    flags = {"pretrained_model_name_or_path": source, "file_list": file_list, "output_dir": output_dir,
             "resolution": 32, "per_device_train_batch_size": 2, "max_steps": 3, "save_steps": 3, "logging_steps": 1,
             "image_logging_steps": 2, "seed": 7, "device": "cpu", "dataloader_num_workers": 0,
             "learning_rate": 1e-3, "disable_tqdm": "true", "use_ema": "true", "ema_decay": 0.9,
             "disc_start": 2, "disc_base_channels": 8, "disc_num_layers": 2,  # the RGBA objective: LPIPS, GAN
             "eval_file_list": file_list, "eval_steps": 3, "eval_num_images": 2}
    return [str(item) for key, value in flags.items() for item in (f"--{key}", value)] + ["--expand_to_rgba",
                                                                                          "--freeze_encoder"]


@pytest.fixture(scope="module")
def trained(diffusers_sources, photo_filelist, tmp_path_factory) -> dict:
    """{driver: output dir} of run_flags on the FLUX-shaped diffusers source (RGB photos, read as opaque RGBA)."""
    out = {}
    for driver in DRIVERS:
        out[driver] = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        run_in_process(driver, run_flags(diffusers_sources["flux"], photo_filelist, out[driver]))
    return out


def test_the_grown_vae_is_evaluated_as_rgba_with_its_alpha_psnr_alike_by_both_entry_points(trained):
    records = [json.loads(open(os.path.join(trained[driver], "eval_metrics.jsonl")).readlines()[-1])
               for driver in DRIVERS]
    for record in records:  # opaque photos: alpha near +1 from the start (the grown conv's bias), so well above 20 dB
        assert record["step"] == 3 and record["metrics"]["alpha_psnr"] > 20 and 0 < record["metrics"]["lpips"] < 1
        assert record["protocol"]["channels"].startswith("RGBA")
    assert records[0]["metrics"]["alpha_psnr"] == pytest.approx(records[1]["metrics"]["alpha_psnr"], abs=1e-4)


def test_both_entry_points_train_the_same_weights_and_keep_the_sources_latents(trained, diffusers_sources):
    exports = [load_file(os.path.join(trained[driver], "vae", "diffusion_paddle_model.safetensors"))
               for driver in DRIVERS]
    assert exports[0].keys() == exports[1].keys()
    for name in exports[0]:
        np.testing.assert_array_equal(exports[0][name], exports[1][name], err_msg=name)
    vae = AutoencoderKL.from_pretrained(os.path.join(trained[DRIVERS[0]], "vae"))  # ppdiffusers' own class
    assert (vae.config.in_channels, vae.config.out_channels) == (4, 4)
    source = build_vae(pretrained_model_name_or_path=diffusers_sources["flux"])
    rgb = random_images(2, 32, seed=4)
    theirs = encoded(source, rgb)
    np.testing.assert_array_equal(encoded(vae, with_opaque_alpha(rgb)).mean.numpy(), theirs.mean.numpy())
    assert not np.array_equal(decoded(vae, theirs.mode())[:, :3], decoded(source, theirs.mode()))  # it trained


def diffusers_input(case: str, rgb: np.ndarray) -> np.ndarray:
    return rgb[:, :, None] if case in VIDEO else rgb


@pytest.fixture(scope="module")
def diffusers_outputs(diffusers_sources, trained, tmp_path_factory) -> dict:
    """{case: (diffusers' outputs of the source on RGB, of its step-0 RGBA export on the same images made opaque,
    the export folder)}; "trained": the trainer's export against the FLUX-shaped source. One diffusers process."""
    root = tmp_path_factory.mktemp("diffusers_runs")
    batch, runs = DiffusersBatch(root), {}
    for case, source in diffusers_sources.items():
        export = str(root / f"{case}_rgba")
        save_vae(build_vae(pretrained_model_name_or_path=source, expand_to_rgba=True), export)
        rgb = diffusers_input(case, random_images(1, CASES[case][2], seed=2))  # HunyuanVideo 1.5 takes batches of 1
        for work in ("rgb", "rgba"):
            os.makedirs(root / case / work)
        runs[case] = (batch.run(CASES[case][0], source, rgb, root / case / "rgb"),
                      batch.run(CASES[case][0], export, with_opaque_alpha(rgb), root / case / "rgba"), export)
    export, rgba = os.path.join(trained[DRIVERS[0]], "vae"), with_opaque_alpha(random_images(1, 32, seed=2))
    os.makedirs(root / "trained")
    runs["trained"] = (runs["flux"][0], batch.run("AutoencoderKL", export, rgba, root / "trained"), export)
    batch.flush()
    return {case: (source(), grown(), export) for case, (source, grown, export) in runs.items()}


@pytest.mark.parametrize("case", DIFFUSERS_CASES)
def test_diffusers_loads_the_step_0_export_as_its_class_with_4_channels_and_the_sources_outputs(case,
                                                                                              diffusers_outputs):
    source, grown, export = diffusers_outputs[case]
    assert_loaded_exactly(grown, CASES[case][0])  # no key missing, unexpected or of another shape than its config's
    with open(os.path.join(export, "config.json")) as handle:
        config = json.load(handle)
    assert family_for_config(config).geometry(config).channels == 4
    np.testing.assert_allclose(grown["latent"], source["latent"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(grown["decoded"][:, :3], source["decoded"], rtol=0, atol=ATOL)
    assert np.all(grown["decoded"][:, 3] == 1.0)


def test_diffusers_reads_the_trained_frozen_encoders_latents_as_the_sources(diffusers_outputs):
    source, grown, _ = diffusers_outputs["trained"]
    assert_loaded_exactly(grown, "AutoencoderKL")
    np.testing.assert_allclose(grown["latent"], source["latent"], rtol=0, atol=ATOL)
    assert np.abs(grown["decoded"][:, :3] - source["decoded"]).max() > 1e-3  # its decoder trained


# ---- refusals

def parse(*flags):
    return parse_arguments(["--file_list", "x.filelist", "--max_steps", "2", "--output_dir", "/tmp/vae_trainer_args",
                            "--expand_to_rgba", *flags])


def folder_of(folder, config: dict) -> str:
    """A folder whose config.json is `config` (parse-time checks read no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("config, reason", [
    ({"_class_name": "AutoencoderKLQwenImage21"}, "this AutoencoderKLQwenImage21 does not take 3"),
    (dict(MICRO, in_channels=4, out_channels=4), "this AutoencoderKL does not take 3"),
    ({"_class_name": "AutoencoderRAE"}, "AutoencoderRAE cannot be grown to RGBA: its latent is a frozen DINOv2's"),
    ({"_class_name": "AutoencoderTiny"}, "AutoencoderTiny cannot be grown to RGBA: it is a distillation student"),
])
def test_a_vae_that_is_not_rgb_or_whose_layers_cannot_grow_is_refused_with_the_reason(config, reason, tmp_path):
    with pytest.raises(ValueError, match=f"--expand_to_rgba true: .*{reason}"):
        parse("--pretrained_model_name_or_path", folder_of(tmp_path, config))


def test_a_vae_from_scratch_is_refused_and_rgb_sources_accepted_with_the_rgba_objective(tmp_path):
    with pytest.raises(ValueError, match="a VAE trained from scratch has none"):
        parse("--vae_config_file", "configs/vae_micro.json")
    micro = folder_of(tmp_path, MICRO)
    # LPIPS (on by default), the GAN and alpha_psnr, a metric of RGBA VAEs, take the VAE it makes
    model_args = parse("--pretrained_model_name_or_path", micro, "--disc_start", "1", "--eval_file_list", "x",
                       "--eval_steps", "1", "--metric_for_best_model", "alpha_psnr")[0]
    assert model_args.expand_to_rgba is True
    with pytest.raises(ValueError, match="alpha_psnr is measured for VAEs of RGBA images"):
        parse_arguments(["--file_list", "x", "--max_steps", "2", "--output_dir", "/tmp/vae_trainer_args",
                         "--pretrained_model_name_or_path", micro, "--eval_file_list", "x", "--eval_steps", "1",
                         "--metric_for_best_model", "alpha_psnr"])
    wan22 = folder_of(tmp_path / "wan22", {"_class_name": "AutoencoderKLWan", **TINY_WAN22})  # 12 = 3 x 2 x 2
    assert parse("--pretrained_model_name_or_path", wan22)[0].expand_to_rgba is True
