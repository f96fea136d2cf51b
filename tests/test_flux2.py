"""FLUX.2's VAE (AutoencoderKLFlux2, also ERNIE-Image's), issue 23: in, trained, its latent normalisation kept
or measured, and out, checked against diffusers' own class.

The PyTorch side runs in .venv-flux2 (diffusers 0.42.1; `make test` builds it, requirements-flux2-test.txt)
through tests/flux2_torch_side.py in a subprocess: .venv's diffusers 0.32.2 has no AutoencoderKLFlux2.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import (DRIVERS, REPO, REQUIRE_TEST_EXTRAS, assert_same_tensor, run_entry_point, run_in_process,
                      tiny_args)

FLUX2_PYTHON = os.environ.get("VAE_TRAINER_FLUX2_PYTHON", os.path.join(REPO, ".venv-flux2", "bin", "python"))
TORCH_SIDE = os.path.join(REPO, "tests", "flux2_torch_side.py")
# Tiny, with a decoder of other widths than the encoder's (decoder_block_out_channels) and 16 patchified channels.
TINY_FLUX2 = dict(block_out_channels=[16, 32], decoder_block_out_channels=[16, 24],
                  down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                  layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32)
ENCODER_PREFIXES = ("encoder.", "quant_conv.")
BN_KEYS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def torch_side(*args: str) -> None:
    if not os.path.isfile(FLUX2_PYTHON):
        message = f"{FLUX2_PYTHON} is missing: `make test` builds it (requirements-flux2-test.txt)"
        if os.environ.get(REQUIRE_TEST_EXTRAS) == "1":
            raise FileNotFoundError(message)
        pytest.skip(message)
    result = subprocess.run([FLUX2_PYTHON, TORCH_SIDE, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


class TorchSide:
    """flux2_torch_side.py make / run jobs queued, then done by one process (`flush`): each process spends seconds
    importing torch and diffusers, the tiny models' work takes milliseconds. Each run needs its own `work` folder;
    `run` returns the function that reads its result after the flush."""

    def __init__(self, work) -> None:
        self.work, self.jobs = str(work), []

    def make(self, folder, config=TINY_FLUX2, seed=0, variant=None, bin_format=False) -> str:
        """A seeded AutoencoderKLFlux2 folder: weights moved off their initialisation, bn statistics far from 0 / 1,
        counter 7."""
        self.jobs.append(["make", str(folder), "--config", json.dumps(config), "--seed", str(seed),
                          *(["--variant", variant] if variant else []), *(["--bin"] if bin_format else [])])
        return str(folder)

    def run(self, folder, images: np.ndarray, work, variant=None):
        """What diffusers' AutoencoderKLFlux2 makes of `images` with the VAE in `folder` (flux2_torch_side.py run)."""
        os.makedirs(work, exist_ok=True)
        np.save(os.path.join(work, "images.npy"), images)
        out = os.path.join(work, "torch_out.npz")
        self.jobs.append(["run", str(folder), "--images", os.path.join(work, "images.npy"), "--out", out,
                          *(["--variant", variant] if variant else [])])

        def read() -> dict:
            result = dict(np.load(out))
            result["loading_info"] = json.loads(str(result["loading_info"]))
            return result

        return read

    def flush(self) -> None:
        path = os.path.join(self.work, "torch_jobs.json")
        with open(path, "w") as handle:
            json.dump(self.jobs, handle)
        self.jobs = []
        torch_side("batch", path)


def in_ours(vae, images: np.ndarray) -> dict:
    import paddle

    from vae_trainer.models.families.flux2 import FLUX2
    from vae_trainer.models.autoencoder_kl_ltx2 import space_time_to_channels

    vae.eval()
    with paddle.no_grad():
        mode = vae.encode(paddle.to_tensor(images)).latent_dist.mode()
        decoded = vae.decode(mode).sample
    stats = FLUX2.normalisation.held_values(vae)
    mean = np.asarray(stats["running_mean"], np.float32).reshape(1, -1, 1, 1)
    var = np.asarray(stats["running_var"], np.float32).reshape(1, -1, 1, 1)
    patches = space_time_to_channels(mode.unsqueeze(2), (1, 2, 2)).squeeze(2)  # Flux2Pipeline's 2x2 patchify
    normalised = (patches.numpy() - mean) / np.sqrt(var + vae.config.batch_norm_eps)
    return {"mode": mode.numpy(), "decoded": decoded.numpy(), "normalised": normalised,
            "running_mean": np.asarray(stats["running_mean"], np.float32),
            "running_var": np.asarray(stats["running_var"], np.float32),
            "num_batches_tracked": stats["num_batches_tracked"]}


