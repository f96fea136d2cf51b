"""The representation autoencoder (AutoencoderRAE), issue 36: a diffusers RAE folder's decoder fine-tuned by both entry
points (the encoder and the latent statistics out bit-identical), a decoder trained from scratch on a DINOv2 folder
(its latents_mean / latents_std measured on the training data, as RAE's stat.pt, equal to an independent
computation), 2 processes under the launcher, the exports in diffusers' own class, the authors' files converted
(scripts/convert_rae.py), RAE's DINO discriminator and DiffAugment against numpy, and the refusals. The network's
equality with diffusers' is tests/test_autoencoder_rae.py's; here it is the trainer around it (models/families/rae.py).

The PyTorch side (diffusers 0.42.1, transformers 5.24) runs in .venv-flux2 (tests/diffusers_side.py), twice per
module: once to make the sources, once to read the results.
"""

from __future__ import annotations

import json
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, REPO, load_script, read_scalars, run_entry_point, run_in_process
from family_parity import DiffusersBatch, assert_loaded_exactly
from PIL import Image
from safetensors.numpy import load_file

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.models.families import family_of
from vae_trainer.models.families.rae import RAE
from vae_trainer.models.vae_loading import build_vae

ENCODER = dict(encoder_hidden_size=64, encoder_patch_size=14, encoder_num_hidden_layers=2)
DECODER = dict(decoder_hidden_size=32, decoder_num_hidden_layers=2, decoder_num_attention_heads=2,
               decoder_intermediate_size=64)
# A released folder's shape, tiny: 2 x 2 tokens (input 28), patch 16: 32 px; statistics per channel and position.
_RNG = np.random.default_rng(11)
TINY_RAE = dict(ENCODER, **DECODER, encoder_input_size=28, patch_size=16, noise_tau=0.8,
                latents_mean=(_RNG.normal(size=(64, 2, 2)) * 0.3).round(4).tolist(),
                latents_std=_RNG.uniform(0.5, 1.5, size=(64, 2, 2)).round(4).tolist())
# The authors' layout: their decoders see 16 x 16 tokens (224 px), here decoding 2 px patches: 32 px.
RELEASE = dict(ENCODER, **DECODER, encoder_input_size=224, patch_size=2)
DINOV2 = dict(hidden_size=64, num_attention_heads=1, num_hidden_layers=2, patch_size=14, image_size=518,
              num_register_tokens=4)
# A DINO ViT-S/8's layout, 64 wide (its heads are 64 wide, as ViT-S/8's: a torch-hub file does not say them).
DINO_VIT = dict(hidden_size=64, num_attention_heads=1, num_hidden_layers=4, intermediate_size=256, patch_size=8,
                image_size=224)
SCRATCH = {"_class_name": "AutoencoderRAE", "encoder_input_size": 28, **DECODER, "patch_size": 16}
TORCH_WEIGHTS = "diffusion_pytorch_model.safetensors"
NUM_PHOTOS = 12
SAMPLED = 6  # the photos from scratch measures on, drawn from all 12 (the first 6 of the sorted folder: no astronaut)


def rae_args(file_list, output_dir, **overrides):
    """A few steps of the tiny RAE at 32 px on CPU: LPIPS, RAE's DINO discriminator trained from step 2 (1-based)
    and in the loss from step 3, the authors' clamp and factor, EMA."""
    args = {"file_list": file_list, "output_dir": output_dir, "resolution": 32, "per_device_train_batch_size": 2,
            "max_steps": 4, "disc_start": 2, "disc_update_start": 1, "logging_steps": 1, "save_steps": 2, "seed": 5,
            "device": "cpu", "dataloader_num_workers": 0, "learning_rate": 2e-3, "disable_tqdm": "true",
            "use_ema": "true", "ema_decay": 0.9, "disc_weight": 0.75, "adaptive_disc_weight_max": 1e4}
    args.update(overrides)
    return [str(item) for key, value in args.items() if value is not None for item in (f"--{key}", value)]


def weights(folder, name=TORCH_WEIGHTS) -> dict:
    return load_file(os.path.join(folder, name))


