"""What a run hands over: a VAE folder both ppdiffusers and PyTorch diffusers load as it is (real photos,
<= 1e-4), the --posterior_std export fix, and the latent scale (keep / measure / number, latent_stats.json)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from ppdiffusers import AutoencoderKL
from torch_vae import MICRO, diffusers, make_torch_vae, paddle_reconstruct, photos, torch_reconstruct

from vae_trainer.evaluation import evaluate_vae, measure_latents
from vae_trainer.models.latent_scale import decide, mode_of_checkpoint, scaling_factor_mode
from vae_trainer.metrics import MetricAccumulator, add_latents, latent_statistics
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae

paddle.set_device("cpu")
FLUX_LIKE = dict(MICRO, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory):
    """A ppdiffusers VAE with non-default weights (converted from a seeded PyTorch model)."""
    folder = tmp_path_factory.mktemp("source")
    make_torch_vae(MICRO, seed=4).save_pretrained(str(folder))
    return build_vae(pretrained_model_name_or_path=str(folder))


def test_export_loads_in_ppdiffusers_and_pytorch_diffusers_with_equal_reconstructions(trained_like, tmp_path):
    out = str(tmp_path / "vae")
    save_vae(trained_like, out, scaling_factor=0.2, shift_factor=0.05)
    assert {"config.json", "diffusion_paddle_model.safetensors", "diffusion_pytorch_model.safetensors"} <= set(os.listdir(out))
    images = photos(count=4)
    expected = paddle_reconstruct(trained_like, images)
    in_paddle = AutoencoderKL.from_pretrained(out)
    in_torch = diffusers().AutoencoderKL.from_pretrained(out).eval()
    np.testing.assert_array_equal(paddle_reconstruct(in_paddle, images), expected)
    np.testing.assert_allclose(torch_reconstruct(in_torch, images), expected, atol=1e-4)
    for config in (in_paddle.config, in_torch.config):
        assert (config.scaling_factor, config.shift_factor) == (0.2, 0.05)


@pytest.mark.parametrize("config", [MICRO, FLUX_LIKE], ids=["quant_conv", "flux_like_no_quant_conv"])
def test_posterior_std_export_samples_with_the_trained_std_after_reload(tmp_path, config):
    vae = build_vae(pretrained_model_name_or_path=_torch_folder(tmp_path, config))
    images = photos()
    before = vae.encode(paddle.to_tensor(images)).latent_dist
    assert not np.allclose(before.std.numpy(), 0.1, atol=1e-2)  # random log-variance outputs, as after training
    save_vae(vae, str(tmp_path / "vae"), posterior_std=0.1)
    posterior = AutoencoderKL.from_pretrained(str(tmp_path / "vae")).encode(paddle.to_tensor(images)).latent_dist
    std = posterior.std.numpy()
    np.testing.assert_allclose(std, np.full_like(std, 0.1), rtol=1e-6)
    np.testing.assert_allclose(posterior.mean.numpy(), before.mean.numpy(), rtol=1e-6, atol=1e-7)
    import torch

    with torch.no_grad():
        in_torch = diffusers().AutoencoderKL.from_pretrained(str(tmp_path / "vae")).encode(torch.from_numpy(images))
    std = in_torch.latent_dist.std.numpy()
    np.testing.assert_allclose(std, np.full_like(std, 0.1), rtol=1e-5)
    # The in-memory model is given back unchanged.
    np.testing.assert_array_equal(vae.encode(paddle.to_tensor(images)).latent_dist.std.numpy(), before.std.numpy())


def _torch_folder(tmp_path, config):
    folder = tmp_path / "torch_source"
    make_torch_vae(config, seed=6).save_pretrained(str(folder))
    return str(folder)


def test_latent_statistics_are_those_of_posterior_samples_exactly(trained_like):
    images = paddle.to_tensor(photos(count=4))
    posterior = trained_like.encode(images).latent_dist
    mean, var = posterior.mean.numpy().astype(np.float64), posterior.var.numpy().astype(np.float64)
    stats = measure_latents(trained_like, [images[:3], images[3:]])
    # Per channel: E[z] = mean of the means; Var[z] = variance of the means + mean of the variances.
    np.testing.assert_allclose(stats.latent_mean, mean.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(stats.latent_std, np.sqrt(mean.var(axis=(0, 2, 3)) + var.mean(axis=(0, 2, 3))), rtol=1e-6)
    assert stats.scaling_factor == pytest.approx(1 / np.sqrt(mean.var() + var.mean()), rel=1e-6)
    assert stats.shift_factor == pytest.approx(mean.mean(), rel=1e-6)
    # ... which is what many posterior samples converge to.
    rng = np.random.default_rng(0)
    samples = mean[None] + np.sqrt(var)[None] * rng.standard_normal((400, *mean.shape))
    assert stats.scaling_factor == pytest.approx(1 / samples.std(), rel=1e-2)
    # The full evaluation reports the same statistics (so the export can reuse it), decoding the mode.
    result = evaluate_vae(trained_like, [images])
    np.testing.assert_allclose(result.latent_std, stats.latent_std, rtol=1e-6)
    assert result.scaling_factor == pytest.approx(stats.scaling_factor, rel=1e-9)


def test_latent_statistics_with_variances_equal_numpy():
    rng = np.random.default_rng(1)
    means, variances = rng.normal(size=(5, 3, 4, 4)), rng.uniform(0.1, 2, size=(5, 3, 4, 4))
    statistics = MetricAccumulator()
    add_latents(statistics, "latents", means[:2], variances[:2])
    add_latents(statistics, "latents", means[2:], variances[2:])
    mean, std, _, _ = latent_statistics(statistics.reduce(), "latents")
    np.testing.assert_allclose(mean, means.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, np.sqrt(means.var(axis=(0, 2, 3)) + variances.mean(axis=(0, 2, 3))), rtol=1e-12)


def _args(**kw):
    base = dict(scaling_factor=None, pretrained_model_name_or_path=None, ignore_keys=None)
    return SimpleNamespace(**{**base, **kw})


def test_scaling_factor_is_kept_when_fine_tuning_and_measured_from_scratch():
    assert scaling_factor_mode(_args(pretrained_model_name_or_path="sd/vae")) == "keep"
    assert scaling_factor_mode(_args(pretrained_model_name_or_path="sd/vae", ignore_keys=["decoder."])) == "keep"
    for ignored in (["encoder."], ["encoder.down_blocks.0"], ["quant_conv."], ["enc"]):
        assert scaling_factor_mode(_args(pretrained_model_name_or_path="sd/vae", ignore_keys=ignored)) == "measure"
    assert scaling_factor_mode(_args()) == "measure"
    assert scaling_factor_mode(_args(pretrained_model_name_or_path="sd/vae", scaling_factor="measure")) == "measure"
    assert scaling_factor_mode(_args(scaling_factor="0.5")) == 0.5
    for bad in ("big", "-1"):
        with pytest.raises(ValueError, match="--scaling_factor"):
            scaling_factor_mode(_args(scaling_factor=bad))


def test_an_export_from_a_checkpoint_uses_the_given_mode_else_the_runs_else_keep():
    assert mode_of_checkpoint("0.3", {"scaling_factor": "measure"}) == 0.3  # the script's --scaling_factor wins
    assert mode_of_checkpoint(None, {"scaling_factor": "measure"}) == "measure"  # else the run's
    assert mode_of_checkpoint("auto", {"scaling_factor": "0.5"}) == 0.5
    assert mode_of_checkpoint(None, {}) == "keep"  # a checkpoint older than export_config.json
    with pytest.raises(ValueError, match="--scaling_factor"):
        mode_of_checkpoint("big", {})


def test_export_vae_script_refuses_flag_values_when_parsing(tmp_path, capsys):
    """Parse only: `--ema=maybe` / `--ema maybe` were read as --no_ema (or a third folder); --batch_size 0 was
    refused after the checkpoint was loaded, naming the training flag --per_device_eval_batch_size."""
    from conftest import load_script

    export_vae = load_script("export_vae")
    folders = [str(tmp_path / "checkpoint-1"), str(tmp_path / "out")]
    for flags, value in ((["--ema=maybe"], "maybe"), (["--ema", "maybe"], "maybe"), (["--ema="], "")):
        with pytest.raises(SystemExit) as stopped:
            export_vae.parse_args(folders + flags)
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert "argument --ema: expected no value or one of true, yes, 1, false, no, 0" in error, flags
        assert f"got {value!r}" in error, flags
    with pytest.raises(SystemExit):
        export_vae.parse_args(folders + ["--batch_size", "0"])
    error = capsys.readouterr().err
    assert "--batch_size must be >= 1, got 0" in error and "per_device_eval_batch_size" not in error
    assert [export_vae.parse_args(flags).ema for flags in (folders + ["--ema=No"], ["--ema", *folders],
                                                           folders + ["--ema", "true"], folders)] == [False, True, True, None]


def _vae_with(config):
    return SimpleNamespace(config=config)  # what `decide` reads of an AutoencoderKL


def test_decide_writes_what_the_mode_says_and_records_it():
    stats = SimpleNamespace(scaling_factor=0.5, shift_factor=0.25, num_images=9, latent_mean=[0.1], latent_std=[2.0])
    sd, flux = _vae_with({"scaling_factor": 0.18215, "shift_factor": None}), _vae_with({"scaling_factor": 0.3611,
                                                                                         "shift_factor": 0.1159})
    assert decide("measure", sd, stats, "x")[0] == {"scaling_factor": 0.5}  # SD-style: no shift written
    assert decide("measure", flux, stats, "x")[0] == {"scaling_factor": 0.5, "shift_factor": 0.25}
    updates, record = decide("keep", flux, stats, "the evaluation at step 4")
    assert updates == {} and (record["scaling_factor"], record["shift_factor"]) == (0.3611, 0.1159)
    assert record["measured"]["suggested_scaling_factor"] == 0.5 and "kept" in record["source"]
    updates, record = decide("keep", sd)
    assert updates == {} and record["measured"] is None and "not measured" in record["note"]
    assert decide(0.7, flux)[0] == {"scaling_factor": 0.7}
    json.dumps(record)  # the record is latent_stats.json


def test_the_readme_example_of_latent_stats_json_is_what_the_export_writes():
    """docs/fine-tuning.md "The latent scale" shows a latent_stats.json; the same inputs give exactly that record."""
    import re

    from conftest import REPO

    page = open(os.path.join(REPO, "docs", "fine-tuning.md")).read()
    (example,) = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", page, flags=re.S)
                  if "suggested_scaling_factor" in block]
    measured = example["measured"]
    stats = SimpleNamespace(scaling_factor=measured["suggested_scaling_factor"],
                            shift_factor=measured["suggested_shift_factor"], num_images=measured["num_images"],
                            latent_mean=measured["latent_mean"], latent_std=measured["latent_std"])
    vae = _vae_with({"scaling_factor": example["scaling_factor"], "shift_factor": example["shift_factor"]})
    kept_from = "kept from the pretrained VAE /models/sdxl-vae"  # the origin latent_scale.settle gives such a VAE
    assert decide("keep", vae, stats, measured["from"], example["weights"], origin=kept_from)[1] == example
    # Its suggested factors are those of its per-channel numbers (total variance over equally many values each).
    mean, std = np.array(measured["latent_mean"]), np.array(measured["latent_std"])
    assert measured["suggested_scaling_factor"] == pytest.approx(1 / np.sqrt((std**2).mean() + mean.var()), abs=1e-4)
    assert measured["suggested_shift_factor"] == pytest.approx(mean.mean(), abs=1e-4)


# ---- --posterior_std: the written factor is that of the exported VAE (whose std is posterior_std)

class _Monitor:
    def log_scalars(self, step, scalars):
        pass

    def log_grid(self, step, grid, tag):
        pass


def _run_networks(tmp_path, photo_filelist, held_out_folder, model=None, **data):
    """Networks and an evaluator on held_out_folder (6 images at 32 px), as a run builds them."""
    from test_step import make_args

    from vae_trainer.arguments import DataArguments, LossArguments, ModelArguments
    from vae_trainer.build import build_networks, build_evaluator

    args = make_args(tmp_path, eval_steps=1, per_device_eval_batch_size=4)
    model = {"vae_config_file": "configs/vae_micro.json", "disc_norm": "group", "disc_num_layers": 2,
             "disc_base_channels": 8, **(model or {})}
    networks = build_networks(ModelArguments(**model), LossArguments(perceptual_weight=0.0), args, resolution=32)
    data_args = DataArguments(file_list=photo_filelist, eval_file_list=held_out_folder, eval_num_images=6,
                              resolution=32, **data)
    return networks, build_evaluator(data_args, args, networks)


def _remeasured(folder, held_out_folder):
    from vae_trainer.data.dataset import build_eval_dataloader

    return measure_latents(AutoencoderKL.from_pretrained(folder), build_eval_dataloader(held_out_folder, 32, 4, 0, 1, 6))


@pytest.mark.parametrize("evaluate_first", [False, True], ids=["encoder_only_pass", "reusing_the_evaluation"])
def test_with_posterior_std_the_written_factor_is_that_of_the_reloaded_export(
        tmp_path, photo_filelist, held_out_folder, evaluate_first):
    from paddlenlp.trainer import TrainerState

    from vae_trainer.final_save import save_final_models

    networks, evaluator = _run_networks(tmp_path, photo_filelist, held_out_folder, {"posterior_std": 0.1},
                                  latent_stats_num_images=6)
    suggested = None
    if evaluate_first:  # the in-training evaluation (eval/latent_std_*, eval/suggested_scaling_factor)
        evaluator.run(1, networks.model.vae, None, _Monitor(), TrainerState())
        suggested = evaluator.last[1].scaling_factor
    vae_dir, _ = save_final_models(str(tmp_path / "out"), networks, None, evaluator, step=1)
    written = AutoencoderKL.load_config(vae_dir)["scaling_factor"]
    remeasured = _remeasured(vae_dir, held_out_folder)
    assert written == pytest.approx(remeasured.scaling_factor, rel=1e-5)
    if suggested is not None:
        assert suggested == pytest.approx(remeasured.scaling_factor, rel=1e-5)
    stats = json.load(open(os.path.join(vae_dir, "latent_stats.json")))
    np.testing.assert_allclose(stats["measured"]["latent_std"], remeasured.latent_std, rtol=1e-5)


# ---- vae_raw/: the raw weights beside the EMA's, with their own latent_stats.json

@pytest.mark.parametrize("freeze_encoder", [False, True])
def test_vae_raw_gets_the_factor_of_its_own_latent_space(tmp_path, photo_filelist, held_out_folder, monkeypatch,
                                                         freeze_encoder):
    import vae_trainer.evaluation as evaluation
    from vae_trainer.ema import TrainableEMA
    from vae_trainer.final_save import save_final_models
    from vae_trainer.models.families import encoder_parameters

    networks, evaluator = _run_networks(tmp_path, photo_filelist, held_out_folder, {"freeze_encoder": freeze_encoder})
    vae = networks.model.vae
    ema = TrainableEMA(vae, decay=0.5)
    frozen = {id(p) for p in encoder_parameters(vae)} if freeze_encoder else set()
    with paddle.no_grad():  # "training": the raw weights move away from their average (not the frozen ones)
        for param in vae.parameters():
            if id(param) not in frozen:
                param.set_value(param * 1.5)
    passes = []
    monkeypatch.setattr(evaluation, "measure_latents",
                        lambda *a, _real=evaluation.measure_latents, **k: passes.append(1) or _real(*a, **k))
    save_final_models(str(tmp_path / "out"), networks, ema, evaluator, step=1)
    written = {}
    for folder in ("vae", "vae_raw"):
        path = str(tmp_path / "out" / folder)
        record = json.load(open(os.path.join(path, "latent_stats.json")))
        written[folder] = AutoencoderKL.load_config(path)["scaling_factor"]
        assert record["scaling_factor"] == written[folder]
        assert written[folder] == pytest.approx(_remeasured(path, held_out_folder).scaling_factor, rel=1e-5)
    if freeze_encoder:  # one latent space: one pass, one factor
        assert len(passes) == 1 and written["vae"] == written["vae_raw"]
    else:
        assert len(passes) == 2 and written["vae"] != pytest.approx(written["vae_raw"], rel=1e-3)


# ---- scripts/export_vae.py on checkpoints written in-process

def _checkpoint(networks, evaluator, folder):
    from vae_trainer.final_save import checkpoint_configs

    folder.mkdir()
    paddle.save(networks.model.state_dict(), str(folder / "model_state.pdparams"))
    for name, config in checkpoint_configs(networks, evaluator).items():
        (folder / name).write_text(json.dumps(config))
    return str(folder)


def test_export_vae_script_takes_its_scaling_factor_as_the_training_flag_does(tmp_path, photo_filelist, held_out_folder):
    from conftest import load_script

    networks, evaluator = _run_networks(tmp_path, photo_filelist, held_out_folder)
    checkpoint = _checkpoint(networks, evaluator, tmp_path / "checkpoint-1")
    export_vae = load_script("export_vae")
    for bad, message in (("-1", "must be > 0"), ("big", "keep, measure or a number")):
        with pytest.raises(SystemExit) as stopped:
            export_vae.main([checkpoint, str(tmp_path / "bad"), "--scaling_factor", bad])
        assert stopped.value.code.startswith("error: --scaling_factor") and message in stopped.value.code
    export_vae.main([checkpoint, str(tmp_path / "auto"), "--scaling_factor", "auto"])  # auto: what the run used
    remeasured = _remeasured(str(tmp_path / "auto"), held_out_folder)
    assert AutoencoderKL.load_config(str(tmp_path / "auto"))["scaling_factor"] == pytest.approx(
        remeasured.scaling_factor, rel=1e-5)


def test_export_vae_script_measures_on_the_runs_random_sample_of_the_training_images(tmp_path, photo_filelist):
    """Without --eval_file_list a run measures its scale on a seeded random sample of --file_list (issue 42.4);
    its checkpoint says so, and the script measures on the same images."""
    from conftest import load_script

    networks, evaluator = _run_networks(tmp_path, photo_filelist, None, latent_stats_num_images=6)
    checkpoint = _checkpoint(networks, evaluator, tmp_path / "checkpoint-1")
    assert json.load(open(os.path.join(checkpoint, "export_config.json")))["latent_stats_sample_seed"] == 42
    load_script("export_vae").main([checkpoint, str(tmp_path / "out"), "--scaling_factor", "measure"])
    record = json.load(open(tmp_path / "out" / "latent_stats.json"))
    stats, source = evaluator.latent_stats(networks.model.vae, None, step=1)  # what the run's export measures
    assert record["source"] == f"measured on {source}" and "a random sample (seed 42) of 6 of the 48 images" in source
    assert record["measured"]["latent_mean"] == pytest.approx(stats.latent_mean, rel=1e-5)


def test_export_vae_script_exports_an_o2_checkpoint_from_its_float32_master_weights(
        tmp_path, photo_filelist, held_out_folder):
    """An O2 run saves half-precision roundings in model_state.pdparams and the float32 master weights in
    optimizer.pdopt (by parameter name): the export, and --init_from_ckpt, take the master weights."""
    from conftest import load_script

    networks, evaluator = _run_networks(tmp_path, photo_filelist, held_out_folder)
    masters = {p.name: p.numpy().copy() for p in networks.model.vae.parameters()}
    networks.model.to(dtype="float16")  # the weights as O2 trains them (paddle.amp.decorate on a GPU)
    checkpoint = _checkpoint(networks, evaluator, tmp_path / "checkpoint-3")
    paddle.save({"master_weights": {name: paddle.to_tensor(value) for name, value in masters.items()}},
                str(tmp_path / "checkpoint-3" / "optimizer.pdopt"))
    load_script("export_vae").main([checkpoint, str(tmp_path / "out"), "--scaling_factor", "keep"])
    note = json.load(open(tmp_path / "out" / "latent_stats.json"))["note"]  # by case: no training run to speak of
    # Kept: the factor of the run's --vae_config_file (a run from scratch), said as it is (export_config.json).
    assert note.startswith("not measured: the scaling factor is from --vae_config_file configs/vae_micro.json;")
    assert "--scaling_factor measure" in note
    exported = AutoencoderKL.from_pretrained(str(tmp_path / "out"))
    started = build_vae("configs/vae_micro.json", init_from_ckpt=checkpoint)
    for vae in (exported, started):
        for name, param in vae.named_parameters():
            master = masters[dict(networks.model.vae.named_parameters())[name].name]
            np.testing.assert_array_equal(param.numpy(), master, err_msg=name)  # not a float16 rounding


@pytest.mark.parametrize("data, stored", [
    ("pipe:curl -s http://host/shard-{000..009}.tar", "pipe:curl -s http://host/shard-{000..009}.tar"),
    ("held_out/", os.path.abspath("held_out")),
])
def test_export_config_keeps_pipe_sources_as_given(data, stored):
    """Issue 17.7: abspath made `pipe:curl ...` the path `<cwd>/pipe:curl ...`, which export_vae.py cannot read."""
    from types import SimpleNamespace

    from vae_trainer.checkpoint import EXPORT_CONFIG_NAME
    from vae_trainer.final_save import checkpoint_configs

    model = SimpleNamespace(posterior_std=0.0, input_size=None, vae=SimpleNamespace(config={"scaling_factor": 0.5}))
    networks = SimpleNamespace(model=model, scaling_factor_mode="measure", resolution=32, discriminator_config={})
    evaluator = SimpleNamespace(latent_stats_data=(data, 8, None), clip_frames={})
    assert checkpoint_configs(networks, evaluator)[EXPORT_CONFIG_NAME]["latent_stats_data"] == stored


def test_the_pytorch_files_batchnorm_counters_become_0d_and_nothing_else_moves(tmp_path):
    """ppdiffusers writes our [1] counters as [1]; diffusers' files hold them 0-d. Only the header changes (same
    length, padded): the tensors' bytes stay, and a file without counters is not touched."""
    from safetensors.numpy import load_file, save_file

    from vae_trainer.models.vae_saving import _counters_zero_dimensional

    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    with_counter, without = str(tmp_path / "with.safetensors"), str(tmp_path / "without.safetensors")
    save_file({"norm.num_batches_tracked": np.array([7]), "norm.weight": weight}, with_counter, {"format": "pt"})
    save_file({"norm.weight": weight}, without, {"format": "pt"})
    before = {path: open(path, "rb").read() for path in (with_counter, without)}
    for path in before:
        _counters_zero_dimensional(path)
    after = {path: open(path, "rb").read() for path in before}
    assert after[without] == before[without]
    header = int.from_bytes(before[with_counter][:8], "little")
    assert len(after[with_counter]) == len(before[with_counter])
    assert after[with_counter][8 + header:] == before[with_counter][8 + header:]  # the tensors' bytes
    state = load_file(with_counter)
    assert state["norm.num_batches_tracked"].shape == () and int(state["norm.num_batches_tracked"]) == 7
    assert np.array_equal(state["norm.weight"], weight)
