"""Fine-tuning flags in the shared model/step: --freeze_encoder, --input_size, --scale_lr, --discriminator_path."""

import json
import os

import numpy as np
import paddle
import pytest
from ppdiffusers import AutoencoderKL
from test_step import images, make_args

from vae_trainer.arguments import LossArguments, ModelArguments
from vae_trainer.build import build_networks, build_optimization
from vae_trainer.evaluation import evaluate_vae
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator, save_discriminator
from vae_trainer.models.families import check_reconstruction_shape, encoder_parameters
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae
from vae_trainer.optim import build_optimizer

paddle.set_device("cpu")
MICRO = "configs/vae_micro.json"
LPIPS_WEIGHTS = "weights/lpips_vgg16.pdparams"


def components(tmp_path, loss=None, **model):
    model = {"vae_config_file": MICRO, "disc_norm": "group", "disc_num_layers": 2, "disc_base_channels": 8, **model}
    loss = loss or LossArguments(perceptual_weight=0.0, disc_start=0)
    return build_networks(ModelArguments(**model), loss, make_args(tmp_path, learning_rate=1e-3), resolution=32)


def test_freeze_encoder_keeps_the_latent_space_bit_identical_while_the_decoder_trains(tmp_path):
    networks = components(tmp_path, freeze_encoder=True)
    model, run = networks.model, build_optimization(networks, LossArguments(perceptual_weight=0.0, disc_start=0),
                                             make_args(tmp_path, learning_rate=1e-3))
    frozen = {id(p) for p in encoder_parameters(model.vae)}
    optimized = {id(p) for p in run.networks[0].optimizer._parameter_list}
    assert frozen and not frozen & optimized  # out of the optimizer ...
    assert {id(p) for p in model.vae.decoder.parameters()} <= optimized  # ... the decoder is in it
    probe = images(3, seed=9)
    latents_before = model.vae.encode(probe).latent_dist.mean.numpy()
    decoder_before = model.vae.decoder.conv_out.weight.numpy()
    assert model.encode(probe).mean.stop_gradient  # the frozen encoder builds no graph
    for step in range(3):
        run.forward_backward(images(2, seed=step), step, 0)
        run.optimizer_step(global_step=step)
    np.testing.assert_array_equal(model.vae.encode(probe).latent_dist.mean.numpy(), latents_before)
    assert all(p.grad is None for p in encoder_parameters(model.vae))
    assert not np.array_equal(model.vae.decoder.conv_out.weight.numpy(), decoder_before)


SUPER_RESOLVING = {  # f2 encoder, f4 decoder: 16 px in, 32 px out (the reference's f8 encoder / f16 decoder, tiny)
    "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 3,
    "block_out_channels": [8, 16], "up_block_out_channels": [8, 16, 16], "layers_per_block": 1,
    "latent_channels": 4, "norm_num_groups": 8, "sample_size": 32,
}


@pytest.mark.skipif(not os.path.isfile(LPIPS_WEIGHTS), reason="needs `make setup`'s LPIPS weights")
def test_input_size_trains_a_super_resolving_decoder_through_lpips_and_the_discriminator(tmp_path):
    config = tmp_path / "super.json"
    config.write_text(json.dumps(SUPER_RESOLVING))
    loss = LossArguments(perceptual_weight=1.0, disc_start=0, disc_weight=0.5)
    networks = components(tmp_path, loss=loss, vae_config_file=str(config), input_size=[16, 16])
    run = build_optimization(networks, loss, make_args(tmp_path, learning_rate=1e-3))
    seen = []
    networks.model.vae.encoder.register_forward_pre_hook(lambda layer, inputs: seen.append(list(inputs[0].shape)))
    batch = images(2)
    logs = run.forward_backward(batch, 0, 0)
    assert seen == [[2, 3, 16, 16]]  # the encoder saw the bilinearly downsized image ...
    assert run.last_images[1].shape == [2, 3, 32, 32]  # ... the loss the full-resolution target
    assert all(np.isfinite(logs[k].item()) for k in ("loss/total", "loss/perceptual", "loss/discriminator"))
    expected = paddle.nn.functional.interpolate(batch, size=[16, 16], mode="bilinear", align_corners=False)
    np.testing.assert_array_equal(networks.model.encode(batch).mean.numpy(),
                                  networks.model.vae.encode(expected).latent_dist.mean.numpy())
    result = evaluate_vae(networks.model.vae, [batch], input_size=[16, 16])  # evaluation sees it the same way
    assert result.grid.shape == (64, 64, 3) and np.isfinite(result.metrics["psnr"])


# The reference trainer's config/vae.json, which its README points to, with its widths divided by 16: an f8
# encoder of widths (128, 256, 512, 512) and an f16 decoder of (128, 256, 256, 256, 512), down widths not given.
REFERENCE_SHAPE = {
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 5,
    "block_out_channels": [8, 16, 32, 32], "down_block_out_channels": None, "up_block_out_channels": [8, 16, 16, 16, 32],
    "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8, "sample_size": 64,
}