def photos_on_unit_range(folder) -> np.ndarray:
    names = sorted(os.listdir(folder))
    return np.stack([np.asarray(Image.open(os.path.join(folder, n)).convert("RGB"), np.float32) / 255.0
                     for n in names]).transpose(0, 3, 1, 2)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    """12 32x32 PNG crops of photos: the evaluation's and the measurement's resize and crop leave them as they are."""
    import skimage.data

    root = tmp_path_factory.mktemp("photos_32")
    for k, photo in enumerate((skimage.data.coffee(), skimage.data.rocket(), skimage.data.astronaut())):
        for j in range(4):
            Image.fromarray(photo[40 + 32 * j: 72 + 32 * j, 100:132]).save(root / f"crop_{k}_{j}.png")
    return str(root)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Made by diffusers / transformers: a released-style RAE folder (in vae/), a DINOv2 with registers, a DINO ViT
    (folder and torch-hub file), the authors' files of a decoder."""
    root = tmp_path_factory.mktemp("rae_sources")
    batch = DiffusersBatch(root)
    batch.make("AutoencoderRAE", root / "pipeline" / "vae", TINY_RAE, seed=3)
    for command, folder, config in (("dinov2", "dinov2", DINOV2), ("vit", "vit", DINO_VIT),
                                    ("rae_release", "release", RELEASE)):
        batch.command(command, root / folder, "--config", json.dumps(config), "--seed", 2)
    batch.flush()
    return {name: str(root / name) for name in ("pipeline", "dinov2", "vit", "release")}


# ---- fine-tuned by both entry points

@pytest.fixture(scope="module")
def fine_tuned(sources, photos, tmp_path_factory) -> dict:
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(f"rae_{driver.split('.')[0]}"))
        run_in_process(driver, rae_args(photos, output_dir, pretrained_model_name_or_path=sources["pipeline"],
                                        subfolder="vae", disc_type="dino", disc_backbone_path=sources["vit"],
                                        eval_file_list=photos, eval_steps=2, eval_num_images=4))
        out[driver] = output_dir
    return out


@pytest.fixture(scope="module")
def scratch(sources, photos, tmp_path_factory) -> str:
    """A decoder from scratch on the DINOv2 folder, trained with RAE's noise, recomputed, measured on a random
    sample of the photos."""
    root = tmp_path_factory.mktemp("rae_scratch")
    (root / "rae.json").write_text(json.dumps(SCRATCH))
    output_dir = str(root / "out")
    run_in_process(DRIVERS[0], rae_args(photos, output_dir, vae_config_file=root / "rae.json",
                                        rae_encoder_path=sources["dinov2"], noise_tau=0.8, recompute="true",
                                        latent_stats_num_images=SAMPLED, use_ema="false", ema_decay=None))
    return output_dir


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("rae_converted") / "vae")
    release = sources["release"]
    load_script("convert_rae").main(["--decoder", os.path.join(release, "model.pt"), "--stats",
                                     os.path.join(release, "stat.pt"), "--encoder", sources["dinov2"],
                                     "--output_dir", out, "--decoder_heads", "2"])
    return out


@pytest.fixture(scope="module")
def in_diffusers(sources, photos, fine_tuned, scratch, converted, tmp_path_factory) -> dict:
    """What diffusers' AutoencoderRAE makes of the photos (on [0, 1]) in each folder, and transformers' tokens of
    the photos by the DINOv2 (the statistics' independent computation): one diffusers process."""
    root = tmp_path_factory.mktemp("rae_in_diffusers")
    images = photos_on_unit_range(photos)
    np.save(root / "photos.npy", images)
    batch, results = DiffusersBatch(root), {}
    folders = {"source": os.path.join(sources["pipeline"], "vae"), "fine_tuned": os.path.join(fine_tuned[DRIVERS[1]],
                                                                                                "vae"),
               "scratch": os.path.join(scratch, "vae"), "converted": converted}
    for name, folder in folders.items():
        os.makedirs(root / name)
        results[name] = batch.run("AutoencoderRAE", folder, images, root / name)
    batch.command("rae_tokens", sources["dinov2"], "--images", root / "photos.npy", "--out", root / "tokens.npy",
                  "--input_size", 28)
    batch.flush()
    return {"images": images, "tokens": np.load(root / "tokens.npy"), **{k: read() for k, read in results.items()}}


def test_a_diffusers_rae_folder_encodes_and_decodes_as_diffusers_on_the_trainers_range(sources, in_diffusers):
    vae = build_vae(pretrained_model_name_or_path=sources["pipeline"], subfolder="vae")
    assert family_of(vae) is RAE and vae.noise_tau == 0.8
    theirs = in_diffusers["source"]
    assert_loaded_exactly(theirs, "AutoencoderRAE")
    vae.eval()
    with paddle.no_grad():  # the trainer's images are on [-1, 1], diffusers' RAE's on [0, 1]
        latent = RAE.encode(vae, paddle.to_tensor(in_diffusers["images"] * 2 - 1))
        decoded = RAE.decode(vae, latent.mode())
    assert latent.logvar is None  # deterministic: no KL
    np.testing.assert_allclose(latent.mean.numpy(), theirs["latent"], rtol=0, atol=1e-4)
    np.testing.assert_allclose((decoded.numpy() + 1) / 2, theirs["decoded"], rtol=0, atol=1e-4)


