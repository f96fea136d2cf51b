"""SANA's DC-AE (AutoencoderDC), issue 35: a diffusers folder in, fine-tuned by both entry points (decoder-only,
--trainable_modules, with EQ-VAE and the VF loss), trained from scratch, resumed exactly, run on 2 processes, and out
again into diffusers' own class; the flags that mean nothing without a posterior refused. The network's equality with
diffusers' is tests/test_autoencoder_dc.py's; here it is the trainer around it (models/families/dc_ae.py, the family seam)."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, load_script, read_scalars, run_entry_point, run_in_process
from family_parity import (DiffusersBatch, assert_loaded_exactly, assert_resume_is_exact, folder_pixels, mean_psnr,
                           random_images, trainer_args)
from safetensors.numpy import load_file

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.models.families.dc_ae import DC_AE
from vae_trainer.models.families import family_of
from vae_trainer.models.vae_loading import build_vae

# SANA-1.0-like, tiny: ResBlock stages then an EfficientViT stage, conv down / interpolate up, factor 4, 8 channels.
# One batch_norm decoder stage (the in / mix VAEs have them): its statistics train, or stay as loaded when frozen.
TINY_DC = dict(in_channels=3, latent_channels=8, attention_head_dim=8,
               encoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock"],
               decoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock"],
               encoder_block_out_channels=[16, 32, 32], decoder_block_out_channels=[16, 32, 32],
               encoder_layers_per_block=[1, 1, 1], decoder_layers_per_block=[1, 1, 1],
               encoder_qkv_multiscales=[[], [], [5]], decoder_qkv_multiscales=[[], [], [5]],
               upsample_block_type="interpolate", downsample_block_type="Conv",
               decoder_norm_types=["batch_norm", "rms_norm", "rms_norm"], decoder_act_fns="silu",
               scaling_factor=0.41407)
PADDLE_WEIGHTS = "diffusion_paddle_model.safetensors"
TORCH_WEIGHTS = "diffusion_pytorch_model.safetensors"


def weights(folder, name=PADDLE_WEIGHTS) -> dict:
    """A weight file's tensors: PyTorch's as they are (an export's in diffusers' own shapes, BatchNorm's counter
    0-d), Paddle's flattened (its counter is [1])."""
    state = load_file(os.path.join(folder, name))
    return state if name == TORCH_WEIGHTS else {key: value.reshape(-1) for key, value in state.items()}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """One diffusers process: a SANA-like pipeline download (its DC-AE in vae/, made and saved by diffusers with
    seeded weights), an fp16 variant of another seed, and diffusers' outputs of the download's DC-AE on the inputs
    the tests below give ours (whole, and tiled): {"pipeline", "fp16", "whole", "tiled"}."""
    root = tmp_path_factory.mktemp("sana_pipeline")
    batch = DiffusersBatch(root)
    batch.make("AutoencoderDC", root / "pipeline" / "vae", TINY_DC, seed=3)
    batch.make("AutoencoderDC", root / "fp16" / "vae", TINY_DC, seed=4, variant="fp16")
    for name in ("whole", "tiled"):
        os.makedirs(root / name)
    whole = batch.run("AutoencoderDC", root / "pipeline" / "vae", random_images(), root / "whole")
    tiled = batch.run("AutoencoderDC", root / "pipeline" / "vae", random_images(1, 64), root / "tiled", tile=32,
                      stride=24)
    batch.flush()
    return {"pipeline": str(root / "pipeline"), "fp16": str(root / "fp16" / "vae"), "whole": whole(),
            "tiled": tiled()}


@pytest.fixture(scope="module")
def pipeline(made) -> str:
    """A SANA-like pipeline download: its DC-AE in vae/, made and saved by diffusers with seeded weights."""
    return made["pipeline"]


# ---- in

