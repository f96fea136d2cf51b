"""The EMA of the VAE weights (vae_trainer/ema.py; issue 42.4): shadows of the trained weights only (a frozen weight
is its own average), exporting what an EMA of every weight exported, and checkpoints written either way (before this
EMA, ema.pdparams held a shadow of every weight) resumed exactly."""

from __future__ import annotations

import os
import shutil

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, run_in_process, tiny_args
from ppdiffusers.training_utils import EMAModel
from safetensors.numpy import load_file

from vae_trainer.checkpoint import write_manifest
from vae_trainer.ema import EMA_NAME, NAMES_KEY, TrainableEMA, load_ema
from vae_trainer.final_save import export_vae_folder
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.vae_loading import build_vae
from vae_trainer.models.vae_saving import save_vae

PADDLE_WEIGHTS = "diffusion_paddle_model.safetensors"
FROZEN = ("encoder.", "quant_conv.")


def decoder_only_vae():
    paddle.seed(3)
    vae = build_vae("configs/vae_micro.json")
    VAEWithDiscriminator(vae, paddle.nn.Linear(1, 1), freeze_encoder=True)  # sets the encoder's weights frozen
    return vae


def assert_same_files(a: str, b: str) -> None:
    first, second = load_file(a), load_file(b)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_only_trained_weights_have_averages_and_the_export_is_that_of_an_ema_of_every_weight(tmp_path):
    vae = decoder_only_vae()
    ema, every = TrainableEMA(vae, decay=0.5), EMAModel(vae.parameters(), decay=0.5)  # `every`: the EMA before
    trained = [name for name, param in vae.named_parameters() if not param.stop_gradient]
    assert ema.names == trained and not any(name.startswith(FROZEN) for name in trained)
    assert len(ema.shadow_params) == len(trained) < len(every.shadow_params)
    for t in range(3):  # the optimizer's part: the trained weights move
        with paddle.no_grad():
            for name, param in vae.named_parameters():
                if not param.stop_gradient:
                    param.set_value(param * 1.25 + 0.01 * t)
        ema.step(vae.parameters())
        every.step(vae.parameters())
    export_vae_folder(vae, str(tmp_path / "raw"))
    for name, averages in (("trained", ema), ("every", every)):
        export_vae_folder(vae, str(tmp_path / name), averages)
    assert_same_files(tmp_path / "trained" / PADDLE_WEIGHTS, tmp_path / "every" / PADDLE_WEIGHTS)
    raw, averaged = (load_file(tmp_path / name / PADDLE_WEIGHTS) for name in ("raw", "trained"))
    assert not np.array_equal(raw["decoder.conv_out.weight"], averaged["decoder.conv_out.weight"])


def test_a_checkpoint_ema_of_every_weight_or_of_another_vae(tmp_path):
    """ema.pdparams written before (every weight, unnamed) loads into the EMA of the trained weights and into
    scripts/export_vae.py's (which then averages what it names); one that does not fit is one clear error."""
    vae = decoder_only_vae()
    every = EMAModel(vae.parameters(), decay=0.5)
    with paddle.no_grad():
        vae.decoder.conv_out.weight.set_value(vae.decoder.conv_out.weight * 2)
    every.step(vae.parameters())
    paddle.save(every.state_dict(), str(tmp_path / EMA_NAME))
    resumed = TrainableEMA(vae, decay=0.9)
    resumed.load_state_dict(paddle.load(str(tmp_path / EMA_NAME)))
    exported = load_ema(vae, str(tmp_path / EMA_NAME))
    assert resumed.decay == 0.5 and len(exported.shadow_params) == len(every.shadow_params)
    for name, averages in (("every", every), ("resumed", resumed), ("exported", exported)):
        export_vae_folder(vae, str(tmp_path / name), averages)
    for name in ("resumed", "exported"):
        assert_same_files(tmp_path / "every" / PADDLE_WEIGHTS, tmp_path / name / PADDLE_WEIGHTS)
    state = resumed.state_dict()
    with pytest.raises(ValueError, match="does not average this VAE's trained weights"):
        resumed.load_state_dict({**state, NAMES_KEY: ["decoder.other"] * len(state["shadow_params"])})


def test_a_decoder_only_run_resumes_exactly_from_a_checkpoint_of_either_kind(photo_filelist, tmp_path):
    """Stopped at step 1 and resumed, with its ema.pdparams as written now (the trained weights' averages) and as
    written before (every weight's), the run ends with the weights of the run straight through (both exports)."""
    paddle.seed(4)
    save_vae(build_vae("configs/vae_micro.json"), str(tmp_path / "source"))
    args = [str(a) for a in tiny_args(photo_filelist, "OUT", pretrained_model_name_or_path=tmp_path / "source",
                                      freeze_encoder="true", save_steps=1, image_logging_steps=0, report_to="none",
                                      perceptual_weight=0, disc_start=1)]
    args = args[:args.index("--vae_config_file")] + args[args.index("--vae_config_file") + 2:]

    def run(driver, output_dir, **flags):  # weights named as in a process of its own: the optimizers' states fit
        with paddle.utils.unique_name.guard():
            run_in_process(driver, [str(output_dir) if a == "OUT" else a for a in args] +
                           [item for key, value in flags.items() for item in (f"--{key}", str(value))])

    run(DRIVERS[1], tmp_path / "straight", max_steps=2)
    run(DRIVERS[1], tmp_path / "now", max_steps=1)
    checkpoint = tmp_path / "now" / "checkpoint-1"
    state, weights = paddle.load(str(checkpoint / EMA_NAME)), paddle.load(str(checkpoint / "model_state.pdparams"))
    assert not any(name.startswith(FROZEN) for name in state[NAMES_KEY])
    assert len(state["shadow_params"]) == len(state[NAMES_KEY]) < len([k for k in weights if k.startswith("vae.")])
    shutil.copytree(tmp_path / "now", tmp_path / "before")  # its ema.pdparams as this trainer wrote it before
    averages = dict(zip(state.pop(NAMES_KEY), state["shadow_params"]))
    names = [name for name, _ in build_vae(os.path.join(tmp_path, "source", "config.json")).named_parameters()]
    state["shadow_params"] = [averages.get(name, weights[f"vae.{name}"]) for name in names]
    paddle.save(state, str(tmp_path / "before" / "checkpoint-1" / EMA_NAME))
    write_manifest(str(tmp_path / "before" / "checkpoint-1"))
    run(DRIVERS[0], tmp_path / "now", max_steps=2, resume_from_checkpoint="latest")
    run(DRIVERS[1], tmp_path / "before", max_steps=2, resume_from_checkpoint="latest")
    for folder in ("vae", "vae_raw"):
        for resumed in ("now", "before"):
            assert_same_files(tmp_path / "straight" / folder / PADDLE_WEIGHTS, tmp_path / resumed / folder /
                              PADDLE_WEIGHTS)