def test_both_drivers_fine_tune_an_rae_decoder_to_the_same_numbers(fine_tuned):
    trainer, loop = (os.path.join(fine_tuned[driver], "logs") for driver in DRIVERS)
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/generator", "loss/discriminator",
                "gan/adaptive_weight", "eval/psnr", "eval/lpips"):
        a, b = read_scalars(trainer, tag), read_scalars(loop, tag)
        assert a and a == pytest.approx(b, rel=1e-6), tag
    assert sorted(read_scalars(loop, "loss/discriminator")) == [2, 3, 4]  # --disc_update_start 1 (0-based)
    assert sorted(read_scalars(loop, "loss/generator")) == [3, 4]  # --disc_start 2: the term enters later
    assert not read_scalars(loop, "loss/kl")
    for folder in ("vae", "vae_raw"):
        wa, wb = (weights(os.path.join(fine_tuned[d], folder)) for d in DRIVERS)
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)


def test_a_fine_tune_keeps_the_encoder_and_the_statistics_bit_identical(fine_tuned, sources, in_diffusers):
    source = weights(os.path.join(sources["pipeline"], "vae"))
    for folder in ("vae", "vae_raw"):  # the EMA's and the raw weights
        exported = weights(os.path.join(fine_tuned[DRIVERS[1]], folder))
        assert exported.keys() == source.keys()
        kept = [n for n in source if not n.startswith("decoder.")]
        assert {"_latents_mean", "_latents_std", "encoder_mean", "encoder_std"} <= set(kept)
        for name in kept:
            np.testing.assert_array_equal(exported[name], source[name], err_msg=name)
        assert all(not np.array_equal(exported[n], source[n]) for n in source if n.startswith("decoder.decoder_layers"))
    vae_dir = os.path.join(fine_tuned[DRIVERS[1]], "vae")
    config, original = (json.load(open(os.path.join(f, "config.json"))) for f in (vae_dir, os.path.join(
        sources["pipeline"], "vae")))
    assert config["latents_mean"] == original["latents_mean"] and config["latents_std"] == original["latents_std"]
    assert config["noise_tau"] == 0.8 and config["scaling_factor"] == 1.0
    assert json.load(open(os.path.join(vae_dir, "latent_stats.json")))["source"].startswith("kept from the pretrained")
    theirs = in_diffusers["fine_tuned"]
    assert_loaded_exactly(theirs, "AutoencoderRAE")
    np.testing.assert_allclose(theirs["latent"], in_diffusers["source"]["latent"], rtol=0, atol=1e-6)
    vae = build_vae(pretrained_model_name_or_path=vae_dir)
    vae.eval()
    with paddle.no_grad():
        ours = RAE.decode(vae, paddle.to_tensor(theirs["latent"])).numpy()
    np.testing.assert_allclose((ours + 1) / 2, theirs["decoded"], rtol=0, atol=1e-4)


def test_the_export_reconstructs_in_diffusers_as_eval_vae_says(fine_tuned, photos, in_diffusers, tmp_path):
    vae_dir = os.path.join(fine_tuned[DRIVERS[1]], "vae")
    result = load_script("eval_vae").main(["--vae", vae_dir, "--data", photos, "--resolution", "32", "--num_images",
                                           str(NUM_PHOTOS), "--output_dir", str(tmp_path / "eval"), "--skip_lpips"])
    record = json.load(open(tmp_path / "eval" / "metrics.json"))
    assert "token statistics" in record["protocol"] and "patchified_mode_mean" not in record
    x, recon = in_diffusers["images"], np.clip(in_diffusers["fine_tuned"]["decoded"], 0, 1)
    psnr = 10 * np.log10(1 / ((recon - x) ** 2).reshape(len(x), -1).mean(axis=1))
    assert result.metrics["psnr"] == pytest.approx(float(psnr.mean()), abs=1e-3)