def test_a_diffusers_dc_ae_folder_loads_with_its_scale_and_encodes_as_diffusers(pipeline, made):
    vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
    assert family_of(vae) is DC_AE and vae.config.scaling_factor == 0.41407
    x = random_images()
    theirs = made["whole"]
    assert_loaded_exactly(theirs, "AutoencoderDC")
    vae.eval()
    with paddle.no_grad():
        posterior = DC_AE.encode(vae, paddle.to_tensor(x))
        decoded = DC_AE.decode(vae, posterior.mode())
    assert posterior.logvar is None and posterior.var is None  # deterministic: no posterior, no KL
    np.testing.assert_allclose(posterior.mean.numpy(), theirs["latent"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(decoded.numpy(), theirs["decoded"], rtol=0, atol=1e-4)


def test_the_fp16_variant_of_a_download_loads_as_float32(made):
    folder = made["fp16"]
    assert sorted(os.listdir(folder)) == ["config.json", "diffusion_pytorch_model.fp16.safetensors"]
    vae = build_vae(pretrained_model_name_or_path=folder)
    stored = load_file(os.path.join(folder, "diffusion_pytorch_model.fp16.safetensors"))
    ours = vae.state_dict()["decoder.conv_in.weight"]
    assert ours.dtype == paddle.float32
    np.testing.assert_array_equal(ours.numpy(), stored["decoder.conv_in.weight"].astype(np.float32))


# ---- fine-tuned by both entry points

@pytest.fixture(scope="module")
def decoder_only(pipeline, photo_filelist, held_out_32, tmp_path_factory) -> dict:
    """Both drivers: decoder-only fine-tune of the download, evaluated at steps 2 and 4."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"dc_{driver.split('.')[0]}"))
        run_in_process(driver, trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=pipeline,
                                            subfolder="vae", freeze_encoder="true", eval_file_list=held_out_32,
                                            eval_steps=2, eval_num_images=6))
        out[driver] = output_dir
    return out


def test_both_drivers_fine_tune_a_dc_ae_to_the_same_numbers(decoder_only):
    trainer, loop = (decoder_only[driver] for driver in DRIVERS)
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/discriminator", "eval/psnr", "eval/lpips"):
        a, b = read_scalars(os.path.join(trainer, "logs"), tag), read_scalars(os.path.join(loop, "logs"), tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    assert not read_scalars(os.path.join(loop, "logs"), "loss/kl")  # no posterior: no KL term, not even a 0
    for folder in ("vae", "vae_raw"):
        wa, wb = weights(os.path.join(trainer, folder)), weights(os.path.join(loop, folder))
        assert wa.keys() == wb.keys()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


@pytest.fixture(scope="module")
def two_processes(pipeline, photo_filelist, tmp_path_factory) -> str:
    """The output folder of a 2-step whole-model fine-tune of the download on 2 processes (the Trainer's)."""
    root = tmp_path_factory.mktemp("dc_two")
    run_entry_point(DRIVERS[0], trainer_args(photo_filelist, str(root / "two"), pretrained_model_name_or_path=pipeline,
                                             subfolder="vae", max_steps=2), nproc=2, log_dir=root / "launch")
    return str(root / "two")


@pytest.fixture(scope="module")
def exports_in_diffusers(decoder_only, two_processes, held_out_32, tmp_path_factory) -> dict:
    """What diffusers' AutoencoderDC makes of the exports, one diffusers process: {"decoder_only": the loop's export
    on random images, "eval": the Trainer's export on the held-out images, "two_processes": on random images}."""
    root = tmp_path_factory.mktemp("dc_exports_in_diffusers")
    batch, results = DiffusersBatch(root), {}
    for name, folder, x in (("decoder_only", os.path.join(decoder_only[DRIVERS[1]], "vae"), random_images()),
                            ("eval", os.path.join(decoder_only[DRIVERS[0]], "vae"), folder_pixels(held_out_32)),
                            ("two_processes", os.path.join(two_processes, "vae"), random_images())):
        os.makedirs(root / name)
        results[name] = batch.run("AutoencoderDC", folder, x, root / name)
    batch.flush()
    return {name: read() for name, read in results.items()}


def test_decoder_only_keeps_the_encoder_and_the_scale_and_exports_for_diffusers(decoder_only, pipeline,
                                                                                exports_in_diffusers):
    source = weights(os.path.join(pipeline, "vae"), TORCH_WEIGHTS)
    output_dir = decoder_only[DRIVERS[1]]
    vae_dir = os.path.join(output_dir, "vae")
    exported = weights(vae_dir, TORCH_WEIGHTS)
    assert exported.keys() == source.keys()
    encoder = [name for name in source if name.startswith("encoder.")]
    for name in encoder:
        np.testing.assert_array_equal(exported[name], source[name], err_msg=name)
    changed = [name for name in source if not np.array_equal(exported[name], source[name])]
    assert changed and all(name.startswith("decoder.") for name in changed)
    assert "decoder.up_blocks.0.1.norm.running_mean" in changed  # the batch_norm stage's statistics trained
    config = json.load(open(os.path.join(vae_dir, "config.json")))
    stats = json.load(open(os.path.join(vae_dir, "latent_stats.json")))
    assert config["_class_name"] == "AutoencoderDC" and config["scaling_factor"] == 0.41407
    assert stats["source"].startswith("kept from the pretrained VAE") and "shift_factor" not in config
    assert stats["measured"]["statistic"].startswith("the latents")
    assert_loaded_exactly(exports_in_diffusers["decoder_only"], "AutoencoderDC")


def test_the_export_reconstructs_in_diffusers_as_eval_vae_says(decoder_only, held_out_32, exports_in_diffusers,
                                                              tmp_path):
    """eval_vae.py's PSNR of the exported folder is the PSNR of diffusers' own reconstructions of the same images."""
    vae_dir = os.path.join(decoder_only[DRIVERS[0]], "vae")
    result = load_script("eval_vae").main(["--vae", vae_dir, "--data", held_out_32, "--resolution", "32",
                                           "--num_images", "6", "--output_dir", str(tmp_path / "eval"),
                                           "--skip_lpips"])
    protocol = json.load(open(tmp_path / "eval" / "metrics.json"))["protocol"]
    assert protocol["latents"].startswith("the encoder's latent (deterministic")
    x = folder_pixels(held_out_32)
    theirs = exports_in_diffusers["eval"]
    assert result.metrics["psnr"] == pytest.approx(mean_psnr(theirs["decoded"], x), abs=1e-3)


def test_export_vae_writes_a_checkpoint_as_the_run_wrote_its_export(decoder_only, tmp_path):
    """scripts/export_vae.py on the last checkpoint: the class from its vae_config.json, the EMA weights, the kept
    factor: the same folder as the run's own vae/."""
    output_dir = decoder_only[DRIVERS[0]]
    out = str(tmp_path / "exported")
    load_script("export_vae").main([os.path.join(output_dir, "checkpoint-4"), out])
    ours, run = weights(out), weights(os.path.join(output_dir, "vae"))
    assert ours.keys() == run.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], run[name], err_msg=name)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["_class_name"] == "AutoencoderDC" and config["scaling_factor"] == 0.41407


def test_trainable_modules_train_those_alone_and_frozen_statistics_stay(pipeline, photo_filelist, tmp_path):
    """DC-AE's phase 3: the decoder's head alone (its output norm and conv), with the GAN; every other weight and
    the batch_norm stage's statistics go out as loaded."""
    output_dir = str(tmp_path / "head")
    run_in_process(DRIVERS[1], trainer_args(photo_filelist, output_dir, pretrained_model_name_or_path=pipeline,
                                            subfolder="vae", use_ema="false", ema_decay=None) +
                   ["--trainable_modules", "decoder.norm_out.*", "decoder.conv_out.*"])
    source, exported = weights(os.path.join(pipeline, "vae"), TORCH_WEIGHTS), weights(os.path.join(output_dir, "vae"),
                                                                                       TORCH_WEIGHTS)
    changed = {name for name in source if not np.array_equal(exported[name], source[name])}
    assert changed == {"decoder.norm_out.weight", "decoder.norm_out.bias", "decoder.conv_out.weight",
                       "decoder.conv_out.bias"}


def test_a_trainable_modules_pattern_matching_nothing_names_the_closest(pipeline):
    from vae_trainer.models.trainable import trainable_names

    vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
    named = dict(vae.named_parameters())
    with pytest.raises(ValueError, match=r"'decoder\.conv_outt\.\*' matches no parameter.*decoder\.conv_out\.\*"):
        trainable_names(named, "decoder.conv_outt.*")
    assert sorted(trainable_names(named, "encoder.conv_out.*")) == ["encoder.conv_out.bias", "encoder.conv_out.weight"]


def test_a_dc_ae_from_scratch_with_eq_vae_and_vf_gets_a_measured_scale(photo_filelist, tmp_path):
    from test_alignment import tiny_dinov2

    config = tmp_path / "dc.json"
    config.write_text(json.dumps({"_class_name": "AutoencoderDC", **TINY_DC}))
    output_dir = str(tmp_path / "scratch")
    run_in_process(DRIVERS[0], trainer_args(photo_filelist, output_dir, vae_config_file=config, equivariance_prob=0.5,
                                            vf_model_path=tiny_dinov2(tmp_path / "dino.safetensors"), bf16="true",
                                            recompute="true"))
    stats = json.load(open(os.path.join(output_dir, "vae", "latent_stats.json")))
    exported = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    assert stats["source"].startswith("measured on") and stats["scaling_factor"] != 0.41407
    assert exported["scaling_factor"] == stats["measured"]["suggested_scaling_factor"] == stats["scaling_factor"]
    assert read_scalars(os.path.join(output_dir, "logs"), "train/vf_loss")


def test_resume_of_a_dc_ae_run_is_exact(pipeline, photo_filelist, tmp_path):
    assert_resume_is_exact(photo_filelist, tmp_path, in_process=True, pretrained_model_name_or_path=pipeline,
                           subfolder="vae")


def test_ranks_average_the_statistics_of_training_batch_norms_only(pipeline):
    from vae_trainer.step import trained_norm_statistics

    vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
    norm = vae.decoder.up_blocks[0][1].norm  # the batch_norm stage's
    assert [id(t) for t in trained_norm_statistics(vae)] == [id(norm._mean), id(norm._variance)]
    for param in norm.parameters():  # frozen (--trainable_modules without it): kept as loaded, not averaged
        param.stop_gradient = True
    assert trained_norm_statistics(vae) == []


def test_a_dc_ae_fine_tunes_on_two_processes(pipeline, two_processes, exports_in_diffusers):
    output_dir = two_processes
    exported = json.load(open(os.path.join(output_dir, "vae", "config.json")))
    assert exported["_class_name"] == "AutoencoderDC" and exported["scaling_factor"] == 0.41407
    assert_loaded_exactly(exports_in_diffusers["two_processes"], "AutoencoderDC")
    source = weights(os.path.join(pipeline, "vae"), TORCH_WEIGHTS)
    trained = weights(os.path.join(output_dir, "vae"), TORCH_WEIGHTS)
    assert not np.array_equal(source["decoder.up_blocks.0.1.norm.running_mean"],
                              trained["decoder.up_blocks.0.1.norm.running_mean"])


# ---- the family's parts

def test_recompute_gives_the_same_gradients_and_statistics_and_leaves_the_last_layer_out(pipeline):
    """Every stage block is a segment but those holding a BatchNorm: recomputing their training forward in the
    backward would update the statistics twice."""
    from vae_trainer.models.recompute import enable_recompute

    grads, statistics = [], []
    for recompute in (False, True):
        vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
        vae.train()
        if recompute:
            names = enable_recompute(vae)
            blocks = [f"{coder}.{i}.{j}" for coder, stages in (("encoder.down_blocks", vae.encoder.down_blocks),
                                                                 ("decoder.up_blocks", vae.decoder.up_blocks))
                      for i, stage in enumerate(stages) for j, _ in enumerate(stage.children())]
            assert sorted(names) == sorted(set(blocks) - {"decoder.up_blocks.0.1"})  # its ResBlock has a BatchNorm
        x = paddle.to_tensor(random_images())
        DC_AE.decode(vae, DC_AE.encode(vae, x).mean).square().mean().backward()
        grads.append({name: p.grad.numpy() for name, p in vae.named_parameters() if p.grad is not None})
        norm = vae.decoder.up_blocks[0][1].norm
        statistics.append([norm._mean.numpy(), norm._variance.numpy(), norm.num_batches_tracked.numpy()])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, err_msg=name)
    for without, with_ in zip(*statistics):
        np.testing.assert_allclose(with_, without, rtol=1e-6)
    assert int(statistics[1][2][0]) == 1
    assert DC_AE.last_layers(vae)[0] is vae.decoder.conv_out.weight


