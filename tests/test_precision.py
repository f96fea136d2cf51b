"""Mixed-precision set-up. Real autocast needs a GPU; on CPU the flags must run, warn, and save scalers."""

import logging
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, read_scalars, run_entry_point, tiny_args

from test_step import make_model

from vae_trainer.arguments import LossArguments, VAETrainingArguments
from vae_trainer.build import Networks, stateful, train_networks
from vae_trainer.precision import setup_precision
from vae_trainer.step import TrainStep


def args(tmp_path, **kw):
    return VAETrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], **kw)


def step_of(tmp_path, precision, **flags):
    """A TrainStep of a micro VAE with its networks built from `flags` (their loss scalers), in `precision`."""
    model, training_args = make_model(), args(tmp_path, seed=0, **flags)
    return TrainStep(Networks(model, None, {}), LossArguments(), training_args,
                     train_networks(model, LossArguments(), training_args), precision=precision)


def scaler_files(step):
    return {name: entry for name, entry in stateful(step).items() if "scaler" in name}


def test_fp16_gets_one_scaler_per_network_and_bf16_none(tmp_path, caplog):
    model = paddle.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="vae_trainer"):
        fp16 = setup_precision(args(tmp_path, fp16=True), model)
    fp16_step = step_of(tmp_path, fp16, fp16=True)
    vae_scaler, disc_scaler = (network.scaler for network in fp16_step.networks)
    assert fp16.dtype == "float16" and vae_scaler is not None and disc_scaler is not None
    assert vae_scaler is not disc_scaler
    assert set(scaler_files(fp16_step)) == {"vae_scaler.pdparams", "disc_scaler.pdparams"}
    assert "no autocast" in caplog.text  # the CPU warning
    bf16 = setup_precision(args(tmp_path, bf16=True), model)
    bf16_step = step_of(tmp_path, bf16, bf16=True)
    assert bf16.dtype == "bfloat16" and not bf16_step.networks[0].scaler.is_enable() and scaler_files(bf16_step) == {}
    assert setup_precision(args(tmp_path), model).dtype is None
    # O2 is not applied on CPU (no half-precision conv kernels): the weights stay float32.
    setup_precision(args(tmp_path, fp16=True, fp16_opt_level="O2"), model)
    assert model.weight.dtype == paddle.float32


def test_a_zero_loss_scale_floor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--min_loss_scale must be > 0"):
        setup_precision(args(tmp_path, fp16=True, min_loss_scale=0.0), paddle.nn.Linear(2, 2))


def test_mixed_precision_flags_train_on_cpu_with_a_warning(photo_filelist, tmp_path):
    """The Trainer driver (whose own fp16 handling is kept off) with fp16 O2; bf16 and the scalers' absence
    without fp16: test_fp16_gets_one_scaler_per_network_and_bf16_none."""
    output_dir = tmp_path / "out"
    result = run_entry_point("train_vae_trainer.py", tiny_args(photo_filelist, output_dir, max_steps=2, save_steps=2,
                                                               image_logging_steps=0, disc_start=1, fp16="true",
                                                               fp16_opt_level="O2"))
    assert "Paddle does no autocast" in result.stderr + result.stdout
    assert os.path.isdir(output_dir / "vae")
    assert os.path.isfile(output_dir / "checkpoint-2" / "vae_scaler.pdparams")


class _OptimizerWithMasterWeights:
    """What an O2 optimizer (multi_precision) holds: float32 master copies by parameter name."""

    def __init__(self, masters):
        self.masters = masters

    def state_dict(self):
        return {"master_weights": self.masters}


def test_o2_weights_come_back_in_float32_from_the_master_weights():
    """After O2 training the model is cast back to float32 and given the optimizer's float32 master weights,
    not the float16 roundings it trained with (what evaluation and export then see)."""
    from vae_trainer.precision import half_dtype, restore_float32

    layer = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.Linear(4, 2))
    layer.to(dtype="float16")  # what paddle.amp.decorate(level="O2") does on a GPU
    assert half_dtype(layer) == "float16"
    rng = np.random.default_rng(0)
    masters = {p.name: paddle.to_tensor(rng.normal(size=p.shape).astype("float32") / 3) for p in layer.parameters()}
    restore_float32(layer, [_OptimizerWithMasterWeights(masters)])
    assert half_dtype(layer) is None
    for p in layer.parameters():
        assert p.dtype == paddle.float32
        assert np.array_equal(p.numpy(), masters[p.name].numpy())  # exact, not a float16 rounding
    assert not np.array_equal(masters[layer[0].weight.name].numpy().astype("float16").astype("float32"),
                              masters[layer[0].weight.name].numpy())


def test_float32_weights_are_left_alone_and_evaluated_without_autocast():
    import contextlib

    from vae_trainer.precision import half_precision_autocast, restore_float32

    layer = paddle.nn.Linear(2, 2)
    before = layer.weight.numpy().copy()
    restore_float32(layer, [_OptimizerWithMasterWeights({layer.weight.name: paddle.zeros([2, 2])})])
    assert np.array_equal(layer.weight.numpy(), before)
    assert isinstance(half_precision_autocast(layer), contextlib.nullcontext)
    layer.to(dtype="bfloat16")
    assert not isinstance(half_precision_autocast(layer), contextlib.nullcontext)


