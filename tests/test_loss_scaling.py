"""fp16 loss-scale bookkeeping of the step (GPU-only in real runs: the scaler is forced on here).

Also guards the numpy-2.4 crash of Paddle's own GradScaler._update (float() of a 1-element tensor)."""

from collections import defaultdict

import numpy as np
import paddle
import pytest
from paddle.amp.grad_scaler import _refresh_optimizer_state

from vae_trainer.precision import LossScaler
from vae_trainer.step import update_scaler


def enabled_scaler(scale=1024.0):
    """A GradScaler in the state its constructor leaves it in on a GPU (on CPU it disables itself)."""
    scaler = LossScaler(init_loss_scaling=scale)
    scaler._enable, scaler._use_dynamic_loss_scaling = True, True
    scaler._incr_ratio, scaler._decr_ratio = 2.0, 0.5
    scaler._incr_every_n_steps, scaler._decr_every_n_nan_or_inf = 2, 1
    scaler._incr_count = scaler._decr_count = 0
    scaler._scale = paddle.to_tensor(np.array([scale], np.float32))
    scaler._cache_found_inf = None
    for name in ("_found_inf", "_temp_found_inf_value_false", "_temp_found_inf_fp16", "_temp_found_inf_bf16",
                 "_temp_found_inf_fp32"):
        setattr(scaler, name, paddle.to_tensor(np.array([0]).astype(np.bool_)))
    scaler._optimizer_states = defaultdict(_refresh_optimizer_state)
    return scaler


def test_overflow_lowers_the_scale_and_good_steps_raise_it():
    scaler = enabled_scaler()
    update_scaler(scaler, found_inf=True)
    assert scaler._scale.item() == 512.0
    update_scaler(scaler, found_inf=False)
    update_scaler(scaler, found_inf=False)
    assert scaler._scale.item() == 1024.0  # doubled after incr_every_n_steps good steps
    update_scaler(None, found_inf=True)  # no scaler (fp32/bf16): nothing to do


@pytest.fixture
def fp16_state():
    """scale() only scales after an fp16 autocast has run (on a GPU); pretend one has."""
    from paddle.amp.auto_cast import amp_global_state

    previous = amp_global_state().amp_dtype
    amp_global_state().amp_dtype = "float16"
    yield
    amp_global_state().amp_dtype = previous


def test_unscale_then_our_update_applies_true_gradients_once(fp16_state):
    """unscale_ divides the gradients by the scale exactly once; the optimizer then sees true gradients."""
    scaler = enabled_scaler(scale=8.0)
    layer = paddle.nn.Linear(2, 1, bias_attr=False)
    optimizer = paddle.optimizer.SGD(learning_rate=1.0, parameters=layer.parameters())
    before = layer.weight.numpy().copy()
    scaler.scale(layer(paddle.ones([1, 2])).sum()).backward()
    assert np.allclose(layer.weight.grad.numpy(), 8.0)
    scaler.unscale_(optimizer)
    assert np.allclose(layer.weight.grad.numpy(), 1.0)
    optimizer.step()
    update_scaler(scaler, found_inf=False)
    assert np.allclose(layer.weight.numpy(), before - 1.0)
