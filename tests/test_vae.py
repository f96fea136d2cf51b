"""VAE builder: the shipped configs, local-only loading, save/load round trips, error messages."""

import json
import os
import shutil
import warnings
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from ppdiffusers import AutoencoderKL

from vae_trainer.models.latent_scale import decide, origin_of, scaling_factor_mode
from vae_trainer.models.families import family_of
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# Parameter count of the Stable Diffusion f8c4 VAE (diffusers AutoencoderKL, SD 1.x/2.x, SDXL).
SD_VAE_PARAMETERS = 83_653_863

paddle.set_device("cpu")


def config_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"{name}.json")


def num_parameters(model) -> int:
    return sum(int(np.prod(p.shape)) for p in model.parameters())


def fixed_latents(vae, size: int) -> paddle.Tensor:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.standard_normal((1, vae.config.latent_channels, size // factor, size // factor)).astype("float32"))


@pytest.mark.parametrize("name, size, factor", [("vae_micro", 32, 2), ("vae_tiny", 64, 4)])
def test_small_configs_encode_and_decode(name, size, factor):
    vae = build_vae(config_path(name))
    assert vae.config.sample_size == size
    x = paddle.rand([2, 3, size, size]) * 2 - 1
    posterior = vae.encode(x).latent_dist
    assert list(posterior.mean.shape) == [2, 4, size // factor, size // factor]
    assert list(vae.decode(posterior.sample()).sample.shape) == [2, 3, size, size]


def test_micro_is_smaller_than_tiny_and_keeps_two_down_blocks():
    micro, tiny = build_vae(config_path("vae_micro")), build_vae(config_path("vae_tiny"))
    assert len(micro.config.down_block_types) == 2
    assert num_parameters(micro) < num_parameters(tiny) / 10


def test_sd_config_is_the_stable_diffusion_architecture():
    vae = build_vae(config_path("sd_vae"))
    assert num_parameters(vae) == SD_VAE_PARAMETERS
    assert vae.config.scaling_factor == 0.18215 and vae.config.sample_size == 512


def test_sdxl_config_differs_from_sd_only_in_scaling_and_upcast():
    with open(config_path("sd_vae")) as a, open(config_path("sdxl_vae")) as b:
        sd, sdxl = json.load(a), json.load(b)
    differing = {k for k in sd.keys() | sdxl.keys() if sd.get(k) != sdxl.get(k)}
    assert differing <= {"scaling_factor", "force_upcast", "sample_size"}
    assert sdxl["scaling_factor"] == 0.13025 and sdxl["force_upcast"] is True


def test_flux_config_has_sixteen_latent_channels_and_no_quant_convs():
    vae = build_vae(config_path("flux_vae"))
    assert vae.quant_conv is None and vae.post_quant_conv is None
    assert vae.encoder.conv_out.weight.shape[0] == 2 * 16  # mean and log-variance
    assert vae.decoder.conv_in.weight.shape[1] == 16
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)


def test_save_and_from_pretrained_round_trip(tmp_path):
    vae = build_vae(config_path("vae_micro"))
    vae.eval()
    save_vae(vae, str(tmp_path), scaling_factor=0.5, shift_factor=0.25)
    loaded = AutoencoderKL.from_pretrained(str(tmp_path), local_files_only=True)
    loaded.eval()
    z = fixed_latents(vae, 32)
    np.testing.assert_array_equal(loaded.decode(z).sample.numpy(), vae.decode(z).sample.numpy())
    assert (loaded.config.scaling_factor, loaded.config.shift_factor) == (0.5, 0.25)


def test_pretrained_subfolder_and_saved_config_as_config_file(tmp_path):
    vae = build_vae(config_path("vae_micro"))
    vae.eval()
    save_vae(vae, str(tmp_path / "vae"))
    loaded = build_vae(pretrained_model_name_or_path=str(tmp_path), subfolder="vae")
    loaded.eval()
    z = fixed_latents(vae, 32)
    np.testing.assert_array_equal(loaded.decode(z).sample.numpy(), vae.decode(z).sample.numpy())
    # A checkpoint's vae/config.json describes the same architecture when used as --vae_config_file.
    fresh = build_vae(str(tmp_path / "vae" / "config.json"))
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in vae.state_dict().items()}


def test_a_ppdiffusers_folder_with_pdparams_weights_loads(tmp_path):
    """The older ppdiffusers format (model_state.pdparams, e.g. PaddleNLP community weights)."""
    vae = build_vae(config_path("vae_micro"))
    vae.eval()
    vae.save_pretrained(str(tmp_path), safe_serialization=False)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model_state.pdparams"]
    loaded = build_vae(pretrained_model_name_or_path=str(tmp_path))
    loaded.eval()
    z = fixed_latents(vae, 32)
    np.testing.assert_array_equal(loaded.decode(z).sample.numpy(), vae.decode(z).sample.numpy())


def test_decoder_last_layer_is_the_output_conv_and_receives_gradients():
    vae = build_vae(config_path("vae_micro"))
    weight = family_of(vae).last_layers(vae)[0]
    assert weight is vae.decoder.conv_out.weight and weight.shape[0] == 3
    (grad,) = paddle.grad(vae.decode(fixed_latents(vae, 32)).sample.mean(), [weight])
    assert grad.abs().sum().item() > 0


def test_nothing_loadable_gives_one_error_naming_the_folder_and_the_files(tmp_path):
    with pytest.raises(ValueError, match="Give a VAE source"):
        build_vae()
    with pytest.raises(FileNotFoundError, match="local folder"):
        build_vae(pretrained_model_name_or_path="stabilityai/sd-vae-ft-mse")  # a hub id: never downloaded
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as error:
        build_vae(pretrained_model_name_or_path=str(tmp_path / "empty"))
    message = str(error.value)
    assert str(tmp_path / "empty") in message
    for name in ("config.json", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                 "diffusion_paddle_model.safetensors", "model_state.pdparams", "fp16"):
        assert name in message
    save_vae(build_vae(config_path("vae_micro")), str(tmp_path / "vae"))
    with pytest.raises(FileNotFoundError, match="--subfolder vae"):
        build_vae(pretrained_model_name_or_path=str(tmp_path))  # forgot subfolder="vae"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_vae(str(tmp_path / "missing.json"))
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_vae(pretrained_model_name_or_path=str(tmp_path / "weights_only"))


def test_common_mistakes_with_the_weight_sources_are_refused_with_the_fix(tmp_path):
    import re

    folder = tmp_path / "vae"
    save_vae(build_vae(config_path("vae_micro")), str(folder))
    for weight_file in ("diffusion_paddle_model.safetensors", "diffusion_pytorch_model.safetensors"):
        with pytest.raises(ValueError, match=re.escape(f"give the folder, --pretrained_model_name_or_path {folder}")):
            build_vae(pretrained_model_name_or_path=str(folder / weight_file))  # the file instead of its folder
    # A prefix that names no weight would silently load everything.
    with pytest.raises(ValueError, match=re.escape("--ignore_keys decoders.: no weight of this VAE")):
        build_vae(pretrained_model_name_or_path=str(folder), ignore_keys=["decoder.", "decoders."])
    # --init_from_ckpt given a run's output folder (its newest checkpoint is suggested) or a VAE folder.
    run = tmp_path / "run"
    for step in (2, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=re.escape(f"e.g. --init_from_ckpt {run / 'checkpoint-10'}.")):
        build_vae(init_from_ckpt=str(run))
    for config_file in (None, config_path("vae_micro")):
        with pytest.raises(FileNotFoundError, match=re.escape(f"fine-tune it with --pretrained_model_name_or_path {folder}")):
            build_vae(config_file, init_from_ckpt=str(folder))


# ---- the pretrained VAEs people have, each compared with the PyTorch source model on real photos

from torch_vae import (MICRO, SD_LIKE, diffusers, diffusers_to_ldm, make_torch_vae, paddle_reconstruct,  # noqa: E402
                       photos, torch_reconstruct)


@pytest.fixture(scope="module")
def torch_micro(tmp_path_factory):
    """A PyTorch diffusers micro VAE folder (seeded non-default weights, SDXL's scaling factor) and its model."""
    folder = tmp_path_factory.mktemp("torch_micro")
    vae = make_torch_vae(MICRO)
    vae.save_pretrained(str(folder))
    return str(folder), vae


def test_pytorch_diffusers_folder_loads_and_reconstructs_like_torch(torch_micro, tmp_path):
    folder, source = torch_micro
    images = photos()
    vae = build_vae(pretrained_model_name_or_path=folder)
    np.testing.assert_allclose(paddle_reconstruct(vae, images), torch_reconstruct(source, images), atol=1e-4)
    assert vae.config.scaling_factor == MICRO["scaling_factor"]
    # The same folder as the 'vae' of a pipeline.
    os.makedirs(tmp_path / "pipeline")
    os.symlink(folder, tmp_path / "pipeline" / "vae")
    in_pipeline = build_vae(pretrained_model_name_or_path=str(tmp_path / "pipeline"), subfolder="vae")
    np.testing.assert_array_equal(paddle_reconstruct(in_pipeline, images), paddle_reconstruct(vae, images))


@pytest.mark.parametrize("weights", ["bin", "fp16_variant"])
def test_pytorch_diffusers_folders_with_other_weight_files_load(tmp_path, weights):
    """`.bin` weights, and a folder holding only the fp16 variant (diffusion_pytorch_model.fp16.safetensors,
    what an fp16 pipeline download has): loaded into a float32 VAE that reconstructs like the source."""
    source = make_torch_vae(MICRO, seed=5)
    folder = tmp_path / "vae"
    if weights == "bin":
        source.save_pretrained(str(folder), safe_serialization=False)
    else:
        source.half().save_pretrained(str(folder), variant="fp16")
        source.float()  # the source model now holds the fp16 roundings the file holds
    assert len(os.listdir(folder)) == 2  # config.json + the one weight file under test
    vae = build_vae(pretrained_model_name_or_path=str(folder))
    assert all(p.dtype == paddle.float32 for p in vae.parameters())
    images = photos()
    np.testing.assert_allclose(paddle_reconstruct(vae, images), torch_reconstruct(source, images), atol=1e-4)


def test_a_bfloat16_diffusers_folder_loads_in_a_fresh_process(tmp_path):
    """FLUX.1's published VAE ships bfloat16 safetensors, which safetensors.numpy cannot read (numpy has no
    bfloat16): a fresh process, before anything imports ppdiffusers' loader (whose import patches that table), loads
    it to float32 weights equal to the file's bfloat16 values."""
    import subprocess
    import sys

    import torch

    source = make_torch_vae(MICRO, seed=5).to(torch.bfloat16)
    source.save_pretrained(str(tmp_path / "vae"))
    script = (f"import numpy as np; from vae_trainer.models.vae_loading import build_vae\n"
              f"vae = build_vae(pretrained_model_name_or_path={str(tmp_path)!r}, subfolder='vae')\n"
              f"np.savez({str(tmp_path / 'read.npz')!r}, **{{k: v.numpy() for k, v in vae.state_dict().items()}})")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(CONFIG_DIR),
                   env={**os.environ, "PYTHONPATH": os.path.dirname(CONFIG_DIR)})
    read = np.load(tmp_path / "read.npz")
    theirs = {k: v.float().numpy() for k, v in source.state_dict().items()}
    weight = "encoder.conv_in.weight"
    assert read[weight].dtype == np.float32 and np.abs(read[weight]).max() > 0
    np.testing.assert_array_equal(read[weight], theirs[weight])
    assert read["decoder.conv_out.bias"].tolist() == theirs["decoder.conv_out.bias"].tolist()


