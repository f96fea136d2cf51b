"""Mixed-precision set-up. Real autocast needs a GPU; on CPU the flags must run, warn, and save scalers."""

import logging
import os

import paddle
import pytest
from conftest import run_entry_point, tiny_args

from vae_trainer.arguments import VAETrainingArguments
from vae_trainer.precision import setup_precision


def args(tmp_path, **kw):
    return VAETrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], **kw)


def test_fp16_gets_one_scaler_per_network_and_bf16_none(tmp_path, caplog):
    model = paddle.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="vae_trainer"):
        fp16 = setup_precision(args(tmp_path, fp16=True), model)
    assert fp16.dtype == "float16" and fp16.vae_scaler is not None and fp16.disc_scaler is not None
    assert fp16.vae_scaler is not fp16.disc_scaler
    assert set(fp16.stateful()) == {"vae_scaler.pdparams", "disc_scaler.pdparams"}
    assert "no autocast" in caplog.text  # the CPU warning
    bf16 = setup_precision(args(tmp_path, bf16=True), model)
    assert bf16.dtype == "bfloat16" and bf16.vae_scaler is None and bf16.stateful() == {}
    assert setup_precision(args(tmp_path), model).dtype is None
    # O2 is not applied on CPU (no half-precision conv kernels): the weights stay float32.
    setup_precision(args(tmp_path, fp16=True, fp16_opt_level="O2"), model)
    assert model.weight.dtype == paddle.float32


@pytest.mark.parametrize("driver,flags", [
    ("train_vae_no_trainer.py", {"fp16": "true", "fp16_opt_level": "O2"}),
    ("train_vae_trainer.py", {"fp16": "true"}),
    ("train_vae_trainer.py", {"bf16": "true"}),
])
def test_mixed_precision_flags_train_on_cpu_with_a_warning(photo_filelist, tmp_path, driver, flags):
    output_dir = tmp_path / "out"
    result = run_entry_point(driver, tiny_args(photo_filelist, output_dir, max_steps=2, save_steps=2,
                                               image_logging_steps=0, disc_start=1, **flags))
    assert "Paddle does no autocast" in result.stderr + result.stdout
    assert os.path.isdir(output_dir / "vae")
    has_scalers = os.path.isfile(output_dir / "checkpoint-2" / "vae_scaler.pdparams")
    assert has_scalers == ("fp16" in flags)