def torch_weights(folder, variant=None) -> dict:
    from safetensors.numpy import load_file

    name = "diffusion_pytorch_model" + (f".{variant}" if variant else "") + ".safetensors"
    return load_file(os.path.join(folder, name))


def images(count=2, size=32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (count, 3, size, size)).astype(np.float32)


def assert_same_outputs(ours: dict, theirs: dict, atol=1e-5) -> None:
    for key in ("mode", "decoded", "normalised"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=0, atol=atol, err_msg=key)
    np.testing.assert_array_equal(ours["running_mean"], theirs["running_mean"])
    np.testing.assert_array_equal(ours["running_var"], theirs["running_var"])
    assert ours["num_batches_tracked"] == int(theirs["num_batches_tracked"])


FORMATS = {"safetensors": (None, False), "fp16_variant": ("fp16", False), "bin": (None, True)}  # (variant, .bin)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """What the torch side does before any training, in one process: the source (seed 0); a folder of seed 3 in each
    of FORMATS and diffusers' outputs of it on images(); diffusers' loading of configs/flux2_vae.json built and
    saved by us ("published": (folder, its trainable parameter count), "published_info")."""
    from vae_trainer.models.vae_loading import build_vae
    from vae_trainer.models.vae_saving import save_vae

    root = tmp_path_factory.mktemp("flux2_made")
    batch, out, runs = TorchSide(root), {}, {}
    out["source"] = batch.make(root / "source")
    for name, (variant, bin_format) in FORMATS.items():
        out[name] = batch.make(root / name / "vae", seed=3, variant=variant, bin_format=bin_format)
        runs[f"{name}_run"] = batch.run(out[name], images(), root / name, variant)
    vae = build_vae("configs/flux2_vae.json")
    trainable = sum(int(np.prod(p.shape)) for p in vae.parameters() if not p.stop_gradient)
    save_vae(vae, str(root / "published" / "vae"))
    del vae
    out["published"] = (str(root / "published" / "vae"), trainable)
    runs["published_info"] = batch.run(root / "published" / "vae", images(1, 16), root / "published")
    batch.flush()
    out.update({name: read() for name, read in runs.items()})
    out["published_info"] = out["published_info"]["loading_info"]
    return out


@pytest.fixture(scope="module")
def source(made) -> str:
    """A diffusers AutoencoderKLFlux2 folder: seeded weights, bn statistics far from 0 / 1, counter 7."""
    return made["source"]


# ---- in

@pytest.mark.parametrize("name", list(FORMATS))
def test_a_diffusers_flux2_folder_loads_with_every_weight_and_its_bn_statistics(made, name):
    from vae_trainer.models.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from vae_trainer.models.vae_loading import build_vae

    folder = made[name]  # seed 3, in this format
    vae = build_vae(pretrained_model_name_or_path=folder)
    assert isinstance(vae, AutoencoderKLFlux2)
    assert list(vae.config.decoder_block_out_channels) == [16, 24]
    x = images()
    ours, theirs = in_ours(vae, x), made[f"{name}_run"]
    assert theirs["loading_info"]["missing_keys"] == [] and theirs["num_batches_tracked"] == 7
    assert_same_outputs(ours, theirs, atol=1e-5)
    assert np.abs(theirs["running_mean"]).max() > 0.1 and np.abs(theirs["running_var"] - 1).max() > 0.1


def test_a_flux2_folder_in_a_pipeline_download_loads_with_subfolder_vae(source, tmp_path):
    import shutil

    from vae_trainer.models.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from vae_trainer.models.vae_loading import build_vae

    shutil.copytree(source, tmp_path / "ERNIE-Image" / "vae")
    assert isinstance(build_vae(pretrained_model_name_or_path=str(tmp_path / "ERNIE-Image"), subfolder="vae"),
                      AutoencoderKLFlux2)


def test_the_published_flux2_config_builds_diffusers_architecture(made):
    """configs/flux2_vae.json: the same weight names and shapes as diffusers' AutoencoderKLFlux2 of that
    config, 84,046,115 parameters (the published FLUX.2 VAE's count), and its force_upcast kept (built and saved
    by `made`, loaded there by diffusers)."""
    folder, trainable = made["published"]
    assert trainable == 84_046_115
    assert made["published_info"] == {"class": "AutoencoderKLFlux2", "missing_keys": [], "unexpected_keys": [],
                                      "mismatched_keys": [], "error_msgs": []}
    config = json.load(open(os.path.join(folder, "config.json")))
    published = json.load(open(os.path.join(REPO, "configs", "flux2_vae.json")))
    written = {k: v for k, v in config.items() if not k.startswith("_")}
    assert {k: written.get(k) for k in published if not k.startswith("_")} == {
        k: v for k, v in published.items() if not k.startswith("_")}
    # beside them only what diffusers 0.42.1 itself writes for this class (the published file predates the key)
    assert {k: v for k, v in written.items() if k not in published} == {"decoder_block_out_channels": None}
    assert config["_class_name"] == "AutoencoderKLFlux2"


def test_bn_statistics_that_do_not_fit_are_an_error_naming_them(source, tmp_path):
    """Into an AutoencoderKL (a config file of that class, or a folder whose config says AutoencoderKL), the bn
    statistics have no place: an error naming them, never the old "weights ... were not used" line."""
    from vae_trainer.models.vae_loading import build_vae

    config = {k: v for k, v in TINY_FLUX2.items() if k != "decoder_block_out_channels"}
    config_file = tmp_path / "kl.json"
    config_file.write_text(json.dumps({"_class_name": "AutoencoderKL", **config}))
    with pytest.raises(ValueError, match=r"bn\.running_mean|bn\._mean"):
        build_vae(str(config_file), pretrained_model_name_or_path=source, ignore_keys=["decoder."])
    import shutil

    relabelled = tmp_path / "relabelled"
    shutil.copytree(source, relabelled)
    saved = json.load(open(relabelled / "config.json"))
    for key in ("decoder_block_out_channels", "batch_norm_eps", "batch_norm_momentum", "patch_size",
                "mid_block_add_attention"):
        saved.pop(key, None)
    saved.update(_class_name="AutoencoderKL", block_out_channels=[16, 32])
    (relabelled / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"bn\._mean|bn\._variance"):
        build_vae(pretrained_model_name_or_path=str(relabelled), ignore_keys=["decoder."])


# ---- trained, exported: decoder-only keeps the encoder and the statistics bit for bit

@pytest.fixture(scope="module")
def decoder_only_runs(source, photo_filelist, tmp_path_factory) -> dict:
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"flux2_{driver.split('.')[0]}"))
        args = tiny_args(photo_filelist, output_dir, max_steps=3, save_steps=3, learning_rate=3e-3)
        args = [a for a in args if a not in ("--vae_config_file", "configs/vae_micro.json")]
        run_in_process(driver, args + ["--pretrained_model_name_or_path", source, "--freeze_encoder", "true"])
        out[driver] = output_dir
    return out


# ---- whole-model fine-tuning with --scaling_factor measure, and a VAE from scratch: the runs

@pytest.fixture(scope="module")
def measure_runs(source, photo_filelist, tmp_path_factory) -> dict:
    """{driver: output dir} of a 2-step whole-model fine-tune with --scaling_factor measure on 6 images, and
    "pixels": those 6 images (the run's seeded sample of --file_list)."""
    from vae_trainer.data.dataset import build_eval_dataloader
    from vae_trainer.data.filelists import read_sources
    from vae_trainer.data.sharding import RecordSample

    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"flux2_measure_{driver.split('.')[0]}"))
        args = tiny_args(photo_filelist, output_dir, max_steps=2, save_steps=2, use_ema="false", learning_rate=3e-3)
        args = [a for a in args if a not in ("--vae_config_file", "configs/vae_micro.json")]
        run_in_process(driver, args + ["--pretrained_model_name_or_path", source, "--scaling_factor", "measure",
                                       "--latent_stats_num_images", "6"])
        out[driver] = output_dir
    # The same 6 images the export measured on (the run's seeded sample of --file_list).
    sample = RecordSample(read_sources(photo_filelist), int(args[args.index("--seed") + 1]))
    batch = next(iter(build_eval_dataloader(photo_filelist, 32, 6, 0, 1, 6, sample)))
    out["pixels"] = np.asarray(batch["pixel_values"] if isinstance(batch, dict) else batch[0], dtype=np.float32)
    return out