def test_pytorch_files_load_without_torch(tmp_path):
    """USE_TORCH=0, as users without torch run (ppdiffusers' own torch-free reader fails under numpy 2 on np.cfloat):
    a .bin folder and a whole-SD .ckpt load to the weights the in-process loader reads, and torch is never imported."""
    import subprocess
    import sys

    source = make_torch_vae(MICRO, seed=5)
    source.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    ckpt = _write_single_file(source, tmp_path / "sd.ckpt", as_ckpt=True)
    (tmp_path / "micro.json").write_text(json.dumps(MICRO))
    script = (f"import sys, numpy as np; from vae_trainer.models.vae_loading import build_vae\n"
              f"vaes = [build_vae(pretrained_model_name_or_path={str(tmp_path / 'bin')!r}), "
              f"build_vae({str(tmp_path / 'micro.json')!r}, pretrained_model_name_or_path={ckpt!r})]\n"
              f"np.savez({str(tmp_path / 'read.npz')!r}, **{{f'{{i}}/{{k}}': v.numpy() for i, vae in enumerate(vaes) "
              f"for k, v in vae.state_dict().items()}})\nassert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.path.dirname(CONFIG_DIR),
                   env={**os.environ, "USE_TORCH": "0", "PYTHONPATH": os.path.dirname(CONFIG_DIR)})
    read = np.load(tmp_path / "read.npz")
    for key, value in build_vae(pretrained_model_name_or_path=str(tmp_path / "bin")).state_dict().items():
        np.testing.assert_array_equal(read[f"0/{key}"], value.numpy())
        np.testing.assert_array_equal(read[f"1/{key}"], value.numpy())