def test_eval_vae_scores_the_authors_layout_with_statistics_per_position(converted, photos, in_diffusers, tmp_path):
    """16 x 16 tokens normalised per channel and position (their stat.pt): a halved grid has no statistics to
    denormalise by, so scale equivariance is left out; the rest is measured, as diffusers reconstructs."""
    result = load_script("eval_vae").main(["--vae", converted, "--data", photos, "--resolution", "32", "--num_images",
                                           str(NUM_PHOTOS), "--output_dir", str(tmp_path / "eval"), "--skip_lpips"])
    assert "scale_equivariance_psnr" not in result.metrics and "rotation_equivariance_psnr" in result.metrics
    x, recon = in_diffusers["images"], np.clip(in_diffusers["converted"]["decoded"], 0, 1)
    psnr = 10 * np.log10(1 / ((recon - x) ** 2).reshape(len(x), -1).mean(axis=1))
    assert result.metrics["psnr"] == pytest.approx(float(psnr.mean()), abs=1e-3)


# ---- from scratch on a DINOv2

def test_from_scratch_the_statistics_are_the_tokens_per_channel_and_position(scratch, sources, photos, in_diffusers):
    """latents_mean / latents_std = the mean and sqrt(population variance + 1e-5) of transformers' own tokens over
    the photos of the seeded random sample of all 12 (not the sorted folder's first ones), each once; diffusers'
    encode then gives normalised latents."""
    from vae_trainer.data.filelists import read_sources
    from vae_trainer.data.sharding import RecordSample

    names = sorted(os.listdir(photos))
    chosen = sorted(names.index(os.path.basename(record.part.path))
                    for _, record in RecordSample(read_sources(photos), seed=5).take(SAMPLED))
    assert len(set(chosen)) == SAMPLED and chosen != list(range(SAMPLED)) and max(chosen) >= 8  # astronaut crops
    vae_dir = os.path.join(scratch, "vae")
    config = json.load(open(os.path.join(vae_dir, "config.json")))
    tokens = in_diffusers["tokens"].astype(np.float64)[chosen]  # (6, 64, 2, 2)
    assert np.shape(config["latents_mean"]) == (64, 2, 2) and config["scaling_factor"] == 1.0
    np.testing.assert_allclose(config["latents_mean"], tokens.mean(axis=0), rtol=0, atol=2e-5)
    # (atol: ours and transformers' float32 tokens differ by ~1e-6, 2.3e-5 of the smallest std, 0.03, here)
    np.testing.assert_allclose(config["latents_std"], np.sqrt(tokens.var(axis=0) + RAE.normalisation.eps), rtol=2e-5,
                               atol=2e-6)
    exported = weights(vae_dir)
    np.testing.assert_array_equal(exported["_latents_mean"], np.asarray(config["latents_mean"], np.float32))
    stats = json.load(open(os.path.join(vae_dir, "latent_stats.json")))
    assert stats["source"].startswith(f"measured on an encoder-only pass over a random sample (seed 5) of {SAMPLED} "
                                      f"of the {NUM_PHOTOS} images")
    assert stats["measured"]["statistic"].startswith("per channel and position of the encoder's tokens")
    theirs = in_diffusers["scratch"]
    assert_loaded_exactly(theirs, "AutoencoderRAE")
    assert np.abs(theirs["latent"][chosen].mean(axis=0)).max() < 1e-4
    unit = tokens.std(axis=0) / (np.sqrt(tokens.var(axis=0) + RAE.normalisation.eps) + 1e-5)  # 1 but for the eps
    np.testing.assert_allclose(theirs["latent"][chosen].std(axis=0), unit, rtol=0, atol=1e-3)


def test_from_scratch_the_encoder_is_the_dinov2_bit_for_bit_and_noise_tau_is_recorded(scratch, sources):
    from vae_trainer.models.autoencoder_rae import encoder_state_from_dinov2

    state, sizes = encoder_state_from_dinov2(sources["dinov2"])
    exported = weights(os.path.join(scratch, "vae"), "diffusion_paddle_model.safetensors")
    assert all(np.array_equal(exported[name], value) for name, value in state.items())
    config = json.load(open(os.path.join(scratch, "vae", "config.json")))
    assert {k: config[k] for k in sizes} == sizes and config["noise_tau"] == 0.8


def test_two_processes_measure_the_same_statistics(sources, photos, scratch, tmp_path):
    (tmp_path / "rae.json").write_text(json.dumps(SCRATCH))
    output_dir = tmp_path / "two"
    run_entry_point(DRIVERS[1], rae_args(photos, str(output_dir), vae_config_file=tmp_path / "rae.json",
                                         rae_encoder_path=sources["dinov2"], max_steps=2, use_ema="false",
                                         ema_decay=None, latent_stats_num_images=SAMPLED, disc_type="dino",
                                         disc_backbone_path=sources["vit"] + ".pth"),
                    nproc=2, log_dir=tmp_path / "launch")
    two, one = (json.load(open(os.path.join(d, "vae", "config.json"))) for d in (output_dir, scratch))
    stats = json.load(open(output_dir / "vae" / "latent_stats.json"))
    assert stats["measured"]["num_images"] == SAMPLED  # the same sample, each rank its share, not all of it twice
    np.testing.assert_allclose(two["latents_mean"], one["latents_mean"], rtol=0, atol=1e-6)
    # (summed in another order: a std of 0.03 over 6 images moves by 1e-6 of itself; another image, by far more)
    np.testing.assert_allclose(two["latents_std"], one["latents_std"], rtol=1e-5, atol=0)


