"""The scripts/run_*.sh launchers, on CPU with a tiny model (they default to SD at 256 px on GPUs)."""

import os
import subprocess

import pytest
from conftest import REPO


@pytest.mark.parametrize("script,env", [
    ("run_single_trainer.sh", {}),
    ("run_multi_no_trainer.sh", {"NPROC": "2"}),
])
def test_run_script_trains_on_cpu(photo_filelist, tmp_path, script, env):
    env = {**os.environ, "DEVICE": "cpu", "FILE_LIST": photo_filelist, "VAE_CONFIG": "configs/vae_micro.json",
           "OUTPUT_DIR": str(tmp_path / "out"), "RESOLUTION": "32", "BATCH_SIZE": "2", "MAX_STEPS": "2", **env}
    result = subprocess.run(["bash", f"scripts/{script}", "--disc_base_channels", "8", "--dataloader_num_workers", "0",
                             "--disable_tqdm", "true"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(tmp_path / "out" / "vae" / "config.json")
    if "NPROC" in env:
        assert {"workerlog.0", "workerlog.1"} <= set(os.listdir(tmp_path / "out" / "launch_logs"))


# ---- issue 17.1: the scripts fine-tune what they are given (no --vae_config_file of theirs, the latent scale kept)

def run_script(script, tmp_path, photo_filelist, flags, **env):
    """scripts/SCRIPT on CPU, 2 steps at 32 px (env values None: unset); the completed process."""
    env = {**os.environ, "DEVICE": "cpu", "FILE_LIST": photo_filelist, "OUTPUT_DIR": str(tmp_path / "out"),
           "RESOLUTION": "32", "BATCH_SIZE": "2", "MAX_STEPS": "2", **env}
    flags = [*flags, "--disc_base_channels", "8", "--dataloader_num_workers", "0", "--disable_tqdm", "true"]
    result = subprocess.run(["bash", f"scripts/{script}", *flags], cwd=REPO, capture_output=True, text=True,
                            env={k: v for k, v in env.items() if v is not None}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def exported(tmp_path):
    import json

    out = tmp_path / "out" / "vae"
    return json.load(open(out / "config.json")), json.load(open(out / "latent_stats.json"))


@pytest.fixture(scope="module")
def sdxl_like(tmp_path_factory):
    """A PyTorch diffusers VAE folder with SDXL's scaling factor 0.13025 (tiny architecture)."""
    from torch_vae import MICRO, make_torch_vae

    folder = tmp_path_factory.mktemp("sdxl_like_vae")
    make_torch_vae(MICRO, seed=4).save_pretrained(str(folder))
    return str(folder)


def test_run_script_fine_tunes_an_sdxl_vae_with_its_own_scaling_factor(sdxl_like, photo_filelist, tmp_path):
    """Before: the script's --vae_config_file (configs/vae_tiny.json on CPU) replaced the given VAE's
    architecture and its scaling factor (0.18215 exported, "kept from the VAE's config")."""
    result = run_script("run_single_trainer.sh", tmp_path, photo_filelist,
                        ["--pretrained_model_name_or_path", sdxl_like], VAE_CONFIG=None)
    config, stats = exported(tmp_path)
    assert config["scaling_factor"] == 0.13025 and config["block_out_channels"] == [8, 16]
    assert (stats["scaling_factor"], stats["source"]) == (0.13025, f"kept from the pretrained VAE {sdxl_like}")
    assert "no --vae_config_file is passed" in result.stderr
    assert f"exported scaling_factor 0.13025, shift_factor None (kept from the pretrained VAE {sdxl_like}" in result.stderr


def test_run_script_fine_tunes_a_flux_style_vae_given_with_an_equals_sign(photo_filelist, tmp_path):
    """Issue 17 "Why" 2: a FLUX-style folder (16 latent channels, no quant convs) stopped with "7 weights have
    other shapes than this VAE's ... Give the matching --vae_config_file": the script had given one."""
    from test_finetune_e2e import FLUX_LIKE
    from torch_vae import make_torch_vae

    folder = tmp_path / "flux_vae"
    make_torch_vae(FLUX_LIKE, seed=9).save_pretrained(str(folder))
    run_script("run_single_no_trainer.sh", tmp_path, photo_filelist,
               [f"--pretrained_model_name_or_path={folder}"], VAE_CONFIG=None)
    config, stats = exported(tmp_path)
    assert (config["latent_channels"], config["use_quant_conv"]) == (16, False)
    assert (config["scaling_factor"], config["shift_factor"], config["latents_std"]) == (
        0.3611, 0.1159, FLUX_LIKE["latents_std"])
    assert stats["source"] == f"kept from the pretrained VAE {folder}"


def test_a_config_file_stating_another_factor_is_warned_about_and_scaling_factor_chooses(
        sdxl_like, photo_filelist, tmp_path):
    """VAE_CONFIG=configs/vae_micro.json (the same architecture, scaling_factor 0.18215) is passed, as the user
    asked; the pretrained VAE's 0.13025 is kept, with a warning naming both and --scaling_factor."""
    result = run_script("run_single_no_trainer.sh", tmp_path, photo_filelist,
                        ["--pretrained_model_name_or_path", sdxl_like], VAE_CONFIG="configs/vae_micro.json")
    config, stats = exported(tmp_path)
    assert config["scaling_factor"] == 0.13025 and stats["source"] == f"kept from the pretrained VAE {sdxl_like}"
    warning = next(line for line in result.stderr.splitlines() if "states scaling_factor" in line)
    assert "--vae_config_file configs/vae_micro.json states scaling_factor 0.18215" in warning
    assert f"the pretrained VAE {sdxl_like} 0.13025: keeping 0.13025" in warning
    assert "--scaling_factor 0.18215 exports 0.18215" in warning

    run_script("run_single_no_trainer.sh", tmp_path / "given", photo_filelist,
               ["--pretrained_model_name_or_path", sdxl_like, "--scaling_factor", "0.2"],
               VAE_CONFIG="configs/vae_micro.json")
    config, stats = exported(tmp_path / "given")
    assert (config["scaling_factor"], stats["source"]) == (0.2, "given by --scaling_factor")