def test_a_legacy_torch_pickle_loads_with_torch(tmp_path):
    """torch.save before 1.6 wrote a plain pickle, not a zip (old .ckpt / .bin files): torch.load(weights_only=True)
    reads it when torch is installed, to the weights the zip of the same checkpoint gives."""
    import torch

    source = make_torch_vae(MICRO, seed=5)
    state = diffusers_to_ldm(source.state_dict(), len(source.config.up_block_types))
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save({"state_dict": {f"first_stage_model.{k}": v for k, v in state.items()}, "global_step": 1}, legacy,
               _use_new_zipfile_serialization=False)
    (tmp_path / "micro.json").write_text(json.dumps(MICRO))
    old, new = (build_vae(str(tmp_path / "micro.json"), pretrained_model_name_or_path=path)
                for path in (legacy, _write_single_file(source, tmp_path / "sd.ckpt", as_ckpt=True)))
    for key, value in new.state_dict().items():
        np.testing.assert_array_equal(old.state_dict()[key].numpy(), value.numpy(), err_msg=key)


def _write_single_file(torch_vae, path, as_ckpt=False):
    import torch
    from safetensors.torch import save_file

    state = diffusers_to_ldm(torch_vae.state_dict(), len(torch_vae.config.up_block_types))
    if as_ckpt:  # a whole SD checkpoint: the VAE under first_stage_model.
        torch.save({"state_dict": {f"first_stage_model.{k}": v for k, v in state.items()}, "global_step": 1}, path)
    else:
        save_file(state, path)
    return str(path)