# ---- the authors' files

def test_the_authors_files_convert_to_a_folder_diffusers_loads(converted, sources, in_diffusers):
    release = sources["release"]
    ours, reference = weights(converted), weights(os.path.join(release, "diffusers"))
    for name in (n for n in reference if n.startswith("decoder.")):
        np.testing.assert_array_equal(ours[name], reference[name], err_msg=name)
    from vae_trainer.models.torch_files import read_state_dict

    stat = read_state_dict(os.path.join(release, "stat.pt"))
    np.testing.assert_array_equal(ours["_latents_mean"], stat["mean"])
    np.testing.assert_allclose(ours["_latents_std"], np.sqrt(stat["var"].astype(np.float64) + 1e-5), rtol=1e-7)
    assert_loaded_exactly(in_diffusers["converted"], "AutoencoderRAE")
    vae = build_vae(pretrained_model_name_or_path=converted)  # what a fine-tune loads
    assert vae.config.noise_tau == 0.8 and vae.config.encoder_input_size == 224
    vae.eval()
    with paddle.no_grad():
        latent = RAE.encode(vae, paddle.to_tensor(in_diffusers["images"] * 2 - 1)).mean.numpy()
    np.testing.assert_allclose(latent, in_diffusers["converted"]["latent"], rtol=0, atol=1e-4)