@pytest.fixture(scope="module")
def scratch_run(photo_filelist, tmp_path_factory) -> str:
    """The output dir of one step of a tiny AutoencoderKLFlux2 from a config file (class AutoencoderKLFlux2)."""
    root = tmp_path_factory.mktemp("flux2_scratch")
    config_file = root / "flux2_tiny.json"
    config_file.write_text(json.dumps({"_class_name": "AutoencoderKLFlux2", **TINY_FLUX2}))
    output_dir = str(root / "run")
    args = tiny_args(photo_filelist, output_dir, max_steps=1, save_steps=1, use_ema="false",
                     vae_config_file=str(config_file))
    run_in_process("train_vae_trainer.py", args + ["--latent_stats_num_images", "4"])
    return output_dir


@pytest.fixture(scope="module")
def exports_in_diffusers(decoder_only_runs, measure_runs, scratch_run, tmp_path_factory) -> dict:
    """What diffusers' AutoencoderKLFlux2 makes of the exports, one process: {("decoder_only", driver): of
    images(seed=1), ("measure", driver): of the 6 images measured on, "scratch": of images(1)}."""
    root = tmp_path_factory.mktemp("flux2_exports_in_diffusers")
    batch, runs = TorchSide(root), {}
    for driver in DRIVERS:
        name = driver.split(".")[0]
        runs["decoder_only", driver] = batch.run(os.path.join(decoder_only_runs[driver], "vae"), images(seed=1),
                                                 root / f"decoder_only_{name}")
        runs["measure", driver] = batch.run(os.path.join(measure_runs[driver], "vae"), measure_runs["pixels"],
                                            root / f"measure_{name}")
    runs["scratch"] = batch.run(os.path.join(scratch_run, "vae"), images(1), root / "scratch")
    batch.flush()
    return {key: read() for key, read in runs.items()}