def test_original_single_file_loads_with_the_config_inferred_from_its_tensors(tmp_path, caplog):
    source = make_torch_vae(SD_LIKE, seed=1)
    source.save_pretrained(str(tmp_path / "config_only"))
    file = _write_single_file(source, tmp_path / "vae-ft.safetensors")
    images, expected = photos(), torch_reconstruct(source, photos())
    # The LDM names are right: diffusers' own single-file loader reads the file back to the source model.
    reread = diffusers().AutoencoderKL.from_single_file(file, config=str(tmp_path / "config_only"), local_files_only=True)
    np.testing.assert_array_equal(torch_reconstruct(reread.eval(), images), expected)

    with caplog.at_level("WARNING", logger="vae_trainer"):
        vae = build_vae(pretrained_model_name_or_path=file)
    np.testing.assert_allclose(paddle_reconstruct(vae, images), expected, atol=1e-4)
    assert (vae.config.scaling_factor, vae.config.norm_num_groups, list(vae.config.block_out_channels)) == (0.18215, 32, [32, 32])
    # The factor is assumed in one place (latent_scale.py), with one warning giving both ways to state another.
    warned = [r.getMessage() for r in caplog.records if "scaling_factor" in r.getMessage()]
    assert len(warned) == 1 and "Stable Diffusion's 0.18215 is assumed" in warned[0], warned
    assert "--scaling_factor 0.13025" in warned[0] and "--vae_config_file configs/sdxl_vae.json" in warned[0]
    assert "0.18215" in origin_of(vae) and "assumed" in origin_of(vae) and file in origin_of(vae)
    caplog.clear()
    with caplog.at_level("WARNING", logger="vae_trainer"):  # an encoder re-initialised measures its own factor
        build_vae(pretrained_model_name_or_path=file, ignore_keys=["encoder."])
    assert not [r for r in caplog.records if "scaling_factor" in r.getMessage()]
    ckpt = build_vae(pretrained_model_name_or_path=_write_single_file(source, tmp_path / "sd.ckpt", as_ckpt=True))
    np.testing.assert_allclose(paddle_reconstruct(ckpt, images), expected, atol=1e-4)