def test_a_training_checkpoint_converts_its_ema_and_refuses_what_does_not_fit(sources, tmp_path):
    release, convert = sources["release"], load_script("convert_rae").main
    common = ["--encoder", sources["dinov2"], "--decoder", os.path.join(release, "ep.pt")]
    convert(common + ["--output_dir", str(tmp_path / "ema"), "--decoder_heads", "2"])
    ema, reference = weights(tmp_path / "ema"), weights(os.path.join(release, "diffusers"))
    name = "decoder.decoder_layers.0.intermediate.dense.bias"
    np.testing.assert_array_equal(ema[name], reference[name] + 1)  # the file's EMA, not its "model"
    assert "_latents_mean" in ema and ema["_latents_mean"].shape == (1,)  # no --stats: unset
    with pytest.raises(SystemExit, match="width 32, not one of the released ones.*--decoder_heads N"):
        convert(common + ["--output_dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"--stats .*mean \[64, 16, 16\].*expected the latent's shape \[64, 2, 2\]"):
        convert(common + ["--output_dir", str(tmp_path / "y"), "--decoder_heads", "2", "--encoder_input_size", "28",
                          "--stats", os.path.join(release, "stat.pt")])


# ---- the family's parts

def test_noise_only_in_training_and_the_tokens_never_noised(sources):
    vae = build_vae(pretrained_model_name_or_path=sources["pipeline"], subfolder="vae", noise_tau=0.5)
    assert vae.noise_tau == 0.5 and vae.config.noise_tau == 0.5
    x = paddle.to_tensor(np.random.default_rng(0).uniform(-1, 1, (4, 3, 32, 32)).astype(np.float32))
    with paddle.no_grad():
        vae.eval()
        clean = RAE.encode(vae, x)
        assert np.array_equal(clean.mean.numpy(), RAE.encode(vae, x).mean.numpy())
        vae.train()
        noisy = RAE.encode(vae, x)
    assert not np.allclose(noisy.mean.numpy(), clean.mean.numpy(), atol=1e-3)
    np.testing.assert_array_equal(noisy.raw.numpy(), clean.raw.numpy())  # statistics: of clean tokens
    view = RAE.normalisation.view(vae, clean)
    assert view.shape == [4, 64 * 2 * 2, 1, 1]


def test_the_encoder_stays_frozen_whatever_the_flags(sources):
    from vae_trainer.models.trainable import VAEWithDiscriminator

    vae = build_vae(pretrained_model_name_or_path=sources["pipeline"], subfolder="vae")
    with pytest.raises(ValueError, match="'encoder.*' names encoder weights only, which stay frozen"):
        VAEWithDiscriminator(vae, paddle.nn.Linear(1, 1), trainable_modules=["encoder.*", "decoder.*"])
    model = VAEWithDiscriminator(vae, paddle.nn.Linear(1, 1), freeze_encoder=False, trainable_modules=["*"])
    assert model.encoder_frozen and all(p.stop_gradient for p in vae.encoder.parameters())
    frozen = [id(layer) for layer in model.frozen_layers()]  # kept float32 under O2
    assert id(vae.encoder.embeddings) in frozen and id(vae.encoder.encoder.layer[1].mlp.fc2) in frozen
    assert not any(p.stop_gradient for p in vae.decoder.parameters())


def test_recompute_gives_the_same_gradients_and_leaves_the_last_layer_out(sources):
    from vae_trainer.models.recompute import enable_recompute

    grads = []
    for recompute in (False, True):
        vae = build_vae(pretrained_model_name_or_path=sources["pipeline"], subfolder="vae")
        if recompute:
            assert enable_recompute(vae) == ["decoder.decoder_layers.0", "decoder.decoder_layers.1"]
        x = paddle.to_tensor(np.random.default_rng(1).uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32))
        paddle.seed(0)  # the same training noise
        RAE.decode(vae, RAE.encode(vae, x).mean).square().mean().backward()
        grads.append({n: p.grad.numpy() for n, p in vae.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(n.startswith("decoder.") for n in grads[0])
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert RAE.last_layers(vae)[0] is vae.decoder.decoder_pred.weight


# ---- the DINO discriminator

def _layer_norm(x, weight, bias, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * weight + bias


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _numpy_vit_taps(state, images, patch, heads, key_blocks):
    """The ViT's patch tokens [B, C, L] after its last block and after each key block: numpy, from the weights."""
    b = images.shape[0]
    x = paddle.nn.functional.interpolate(paddle.to_tensor(images), size=[224, 224], mode="bilinear",
                                         align_corners=False).numpy()  # the resize: Paddle's (torch's) bilinear
    mean, std = np.array([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1), np.array([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)
    x = ((x + 1) / 2 - mean) / std
    grid = 224 // patch
    patches = x.reshape(b, 3, grid, patch, grid, patch).transpose(0, 2, 4, 1, 3, 5).reshape(b, grid * grid, -1)
    kernel = state["patch_embed.proj.weight"]  # [C, 3, p, p]
    x = patches @ kernel.reshape(kernel.shape[0], -1).T + state["patch_embed.proj.bias"]
    cls = state["cls_token"] + state["pos_embed"][:, :1]
    x = np.concatenate([np.repeat(cls, b, 0), x + state["pos_embed"][:, 1:]], axis=1)
    width, taps = x.shape[-1], []
    for i in range(1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))):
        p = lambda name: state[f"blocks.{i}.{name}"]  # noqa: E731
        h = _layer_norm(x, p("norm1.weight"), p("norm1.bias"), 1e-6)
        qkv = (h @ p("attn.qkv.weight") + p("attn.qkv.bias")).reshape(b, -1, 3, heads, width // heads)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(width // heads)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        out = (attn @ v).transpose(0, 2, 1, 3).reshape(b, -1, width)
        x = x + out @ p("attn.proj.weight") + p("attn.proj.bias")
        h = _layer_norm(x, p("norm2.weight"), p("norm2.bias"), 1e-6)
        x = x + _gelu_tanh(h @ p("mlp.fc1.weight") + p("mlp.fc1.bias")) @ p("mlp.fc2.weight") + p("mlp.fc2.bias")
        if i in key_blocks:
            taps.append(x[:, 1:].transpose(0, 2, 1))
    return [x[:, 1:].transpose(0, 2, 1)] + taps


def _numpy_conv(x, conv):
    """A spectral-normalised circular Conv1D in eval mode: W / (u . W v) with its stored u, v."""
    weight = conv.weight_orig.numpy()
    matrix = weight.reshape(weight.shape[0], -1)
    weight = weight / (conv.weight_u.numpy() @ matrix @ conv.weight_v.numpy())
    k = weight.shape[2]
    padded = np.concatenate([x[..., -(k // 2):], x, x[..., :k // 2]], axis=-1) if k > 1 else x
    windows = np.stack([padded[..., j:j + x.shape[-1]] for j in range(k)], axis=-1)  # [B, C, L, k]
    return np.einsum("bclk,ock->bol", windows, weight) + conv.bias.numpy()[None, :, None]


def _numpy_block(x, block):
    conv, norm = block[0], block[1]
    y = _numpy_conv(x, conv)
    y = (y - y.mean(2, keepdims=True)) / np.sqrt(y.var(2, keepdims=True) + 1e-6)
    y = y * norm.weight.numpy()[None, :, None] + norm.bias.numpy()[None, :, None]
    return np.where(y > 0, y, 0.2 * y)


def test_the_dino_discriminators_heads_equal_numpy(sources):
    from vae_trainer.models.dinov2 import read_dinov2
    from vae_trainer.models.discriminator import build_discriminator

    paddle.seed(4)
    disc = build_discriminator("dino", weights_path=sources["vit"])
    assert [n for n, _ in disc.named_parameters()] and not any("blocks" in n for n in disc.state_dict())
    images = np.random.default_rng(2).uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32)
    with paddle.no_grad():
        logits = disc.classify(paddle.to_tensor(images)).numpy()
    state, _ = read_dinov2(sources["vit"])
    taps = _numpy_vit_taps(state, images, 8, 1, (2,))
    expected = []
    for head, tokens in zip(disc.heads, taps):
        x = _numpy_block(tokens, head[0])
        x = (_numpy_block(x, head[1].block) + x) / np.sqrt(2)
        expected.append(_numpy_conv(x, head[2]).reshape(2, -1))
    assert logits.shape == (2, 2 * 28 * 28)
    np.testing.assert_allclose(logits, np.concatenate(expected, axis=1), rtol=1e-3, atol=2e-4)
    hub = build_discriminator("dino", weights_path=sources["vit"] + ".pth")  # the torch-hub layout: the same ViT
    hub.set_state_dict(disc.state_dict())
    with paddle.no_grad():
        np.testing.assert_allclose(hub.classify(paddle.to_tensor(images)).numpy(), logits, rtol=1e-5, atol=1e-6)


def test_diff_augment_translates_then_colours_each_image_as_stylegan_t(sources):
    from vae_trainer.models.discriminator import diff_augment

    images = np.random.default_rng(3).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    draws = np.array([[0.0, 0.999], [0.5, 0.2], [0.1, 0.9], [0.3, 0.8], [0.0, 0.7]], np.float32)
    out = diff_augment(paddle.to_tensor(images), paddle.to_tensor(draws)).numpy()
    expected = np.zeros_like(images)
    for i in range(2):  # shifts of floor(draw * 5) - 2 pixels (16 / 8 = 2), zeros shifted in
        dy, dx = int(np.floor(draws[0, i] * 5)) - 2, int(np.floor(draws[1, i] * 5)) - 2
        for y in range(16):
            for x in range(16):
                if 0 <= y + dy < 16 and 0 <= x + dx < 16:
                    expected[i, :, y, x] = images[i, :, y + dy, x + dx]
        z = expected[i] + draws[2, i] - 0.5
        z = (z - z.mean(0)) * 2 * draws[3, i] + z.mean(0)
        expected[i] = (z - z.mean()) * (draws[4, i] + 0.5) + z.mean()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    x = paddle.to_tensor(images, stop_gradient=False)
    diff_augment(x).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0  # differentiable: the generator's term uses it


def test_the_discriminator_quantises_and_iterates_only_on_its_own_step(sources):
    from vae_trainer.models.discriminator import build_discriminator, diff_augment, quantized

    disc = build_discriminator("dino", weights_path=sources["vit"])
    disc.train()
    conv = disc.heads[0][0][0]
    u = conv.weight_u.numpy().copy()
    fake = paddle.to_tensor(np.random.default_rng(4).uniform(-1.2, 1.2, (2, 3, 32, 32)).astype(np.float32),
                            stop_gradient=False)
    disc(fake)  # the generator's pass: no power iteration
    np.testing.assert_array_equal(conv.weight_u.numpy(), u)
    before = {name: value.numpy().copy() for name, value in disc.state_dict().items()}
    paddle.seed(9)
    detached = disc(fake.detach()).numpy()  # the discriminator's step: 8-bit input, power iteration
    assert not np.array_equal(conv.weight_u.numpy(), u)
    for images, same in ((quantized(fake.detach()), True), (fake.detach(), False)):
        disc.set_state_dict(before)
        paddle.seed(9)
        with paddle.no_grad():
            logits = disc.classify(diff_augment(images), power_iteration=True).numpy()
        assert np.array_equal(logits, detached) == same


# ---- refused

@pytest.fixture(scope="module")
def rae_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rae_config") / "rae.json"
    path.write_text(json.dumps(SCRATCH))
    return str(path)


@pytest.mark.parametrize("flags,message", [
    (["--kl_weight", "1e-6"], "--kl_weight 1e-06: AutoencoderRAE's encoder is deterministic"),
    (["--vf_model_path", "dino.pth"], "--vf_model_path dino.pth: it aligns the latents with a DINOv2, and the latent "
                                      "is AutoencoderRAE's frozen representation encoder's"),
    (["--equivariance_prob", "0.5"], "--equivariance_prob 0.5: it shapes the latent space, and the latent is "
                                     "AutoencoderRAE's frozen"),
    (["--resolution", "64"], "AutoencoderRAE decodes 32x32 images whatever its input.*--resolution 32"),
    (["--aspect_ratio_buckets", "true"], "--aspect_ratio_buckets: this VAE .* decodes square images only"),
    (["--eval_tiled", "true", "--eval_file_list", "x", "--eval_steps", "1"],
     "--eval_tiled: AutoencoderRAE has no tiled"),
    (["--disc_type", "dino"], "--disc_type dino: the DINO discriminator needs its frozen ViT-S/8: add "
                              "--disc_backbone_path"),
    (["--disc_update_start", "9", "--disc_start", "3"], "--disc_update_start 9: it starts the discriminator's training "
                                                        "at or before"),
    (["--adaptive_disc_weight_max", "1e4", "--adaptive_disc_weight", "false"], "--adaptive_disc_weight_max 10000.0: "
                                                                               "it bounds"),
    (["--disc_backbone_path", "vit"], "--disc_backbone_path vit: it is the ViT of --disc_type dino"),
    (["--noise_tau", "-1"], "--noise_tau -1.0: it is a noise level"),
])
def test_flags_meaningless_for_an_rae_are_refused_at_parse_time(flags, message, rae_config, tmp_path):
    argv = ["--file_list", "x", "--vae_config_file", rae_config, "--max_steps", "1", "--output_dir", str(tmp_path),
            "--resolution", "32"] + flags
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_arguments(argv)


def test_rae_flags_elsewhere_are_one_error_naming_them(sources, rae_config, tmp_path):
    argv = ["--file_list", "x", "--max_steps", "1", "--output_dir", str(tmp_path), "--resolution", "32"]
    with pytest.raises(ValueError, match="--rae_encoder_path d: it is the encoder of an RAE decoder"):
        parse_arguments(argv + ["--pretrained_model_name_or_path", sources["pipeline"], "--subfolder", "vae",
                                "--rae_encoder_path", "d"])
    with pytest.raises(ValueError, match="--ignore_keys encoder.: the latent is AutoencoderRAE's frozen .* it would "
                                         "stay random"):
        parse_arguments(argv + ["--pretrained_model_name_or_path", sources["pipeline"], "--subfolder", "vae",
                                "--ignore_keys", "encoder."])
    kl = os.path.join(REPO, "configs", "vae_micro.json")
    with pytest.raises(ValueError, match="--noise_tau 0.5: AutoencoderKL adds no noise"):
        build_vae(kl, noise_tau=0.5)
    with pytest.raises(ValueError, match="--rae_encoder_path d: AutoencoderKL .* trains its own encoder"):
        build_vae(kl, encoder_path="d")
    with pytest.raises(ValueError, match=f"{rae_config}: an AutoencoderRAE trained from scratch needs .*"
                                         "--rae_encoder_path"):
        build_vae(rae_config)


def test_a_config_contradicting_the_dinov2_names_the_key(sources, tmp_path):
    path = tmp_path / "rae.json"
    path.write_text(json.dumps({**SCRATCH, "encoder_hidden_size": 768}))
    with pytest.raises(ValueError, match=rf"{path}: encoder_hidden_size 768 contradicts --rae_encoder_path .*"
                                         "encoder_hidden_size 64"):
        build_vae(str(path), encoder_path=sources["dinov2"])
    path.write_text(json.dumps({**SCRATCH, "reshape_to_2d": False}))
    with pytest.raises(ValueError, match=rf"{path}: reshape_to_2d false"):
        build_vae(str(path), encoder_path=sources["dinov2"])


def test_a_number_as_scaling_factor_needs_statistics_first(sources, rae_config, photos, tmp_path):
    from vae_trainer.models.latent_scale import scaling_factor_mode

    vae = build_vae(rae_config, encoder_path=sources["dinov2"])
    model_args = parse_arguments(["--file_list", photos, "--vae_config_file", rae_config, "--rae_encoder_path",
                                  sources["dinov2"], "--max_steps", "1", "--output_dir", str(tmp_path),
                                  "--resolution", "32", "--scaling_factor", "0.5"])[0]
    with pytest.raises(ValueError, match="--scaling_factor 0.5: this AutoencoderRAE has no latents_mean"):
        scaling_factor_mode(model_args, vae)