def _super_resolving_vae(tmp_path, config):
    file = tmp_path / "super.json"
    file.write_text(json.dumps(config))
    paddle.seed(2)
    return build_vae(str(file))


def _encoder_widths(vae):
    return [block.resnets[0].conv1.weight.shape[0] for block in vae.encoder.down_blocks]


@pytest.mark.parametrize("config, input_size, resolution", [(SUPER_RESOLVING, [16, 16], 32),
                                                             (REFERENCE_SHAPE, [256, 256], 512)],
                         ids=["tiny", "reference_config_shape"])
def test_a_super_resolving_vae_exports_a_folder_that_reloads_with_the_same_weights(tmp_path, config, input_size,
                                                                                     resolution):
    vae = _super_resolving_vae(tmp_path, config)
    assert _encoder_widths(vae) == config["block_out_channels"]
    # the README's "--input_size 256 256 at --resolution 512"
    check_reconstruction_shape(vae.config, input_size, resolution)
    save_vae(build_vae(MICRO), str(tmp_path / "vae"))  # an earlier export into the same folder (export_vae.py)
    assert "diffusion_pytorch_model.safetensors" in os.listdir(tmp_path / "vae")
    save_vae(vae, str(tmp_path / "vae"))
    for reloaded in (AutoencoderKL.from_pretrained(str(tmp_path / "vae")),
                     build_vae(pretrained_model_name_or_path=str(tmp_path / "vae")),
                     build_vae(str(tmp_path / "vae" / "config.json"))):  # a checkpoint's vae_config.json is this
        assert _encoder_widths(reloaded) == config["block_out_channels"]
        assert {k: v.shape for k, v in reloaded.state_dict().items()} == {k: v.shape for k, v in vae.state_dict().items()}
    reloaded = AutoencoderKL.from_pretrained(str(tmp_path / "vae"))
    for key, value in vae.state_dict().items():
        np.testing.assert_array_equal(reloaded.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    # PyTorch diffusers would load a PyTorch file of it with a freshly initialised extra layer and no error; the
    # earlier export's PyTorch file, another VAE, is gone too.
    assert "diffusion_pytorch_model.safetensors" not in os.listdir(tmp_path / "vae")


def test_export_vae_script_exports_a_super_resolving_checkpoint(tmp_path):
    from conftest import load_script

    from vae_trainer.final_save import checkpoint_configs

    config = tmp_path / "super.json"
    config.write_text(json.dumps(SUPER_RESOLVING))
    networks = components(tmp_path, vae_config_file=str(config), input_size=[16, 16])
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    paddle.save(networks.model.state_dict(), str(checkpoint / "model_state.pdparams"))
    for name, content in checkpoint_configs(networks).items():
        (checkpoint / name).write_text(json.dumps(content))
    load_script("export_vae").main([str(checkpoint), str(tmp_path / "out"), "--scaling_factor", "keep"])
    reloaded = AutoencoderKL.from_pretrained(str(tmp_path / "out"))
    for key, value in networks.model.vae.state_dict().items():
        np.testing.assert_array_equal(reloaded.state_dict()[key].numpy(), value.numpy(), err_msg=key)


def test_input_size_must_give_back_the_resolution(tmp_path):
    config = tmp_path / "super.json"
    config.write_text(json.dumps(SUPER_RESOLVING))
    super_resolving, plain = build_vae(str(config)), build_vae(MICRO)
    check_reconstruction_shape(super_resolving.config, [16, 16], 32)
    check_reconstruction_shape(plain.config, None, 32)
    for vae, input_size in ((plain, [16, 16]), (super_resolving, None), (super_resolving, [24, 24])):
        with pytest.raises(ValueError, match="--resolution"):
            check_reconstruction_shape(vae.config, input_size, 32)


def test_scale_lr_multiplies_both_learning_rates_by_the_global_batch(tmp_path):
    model = VAEWithDiscriminator(build_vae(MICRO), build_discriminator(norm="group", base_channels=8))
    for scale, factor in ((False, 1), (True, 3 * 2)):
        args = make_args(tmp_path, learning_rate=1e-4, disc_learning_rate=2e-4, scale_lr=scale,
                         per_device_train_batch_size=3, gradient_accumulation_steps=2, lr_scheduler_type="constant")
        assert build_optimizer(args, model)[0].get_lr() == pytest.approx(1e-4 * factor)
        assert build_optimizer(args, model, 0)[0].get_lr() == pytest.approx(2e-4 * factor)


def _trained_discriminator(norm="group"):
    paddle.seed(3)
    disc = build_discriminator(norm=norm, num_layers=2, base_channels=8)
    with paddle.no_grad():
        for param in disc.parameters():
            param.set_value(param + 0.1)
    return disc


def test_discriminator_path_starts_from_an_earlier_runs_discriminator(tmp_path):
    disc = _trained_discriminator()
    config = {"disc_type": "patch", "norm": "group", "num_layers": 2, "base_channels": 8}
    save_discriminator(disc, config, str(tmp_path / "discriminator"))
    # The same discriminator inside a checkpoint-N: discriminator_config.json + model_state.pdparams.
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "discriminator_config.json").write_text(json.dumps(config))
    paddle.save({f"discriminator.{k}": v for k, v in disc.state_dict().items()}, str(checkpoint / "model_state.pdparams"))
    for path in (tmp_path / "discriminator", checkpoint):
        started = components(tmp_path, discriminator_path=str(path)).model.discriminator
        for key, value in disc.state_dict().items():
            np.testing.assert_array_equal(started.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    with pytest.raises(ValueError, match="--disc_norm 'group' \\(this run: 'batch'\\)"):
        components(tmp_path, discriminator_path=str(tmp_path / "discriminator"), disc_norm="batch")
    with pytest.raises(FileNotFoundError, match="--discriminator_path") as error:  # the run's folder, not its export
        components(tmp_path, discriminator_path=str(tmp_path))
    assert str(error.value).endswith(f"give --discriminator_path {tmp_path / 'discriminator'}.")


def _checkpoint_of(networks, folder, **export_config):
    """A checkpoint-N as a run writes it (weights + the JSON files), with export_config.json entries replaced."""
    from vae_trainer.final_save import checkpoint_configs

    folder.mkdir()
    paddle.save(networks.model.state_dict(), str(folder / "model_state.pdparams"))
    for name, config in checkpoint_configs(networks).items():
        if name == "export_config.json":
            config = {**config, **export_config}
        (folder / name).write_text(json.dumps(config))
    return str(folder)


def _from_checkpoint(tmp_path, checkpoint, **model):
    return build_networks(ModelArguments(init_from_ckpt=checkpoint, disc_norm="group", disc_num_layers=2,
                                           disc_base_channels=8, **model),
                            LossArguments(perceptual_weight=0.0), make_args(tmp_path), resolution=32)


def test_init_from_ckpt_alone_takes_the_architecture_and_weights_saved_in_a_checkpoint(tmp_path):
    trained = components(tmp_path)
    with paddle.no_grad():  # "trained": away from the initialisation that the same --seed gives again below
        for param in trained.model.vae.parameters():
            param.set_value(param + 0.01)
    started = _from_checkpoint(tmp_path, _checkpoint_of(trained, tmp_path / "checkpoint-9"))
    for key, value in trained.model.vae.state_dict().items():
        np.testing.assert_array_equal(started.model.vae.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    loose_weights = tmp_path / "weights.pdparams"  # a weight file with no config beside it
    paddle.save(trained.model.vae.state_dict(), str(loose_weights))
    with pytest.raises(FileNotFoundError, match="--vae_config_file"):
        build_networks(ModelArguments(init_from_ckpt=str(loose_weights)), LossArguments(), make_args(tmp_path))


def test_init_from_ckpt_keeps_the_latent_scale_of_the_checkpoints_run(tmp_path):
    """The encoder's weights come from the checkpoint, so does the latent scale a diffusion model was trained
    with: a fine-tuning run's kept factor (its vae_config.json), or the number it was given."""
    trained = components(tmp_path)
    trained.model.vae.register_to_config(scaling_factor=0.13025)  # what a run fine-tuning SDXL's VAE holds
    fine_tuned = _checkpoint_of(trained, tmp_path / "checkpoint-4", scaling_factor="keep")
    no_factor = tmp_path / "no_factor.json"
    no_factor.write_text(json.dumps({k: v for k, v in json.load(open(MICRO)).items() if k != "scaling_factor"}))
    for model in ({}, {"freeze_encoder": True}, {"vae_config_file": str(no_factor)}):
        started = _from_checkpoint(tmp_path, fine_tuned, **model)
        assert started.scaling_factor_mode == "keep", model
        assert started.model.vae.config.scaling_factor == 0.13025, model
    given = _from_checkpoint(tmp_path, _checkpoint_of(trained, tmp_path / "checkpoint-5", scaling_factor=0.3))
    assert (given.scaling_factor_mode, given.model.vae.config.scaling_factor) == ("keep", 0.3)
    # The encoder re-initialised: a new latent space, measured.
    assert _from_checkpoint(tmp_path, fine_tuned, ignore_keys=["encoder."]).scaling_factor_mode == "measure"
    # A from-scratch run measured its factor at export, from its EMA weights; a checkpoint does not hold it.
    scratch = _checkpoint_of(trained, tmp_path / "checkpoint-6", scaling_factor="measure")
    assert _from_checkpoint(tmp_path, scratch).scaling_factor_mode == "measure"