@pytest.mark.parametrize("quant_conv", [True, False], ids=["sdxl_like", "flux_like_no_quant_conv"])
def test_single_file_with_a_config_file_takes_its_architecture_and_scaling_factor(tmp_path, quant_conv, caplog):
    config = dict(MICRO, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv, scaling_factor=0.13025)
    source = make_torch_vae(config, seed=2)
    file = _write_single_file(source, tmp_path / "sdxl_vae.safetensors")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    vae = build_vae(str(config_file), pretrained_model_name_or_path=file)
    images = photos()
    np.testing.assert_allclose(paddle_reconstruct(vae, images), torch_reconstruct(source, images), atol=1e-4)
    assert vae.config.scaling_factor == 0.13025 and (vae.quant_conv is None) == (not quant_conv)
    with pytest.raises(ValueError, match="--vae_config_file"):  # SD's 32 norm groups do not fit these widths
        build_vae(pretrained_model_name_or_path=file)
    # A config file without a factor (the reference trainer's config/vae.json): SD's default, said out loud.
    config_file.write_text(json.dumps({k: v for k, v in config.items() if k != "scaling_factor"}))
    with caplog.at_level("WARNING", logger="vae_trainer"):
        assert build_vae(str(config_file), pretrained_model_name_or_path=file).config.scaling_factor == 0.18215
    assert "states a scaling_factor" in caplog.text and "--scaling_factor 0.13025" in caplog.text


