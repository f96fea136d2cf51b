"""Mixed-precision set-up. Real autocast needs a GPU; on CPU the flags must run, warn, and save scalers."""

import logging
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, EVAL_FLAGS, read_scalars, run_entry_point, tiny_args

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


def test_a_zero_loss_scale_floor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--min_loss_scale must be > 0"):
        setup_precision(args(tmp_path, fp16=True, min_loss_scale=0.0), paddle.nn.Linear(2, 2))


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