def test_eval_tiling_is_diffusers_tiling_with_quarter_overlaps_and_restores_the_model(pipeline, made):
    vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
    vae.eval()
    x = random_images(1, 64)
    with paddle.no_grad():
        whole = DC_AE.encode(vae, paddle.to_tensor(x)).mean.numpy()
        with DC_AE.tiled(vae, 32):
            tiled = DC_AE.encode(vae, paddle.to_tensor(x)).mean
            decoded = DC_AE.decode(vae, tiled).numpy()
        assert not vae.use_tiling and vae.tile_sample_min_height == 512  # restored
    theirs = made["tiled"]  # diffusers' own tiling of x, 32 px tiles 24 apart
    np.testing.assert_allclose(tiled.numpy(), theirs["latent"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(decoded, theirs["decoded"], rtol=0, atol=1e-4)
    assert np.abs(tiled.numpy() - whole).max() > 1e-3  # really tiled


def test_a_config_without_class_name_is_read_by_its_keys(tmp_path):
    path = tmp_path / "dc.json"
    path.write_text(json.dumps(TINY_DC))
    assert family_of(build_vae(str(path))) is DC_AE


def test_objective_terms_reading_frozen_layers_are_refused_at_start(pipeline):
    from types import SimpleNamespace

    from vae_trainer.models.trainable import VAEWithDiscriminator

    loss = SimpleNamespace(disc_weight=0.5, adaptive_disc_weight=True, loss_balancing="none", equivariance_prob=0.0)

    def model(patterns, freeze_encoder=False, vf_feature_dim=None):
        vae = build_vae(pretrained_model_name_or_path=pipeline, subfolder="vae")
        return VAEWithDiscriminator(vae, paddle.nn.Identity(), freeze_encoder=freeze_encoder,
                                    vf_feature_dim=vf_feature_dim, trainable_modules=patterns)

    with pytest.raises(ValueError, match="adaptive GAN weight compares gradients at the decoder's last layer"):
        model(["encoder.conv_out.*", "decoder.conv_in.*"]).refuse_frozen_readers(loss)
    model(["encoder.conv_out.*", "decoder.conv_in.*"]).refuse_frozen_readers(
        SimpleNamespace(**{**vars(loss), "adaptive_disc_weight": False}))
    decoder_only = model(["decoder.*"], vf_feature_dim=16)
    assert decoder_only.encoder_frozen
    with pytest.raises(ValueError, match="aligns the latent space, and --trainable_modules leaves the encoder"):
        decoder_only.refuse_frozen_readers(loss)
    with pytest.raises(ValueError, match="shapes the latent space, and --trainable_modules leaves the encoder"):
        model(["decoder.*"]).refuse_frozen_readers(SimpleNamespace(**{**vars(loss), "equivariance_prob": 0.5}))
    with pytest.raises(ValueError, match=r"'encoder\.\*' names encoder weights only, which stay frozen \(--freeze_encoder keeps"):
        model(["encoder.*", "decoder.*"], freeze_encoder=True)


def test_the_decoder_last_layer_of_a_pixel_shuffle_head_is_its_conv(tmp_path):
    config = {**TINY_DC, "encoder_layers_per_block": [0, 1, 1], "decoder_layers_per_block": [0, 1, 1],
              "downsample_block_type": "pixel_unshuffle", "upsample_block_type": "pixel_shuffle"}
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"_class_name": "AutoencoderDC", **config}))
    vae = build_vae(str(path))
    assert DC_AE.last_layers(vae)[0] is vae.decoder.conv_out.conv.weight