@pytest.mark.parametrize("driver", DRIVERS)
def test_decoder_only_fine_tuning_exports_what_diffusers_loads_as_flux2_with_the_source_encoder_and_statistics(
        decoder_only_runs, source, driver, exports_in_diffusers):
    from vae_trainer.models.vae_loading import build_vae

    vae_dir = os.path.join(decoder_only_runs[driver], "vae")
    config, source_config = json.load(open(os.path.join(vae_dir, "config.json"))), json.load(
        open(os.path.join(source, "config.json")))
    assert config["_class_name"] == "AutoencoderKLFlux2" and "scaling_factor" not in config
    assert {k for k in config if not k.startswith("_")} == {k for k in source_config if not k.startswith("_")}
    exported, original = torch_weights(vae_dir), torch_weights(source)
    assert set(exported) == set(original)
    for key in original:
        if key.startswith(ENCODER_PREFIXES) or key in BN_KEYS:
            assert_same_tensor(exported[key], original[key], key)  # diffusers' shapes too: the counter 0-d
    assert not np.array_equal(exported["decoder.conv_out.weight"], original["decoder.conv_out.weight"])
    x = images(seed=1)
    theirs = exports_in_diffusers["decoder_only", driver]  # of x
    assert theirs["loading_info"]["missing_keys"] == [] and theirs["loading_info"]["unexpected_keys"] == []
    assert theirs["num_batches_tracked"] == 7
    assert_same_outputs(in_ours(build_vae(pretrained_model_name_or_path=vae_dir), x), theirs)
    record = json.load(open(os.path.join(vae_dir, "latent_stats.json")))
    assert record["class"] == "AutoencoderKLFlux2" and "kept from the pretrained VAE" in record["source"]
    np.testing.assert_array_equal(np.float32(record["latent_normalisation"]["running_var"]),
                                  original["bn.running_var"])


def test_both_entry_points_fine_tune_flux2_to_the_same_weights(decoder_only_runs):
    first, second = (torch_weights(os.path.join(decoder_only_runs[d], "vae")) for d in DRIVERS)
    for key in first:
        assert_same_tensor(first[key], second[key], key)


def test_export_vae_script_writes_the_flux2_folder_from_a_checkpoint(decoder_only_runs, tmp_path):
    from conftest import load_script

    run = decoder_only_runs["train_vae_no_trainer.py"]
    out = load_script("export_vae").main([os.path.join(run, "checkpoint-3"), str(tmp_path / "vae")])
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["_class_name"] == "AutoencoderKLFlux2" and "scaling_factor" not in config
    exported, run_export = torch_weights(out), torch_weights(os.path.join(run, "vae"))
    for key in run_export:
        assert_same_tensor(exported[key], run_export[key], key)