def test_eval_script_reads_a_single_file_with_the_config_file_its_error_asks_for(tmp_path, held_out_folder):
    from conftest import load_script

    source = make_torch_vae(MICRO, seed=2)  # widths that SD's 32 norm groups do not fit: a config is needed
    file = _write_single_file(source, tmp_path / "vae.safetensors")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(MICRO))
    eval_vae = load_script("eval_vae")
    flags = ["--vae", file, "--data", held_out_folder, "--resolution", "32", "--num_images", "2", "--skip_lpips",
             "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stopped:
        eval_vae.main(flags)
    assert stopped.value.code.startswith("error: ") and "--vae_config_file" in stopped.value.code
    result = eval_vae.main(flags + ["--vae_config_file", str(config_file)])
    folder = tmp_path / "torch_folder"
    source.save_pretrained(str(folder))
    expected = eval_vae.main(flags[:1] + [str(folder)] + flags[2:])
    assert result.metrics["psnr"] == pytest.approx(expected.metrics["psnr"], abs=1e-3)
    with pytest.raises(SystemExit) as stopped:  # a bad --data: one line too, not a traceback mid-evaluation
        eval_vae.main(flags[:1] + [str(folder), "--data", str(tmp_path / "missing")] + flags[4:])
    assert stopped.value.code.startswith("error: ") and "missing" in stopped.value.code
    assert result.scaling_factor == pytest.approx(expected.scaling_factor, rel=1e-4)


def test_a_folder_with_both_formats_is_read_in_each_librarys_own_format(tmp_path, torch_micro):
    """Our export holds both files; each loader must pick its own (ppdiffusers: Paddle; diffusers: PyTorch).
    Here the two files hold DIFFERENT models, so picking the wrong one cannot go unnoticed."""
    paddle_model = build_vae(config_path("vae_micro"))
    folder = tmp_path / "both"
    paddle_model.save_pretrained(str(folder))
    torch_source = make_torch_vae(MICRO, seed=3)
    torch_source.save_pretrained(str(tmp_path / "torch"))
    shutil.copy(tmp_path / "torch" / "diffusion_pytorch_model.safetensors", folder)
    images = photos()
    np.testing.assert_array_equal(paddle_reconstruct(build_vae(pretrained_model_name_or_path=str(folder)), images),
                                  paddle_reconstruct(paddle_model, images))
    in_torch = diffusers().AutoencoderKL.from_pretrained(str(folder))
    np.testing.assert_array_equal(torch_reconstruct(in_torch.eval(), images), torch_reconstruct(torch_source, images))


def test_ignore_keys_leave_those_weights_at_the_seeded_fresh_initialisation(torch_micro):
    folder, _ = torch_micro
    full = build_vae(pretrained_model_name_or_path=folder).state_dict()
    paddle.seed(11)
    partial = build_vae(pretrained_model_name_or_path=folder, ignore_keys=["decoder."]).state_dict()
    paddle.seed(11)
    fresh = AutoencoderKL.from_config(AutoencoderKL.load_config(folder)).state_dict()
    assert any(k.startswith("decoder.") for k in full)
    for key, value in partial.items():
        expected = fresh[key] if key.startswith("decoder.") else full[key]
        np.testing.assert_array_equal(value.numpy(), expected.numpy(), err_msg=key)
        if key.startswith("decoder.") and key.endswith("conv1.weight"):
            assert not np.array_equal(value.numpy(), full[key].numpy())


def test_another_architecture_takes_what_fits_and_needs_ignore_keys_for_the_rest(torch_micro, tmp_path):
    folder, _ = torch_micro
    # The reference trainer's recipe: SD's encoder, a decoder with one more up block (super-resolution).
    wider = dict(MICRO, up_block_types=["UpDecoderBlock2D"] * 3, up_block_out_channels=[8, 16, 16])
    config_file = tmp_path / "f2_encoder_f4_decoder.json"
    config_file.write_text(json.dumps(wider))
    with pytest.raises(ValueError, match="--ignore_keys"):
        build_vae(str(config_file), pretrained_model_name_or_path=folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vae = build_vae(str(config_file), pretrained_model_name_or_path=folder, ignore_keys=["decoder."])
    assert not [w for w in caught if "Skip loading" in str(w.message)]  # no warning per ignored weight
    full = build_vae(pretrained_model_name_or_path=folder).state_dict()
    for key, value in vae.state_dict().items():
        if not key.startswith("decoder."):
            np.testing.assert_array_equal(value.numpy(), full[key].numpy(), err_msg=key)
    assert len(vae.decoder.up_blocks) == 3


def test_a_config_file_with_a_pretrained_folder_keeps_the_folders_latent_scale(tmp_path, caplog):
    """The reference recipe (a pretrained folder + --vae_config_file): the latent space is the folder's, so is
    its scale, whatever the config file states (a differing value is warned about, naming both values and
    --scaling_factor, which chooses the exported factor)."""
    folder = tmp_path / "flux_like_source"
    make_torch_vae(dict(MICRO, shift_factor=0.0625), seed=3).save_pretrained(str(folder))  # scaling_factor 0.13025
    wider = {k: v for k, v in MICRO.items() if k not in ("scaling_factor", "shift_factor")}
    wider.update(up_block_types=["UpDecoderBlock2D"] * 3, up_block_out_channels=[8, 16, 16])
    config_file = tmp_path / "no_factor.json"
    config_file.write_text(json.dumps(wider))
    vae = build_vae(str(config_file), pretrained_model_name_or_path=str(folder), ignore_keys=["decoder."])
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.13025, 0.0625)
    updates, record = decide("keep", vae)
    assert updates == {} and (record["scaling_factor"], record["shift_factor"]) == (0.13025, 0.0625)
    config_file.write_text(json.dumps(dict(wider, scaling_factor=0.5, shift_factor=0.0)))  # another latent space's
    with caplog.at_level("WARNING", logger="vae_trainer"):
        vae = build_vae(str(config_file), pretrained_model_name_or_path=str(folder), ignore_keys=["decoder."])
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.13025, 0.0625)
    warned = [r.getMessage() for r in caplog.records if "states scaling_factor" in r.getMessage()]
    assert len(warned) == 1 and "0.5" in warned[0] and "0.13025" in warned[0] and "keeping 0.13025" in warned[0]
    assert "--scaling_factor 0.5" in warned[0] and "shift_factor 0.0" in caplog.text
    updates, record = decide("keep", vae)
    assert updates == {} and record["source"] == f"kept from the pretrained VAE {folder}"
    updates, record = decide(0.5, vae)  # --scaling_factor 0.5 chooses
    assert updates == {"scaling_factor": 0.5} and record["source"] == "given by --scaling_factor"