# ---- refused

@pytest.mark.parametrize("flags,message", [
    (["--kl_weight", "1e-6"], "--kl_weight 1e-06: AutoencoderDC's encoder is deterministic"),
    (["--learn_logvar", "true"], "--learn_logvar true: with AutoencoderDC's deterministic encoder"),
    (["--sample_posterior", "true"], "--sample_posterior true: AutoencoderDC's encoder is deterministic"),
    (["--posterior_std", "0.1", "--sample_posterior", "false"], "--posterior_std 0.1: with AutoencoderDC's deterministic encoder"),
    (["--logvar_init", "1.0"], "--logvar_init 1.0: with AutoencoderDC's deterministic encoder"),
    (["--resolution", "48"], "--resolution 48 must be a multiple of the VAE's downsampling factor 32 (2 ** (stages - 1)"),
])
def test_flags_meaningless_for_a_dc_ae_are_refused_at_parse_time(flags, message, tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", "dc_ae_f32c32_sana.json"),
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64"] + flags
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_arguments(argv)


def test_what_a_deterministic_latent_still_takes_is_accepted(tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", os.path.join(REPO, "configs", "dc_ae_f32c32_sana.json"),
            "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "64"]
    for flags in (["--sample_posterior", "false"], ["--posterior_std", "0.1"], ["--recipe", "balanced"]):
        parse_arguments(argv + flags)


def test_a_config_key_unknown_or_missing_is_one_error_naming_file_and_key(pipeline, tmp_path):
    folder = tmp_path / "vae"
    shutil.copytree(os.path.join(pipeline, "vae"), folder)
    config = json.load(open(folder / "config.json"))
    (folder / "config.json").write_text(json.dumps({**config, "encoder_norm_types": "rms_norm"}))
    with pytest.raises(ValueError, match=rf"{folder}.*encoder_norm_types are not known"):
        build_vae(pretrained_model_name_or_path=str(folder))
    del config["decoder_act_fns"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{folder}.*lacks decoder_act_fns \(diffusers' defaults: "
                                         r"decoder_act_fns='silu'\)"):
        build_vae(pretrained_model_name_or_path=str(folder))


@pytest.mark.parametrize("change,message", [
    ({"decoder_act_fns": ["silu", "silu"]}, "decoder_act_fns is ['silu', 'silu'], for the 3 stages of "
     "decoder_block_out_channels [16, 32, 32]: give a list of one entry per stage (or one name for all)"),
    ({"encoder_qkv_multiscales": [[], [5]]}, "encoder_qkv_multiscales is [[], [5]], for the 3 stages"),
    ({"encoder_layers_per_block": 1}, "encoder_layers_per_block is 1, for the 3 stages"),
    ({"decoder_norm_types": None}, "decoder_norm_types is None, for the 3 stages"),
    ({"latent_channels": 5}, "encoder_out_shortcut needs latent_channels (5) to divide the last of "
                             "encoder_block_out_channels (32)"),
    ({"decoder_block_types": "FooBlock"}, "Block with block_type='FooBlock' is not supported"),
])
def test_a_config_of_impossible_stages_is_one_error_naming_file_and_key(change, message, tmp_path):
    path = tmp_path / "dc.json"
    path.write_text(json.dumps({"_class_name": "AutoencoderDC", **TINY_DC, **change}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*{re.escape(message)}"):
        build_vae(str(path))


def test_weights_that_do_not_fit_the_config_are_one_error(pipeline, tmp_path):
    folder = tmp_path / "vae"
    shutil.copytree(os.path.join(pipeline, "vae"), folder)
    config = json.load(open(folder / "config.json"))
    (folder / "config.json").write_text(json.dumps({**config, "latent_channels": 4}))
    with pytest.raises(ValueError, match=r"other shapes than this VAE's, e\.g\. .*encoder\.conv_out\.weight"):
        build_vae(pretrained_model_name_or_path=str(folder))


@pytest.fixture(scope="module")
def untrained_folder(tmp_path_factory) -> str:
    """A folder as a HunyuanVideo VAE download looks (a class not trained here)."""
    folder = tmp_path_factory.mktemp("hunyuan_vae")
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLHunyuanVideo", "latent_channels": 16,
                                                    "block_out_channels": [128, 256, 512, 512]}))
    (folder / TORCH_WEIGHTS).write_bytes(b"")
    return str(folder)


def test_a_class_not_trained_is_one_line_in_every_entry_point_and_script(untrained_folder, photo_filelist, tmp_path):
    import subprocess
    import sys

    expected = (f"error: {untrained_folder}/config.json: its \"_class_name\" is AutoencoderKLHunyuanVideo, a class "
                "this trainer does not train")
    commands = [[driver, "--file_list", photo_filelist, "--pretrained_model_name_or_path", untrained_folder,
                 "--max_steps", "1", "--output_dir", str(tmp_path / driver), "--device", "cpu"] for driver in DRIVERS]
    commands.append(["scripts/eval_vae.py", "--vae", untrained_folder, "--data", photo_filelist, "--output_dir",
                     str(tmp_path / "eval")])
    for command in commands:
        result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith(expected.split(": its")[0]), \
            (command[0], result.stderr[-2000:])
        assert "AutoencoderKLHunyuanVideo, a class this trainer does not train (yet); it trains" in lines[0]
        assert "Traceback" not in result.stderr