# ---- whole-model fine-tuning with --scaling_factor measure: the statistics of the exported encoder

@pytest.mark.parametrize("driver", DRIVERS)
def test_measure_exports_the_patchified_mode_statistics_of_the_exported_encoder(source, measure_runs, driver,
                                                                                 exports_in_diffusers):
    vae_dir = os.path.join(measure_runs[driver], "vae")
    # The same 6 images the export measured on, encoded by diffusers' class from the exported folder.
    assert measure_runs["pixels"].shape[0] == 6
    theirs = exports_in_diffusers["measure", driver]
    mode = theirs["mode"]
    b, c, h, w = mode.shape
    patches = mode.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    per_channel = patches.transpose(1, 0, 2, 3).reshape(c * 4, -1).astype(np.float64)
    np.testing.assert_allclose(theirs["running_mean"], per_channel.mean(axis=1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(theirs["running_var"], per_channel.var(axis=1), rtol=1e-4, atol=1e-6)
    assert int(theirs["num_batches_tracked"]) == 6
    original = torch_weights(source)
    assert not np.array_equal(torch_weights(vae_dir)["encoder.conv_in.weight"], original["encoder.conv_in.weight"])
    assert np.abs(theirs["running_mean"] - original["bn.running_mean"]).max() > 0.05
    record = json.load(open(os.path.join(vae_dir, "latent_stats.json")))
    assert record["source"].startswith("measured on") and record["measured"]["num_images"] == 6


def test_keep_exports_the_source_statistics_after_a_whole_model_fine_tune(source, photo_filelist, tmp_path):
    """Training moves the encoder, never the statistics: no optimizer step and no forward pass touches them."""
    output_dir = str(tmp_path / "run")
    args = tiny_args(photo_filelist, output_dir, max_steps=2, save_steps=2, learning_rate=3e-3)
    args = [a for a in args if a not in ("--vae_config_file", "configs/vae_micro.json")]
    run_in_process("train_vae_no_trainer.py", args + ["--pretrained_model_name_or_path", source])
    exported, original = torch_weights(os.path.join(output_dir, "vae")), torch_weights(source)
    assert not np.array_equal(exported["encoder.conv_in.weight"], original["encoder.conv_in.weight"])
    for key in BN_KEYS:
        assert_same_tensor(exported[key], original[key], key)


@pytest.mark.parametrize("flags,message", [
    (["--scaling_factor", "0.5"], "has no scaling_factor"),
    (["--freeze_encoder", "true", "--scaling_factor", "measure"], "keeps the source's bn statistics"),
])
def test_flux2_refuses_a_latent_scale_it_cannot_have(source, photo_filelist, tmp_path, flags, message):
    args = tiny_args(photo_filelist, str(tmp_path / "run"), max_steps=1)
    args = [a for a in args if a not in ("--vae_config_file", "configs/vae_micro.json")]
    with pytest.raises(AssertionError, match=message):
        run_entry_point("train_vae_no_trainer.py", args + ["--pretrained_model_name_or_path", source, *flags])


def test_a_flux2_vae_from_scratch_measures_its_statistics(scratch_run, exports_in_diffusers):
    """From a config file (class AutoencoderKLFlux2): the default is measure; diffusers loads the export."""
    record = json.load(open(os.path.join(scratch_run, "vae", "latent_stats.json")))
    assert record["source"].startswith("measured on")
    theirs = exports_in_diffusers["scratch"]
    assert theirs["loading_info"]["missing_keys"] == [] and int(theirs["num_batches_tracked"]) == 4
    assert np.abs(theirs["running_var"] - 1).max() > 1e-3  # not the fresh 1s


def test_run_script_fine_tunes_a_flux2_vae(source, photo_filelist, tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "FILE_LIST": photo_filelist, "OUTPUT_DIR": str(tmp_path / "out"),
           "RESOLUTION": "32", "BATCH_SIZE": "2", "MAX_STEPS": "1"}
    env.pop("VAE_CONFIG", None)
    result = subprocess.run(["bash", "scripts/run_single_no_trainer.sh", "--pretrained_model_name_or_path", source,
                             "--freeze_encoder", "true", "--disc_base_channels", "8", "--dataloader_num_workers", "0",
                             "--disable_tqdm", "true"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = torch_weights(str(tmp_path / "out" / "vae"))
    np.testing.assert_array_equal(exported["bn.running_mean"], torch_weights(source)["bn.running_mean"])