def test_with_a_reinitialised_encoder_the_conflict_warning_says_the_factor_is_measured_at_export(tmp_path, caplog):
    """--ignore_keys encoder.: the folder's factor is not that of the (new) latent space, and default_mode
    measures the exported one; the warning about a config file stating another factor says so."""
    folder = tmp_path / "source"
    make_torch_vae(MICRO, seed=3).save_pretrained(str(folder))  # scaling_factor 0.13025
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(dict(MICRO, scaling_factor=0.5)))
    for ignore_keys, says in (([], "the scale of the latent space the encoder's weights come from"),
                              (["encoder."], "the encoder is re-initialised (--ignore_keys), so the exported "
                                             "scaling_factor is measured at export")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="vae_trainer"):
            vae = build_vae(str(config_file), pretrained_model_name_or_path=str(folder), ignore_keys=ignore_keys)
        warned = [r.getMessage() for r in caplog.records if "states scaling_factor" in r.getMessage()]
        assert len(warned) == 1 and "keeping 0.13025" in warned[0] and says in warned[0], warned
        assert vae.config.scaling_factor == 0.13025
    assert "weights come from" not in warned[0] and "--scaling_factor keep exports 0.13025" in warned[0]
    assert scaling_factor_mode(SimpleNamespace(scaling_factor=None, ignore_keys=["encoder."], init_from_ckpt=None,
                                               pretrained_model_name_or_path=str(folder))) == "measure"


def test_init_from_ckpt_loads_weights_from_a_checkpoint_or_a_weight_file(torch_micro, tmp_path):
    folder, source = torch_micro
    images = photos()
    expected = torch_reconstruct(source, images)
    # A PyTorch diffusers weight file, converted to Paddle's layout.
    from_torch_file = build_vae(config_path("vae_micro"),
                                init_from_ckpt=os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    np.testing.assert_allclose(paddle_reconstruct(from_torch_file, images), expected, atol=1e-4)
    # Our checkpoint's model_state.pdparams holds the VAE under "vae." beside the discriminator.
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    state = {f"vae.{k}": v for k, v in from_torch_file.state_dict().items()}
    state["discriminator.main.0.weight"] = paddle.zeros([1])
    paddle.save(state, str(checkpoint / "model_state.pdparams"))
    for path in (checkpoint, checkpoint / "model_state.pdparams"):
        loaded = build_vae(config_path("vae_micro"), init_from_ckpt=str(path))
        np.testing.assert_array_equal(paddle_reconstruct(loaded, images), paddle_reconstruct(from_torch_file, images))
    paddle.seed(5)
    keeps_decoder = build_vae(config_path("vae_micro"), init_from_ckpt=str(checkpoint), ignore_keys=["decoder."])
    paddle.seed(5)
    fresh = build_vae(config_path("vae_micro"))
    np.testing.assert_array_equal(keeps_decoder.decoder.conv_out.weight.numpy(), fresh.decoder.conv_out.weight.numpy())
    np.testing.assert_array_equal(keeps_decoder.encoder.conv_in.weight.numpy(),
                                  from_torch_file.encoder.conv_in.weight.numpy())
    with pytest.raises(FileNotFoundError, match="init_from_ckpt"):
        build_vae(config_path("vae_micro"), init_from_ckpt=str(tmp_path / "nothing"))