def _stored_dtypes(folder) -> set:
    """The dtypes of the weights in an exported folder, read from the file headers (safe for bfloat16)."""
    import json
    import struct

    dtypes = set()
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            dtypes |= {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
        elif path.suffix == ".pdparams":
            dtypes |= {str(value.dtype) for value in paddle.load(str(path)).values()}
    return dtypes


@pytest.mark.skipif(not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0,
                    reason="real fp16/bf16 autocast and O2 need a CUDA GPU")
@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("flags", [
    {"fp16": "true", "fp16_opt_level": "O1"},
    {"fp16": "true", "fp16_opt_level": "O2"},
    {"bf16": "true", "fp16_opt_level": "O1"},
    {"bf16": "true", "fp16_opt_level": "O2"},
], ids=["fp16-O1", "fp16-O2", "bf16-O1", "bf16-O2"])
def test_gpu_mixed_precision_trains_evaluates_and_exports_float32(photo_filelist, held_out_folder, tmp_path, driver,
                                                                   flags):
    """GPU smoke test: 3 steps with the GAN and EMA, evaluation at steps 2 and 3, image logging, export."""
    output_dir = tmp_path / "out"
    run_entry_point(driver, tiny_args(photo_filelist, output_dir, device="gpu", max_steps=3, disc_start=1,
                                      image_logging_steps=1, **EVAL_FLAGS(held_out_folder), **flags))
    losses = read_scalars(str(output_dir / "logs"), "loss/total")
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
    psnr = read_scalars(str(output_dir / "logs"), "eval/psnr")
    assert sorted(psnr) == [2, 3] and all(np.isfinite(list(psnr.values())))
    assert _stored_dtypes(output_dir / "vae") in ({"F32"}, {"float32"}, {"paddle.float32"})
    assert _stored_dtypes(output_dir / "vae_raw") in ({"F32"}, {"float32"}, {"paddle.float32"})


def test_o2_keeps_a_frozen_encoder_float32_so_the_ema_and_the_export_keep_it_bit_identical(tmp_path, monkeypatch):
    """--freeze_encoder under O2: the frozen encoder has no float32 master copy in any optimizer, so it must
    never be cast. Paddle's own O2 cast (what paddle.amp.decorate does on a GPU) is forced here on CPU."""
    from paddle.amp.auto_cast import amp_initialize
    from test_step import make_args

    import vae_trainer.precision as precision
    from vae_trainer.arguments import LossArguments, ModelArguments
    from vae_trainer.build import build_networks, build_optimization
    from vae_trainer.models.families import encoder_parameters
    from vae_trainer.precision import restore_float32

    monkeypatch.setattr(precision, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle.amp, "decorate", lambda models, level, dtype, excluded_layers=None, **_:
                        amp_initialize([models], dtype, excluded_layers))
    loss = LossArguments(perceptual_weight=0.0)
    networks = build_networks(ModelArguments(vae_config_file="configs/vae_micro.json", freeze_encoder=True,
                                            disc_norm="group", disc_num_layers=2, disc_base_channels=8),
                             loss, make_args(tmp_path), resolution=32)
    vae = networks.model.vae
    original = {name: param.numpy().copy() for name, param in vae.named_parameters()}
    run = build_optimization(networks, loss, make_args(tmp_path, fp16=True, fp16_opt_level="O2", use_ema=True))
    assert vae.decoder.conv_out.weight.dtype == paddle.float16  # the O2 cast did happen ...
    assert {p.dtype for p in encoder_parameters(vae)} == {paddle.float32}  # ... but not to the frozen encoder
    for name, shadow in zip(run.ema.names, run.ema.shadow_params):  # averages of the exact weights
        np.testing.assert_array_equal(shadow.numpy(), original[name], err_msg=name)
    frozen = {id(p) for p in encoder_parameters(vae)}
    masters = {p.name: paddle.to_tensor(original[n]) for n, p in vae.named_parameters() if id(p) not in frozen}
    restore_float32(networks.model, [_OptimizerWithMasterWeights(masters)])
    for name, param in vae.named_parameters():
        assert param.dtype == paddle.float32
        np.testing.assert_array_equal(param.numpy(), original[name], err_msg=name)


def test_o2_keeps_the_log_variance_and_the_lecam_ema_float32(tmp_path, monkeypatch):
    """Under O2 the VAE and discriminator weights are cast, but not the container's own scalars: a learnable
    log-variance of 0.1 stays 0.1 (fp16: 0.09998), and a LeCAM EMA step of decay 0.99 from 1.0 towards 1.05
    gives 1.0005 (fp16, whose spacing at 1.0 is 0.00098, would keep 1.0). Paddle's O2 cast is forced on CPU."""
    from paddle.amp.auto_cast import amp_initialize
    from test_step import make_args

    import vae_trainer.precision as precision
    from vae_trainer.arguments import LossArguments, ModelArguments
    from vae_trainer.build import build_networks, build_optimization
    from vae_trainer.objectives.gan import lecam

    monkeypatch.setattr(precision, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle.amp, "decorate", lambda models, level, dtype, excluded_layers=None, **_:
                        amp_initialize([models], dtype, excluded_layers))
    loss = LossArguments(perceptual_weight=0.0, learn_logvar=True, logvar_init=0.1, lecam_weight=0.1)
    networks = build_networks(ModelArguments(vae_config_file="configs/vae_micro.json", disc_norm="group",
                                            disc_num_layers=2, disc_base_channels=8), loss, make_args(tmp_path))
    model = networks.model
    run = build_optimization(networks, loss, make_args(tmp_path, fp16=True, fp16_opt_level="O2"))
    assert model.vae.decoder.conv_out.weight.dtype == paddle.float16  # the O2 cast did happen ...
    assert model.discriminator.parameters()[0].dtype == paddle.float16
    state = model.state_dict()
    assert state["logvar"].dtype == paddle.float32 and state["lecam_ema"].dtype == paddle.float32  # ... not here
    assert model.logvar.item() == np.float32(0.1)
    assert any(p is model.logvar for p in run.networks[0].optimizer._parameter_list)  # still trained, in float32
    model.lecam_ema.set_value(paddle.ones([2], "float32"))
    lecam(model.lecam_ema, paddle.full([4], 1.05, "float16"), paddle.full([4], 1.05, "float16"), 0.99)
    assert model.lecam_ema.dtype == paddle.float32
    np.testing.assert_allclose(model.lecam_ema.numpy(), [1.0005, 1.0005], rtol=0, atol=2e-6)


def test_o2_keeps_the_buffers_of_a_layer_without_weights_as_loaded(tmp_path, monkeypatch):
    """RAE's image and latent statistics are buffers of its root, which has no weights: under O2 they stay float32,
    bit for bit (the export writes them as loaded; 0.4 in fp16 is 0.39990), while the decoder is cast. Paddle's O2
    cast is forced on CPU."""
    from paddle.amp.auto_cast import amp_initialize
    from test_rae import TINY_RAE

    import vae_trainer.precision as precision
    from vae_trainer.models.trainable import VAEWithDiscriminator
    from vae_trainer.models.families.rae import RAE

    monkeypatch.setattr(precision, "on_gpu", lambda: True)
    monkeypatch.setattr(paddle.amp, "decorate", lambda models, level, dtype, excluded_layers=None, **_:
                        amp_initialize([models], dtype, excluded_layers))
    vae = RAE.build({**TINY_RAE, "encoder_norm_mean": [0.5, 0.4, 0.3]}, "a tiny RAE")
    statistics = {name: vae.state_dict()[name].numpy().copy() for name in ("encoder_mean", "encoder_std",
                                                                             "_latents_mean", "_latents_std")}
    setup_precision(args(tmp_path, fp16=True, fp16_opt_level="O2"), VAEWithDiscriminator(vae, paddle.nn.Linear(2, 2)))
    assert vae.decoder.decoder_pred.weight.dtype == paddle.float16  # the O2 cast did happen ...
    for name, value in statistics.items():  # ... but not to the statistics
        assert vae.state_dict()[name].dtype == paddle.float32, name
        np.testing.assert_array_equal(vae.state_dict()[name].numpy(), value, err_msg=name)


@pytest.mark.skipif(not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0,
                    reason="real O2 needs a CUDA GPU")
@pytest.mark.parametrize("driver", DRIVERS)
def test_gpu_o2_with_a_frozen_encoder_exports_it_bit_identical(photo_filelist, tmp_path, driver):
    import subprocess
    import sys

    from conftest import REPO, vae_weights

    from vae_trainer.models.vae_loading import build_vae
    from vae_trainer.models.vae_saving import save_vae

    paddle.seed(3)
    save_vae(build_vae("configs/vae_micro.json"), str(tmp_path / "source"))
    source = {k: v.numpy() for k, v in build_vae(pretrained_model_name_or_path=str(tmp_path / "source"))
              .state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    output_dir = tmp_path / "out"
    run_entry_point(driver, tiny_args(photo_filelist, output_dir, device="gpu", max_steps=3, save_steps=3,
                                      pretrained_model_name_or_path=tmp_path / "source", freeze_encoder="true",
                                      fp16="true", fp16_opt_level="O2"))
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "export_vae.py"), str(output_dir / "checkpoint-3"),
                    str(output_dir / "exported")], check=True, cwd=REPO, timeout=300)
    for folder in ("vae", "vae_raw", "exported"):
        exported = vae_weights(str(output_dir), folder)
        for key, value in source.items():
            np.testing.assert_array_equal(exported[key], value, err_msg=f"{folder}: {key}")
