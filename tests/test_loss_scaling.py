"""fp16 loss scaling and overflow handling in the step (GPU-only in real runs: the scaler is forced on here).

Also guards the numpy-2.4 crash of Paddle's own GradScaler._update (float() of a 1-element tensor)."""

import numpy as np
import paddle
import pytest
from conftest import enabled_scaler, pretend_fp16_autocast
from paddle.amp.auto_cast import amp_global_state
from test_step import full_step, images, make_model, make_step, poison_gradient, unchanged, weights

from vae_trainer.precision import LossScaler
from vae_trainer.step import NonFiniteError


@pytest.fixture
def fp16_state():
    """scale() only scales after an fp16 autocast has run (on a GPU); pretend one has."""
    previous = pretend_fp16_autocast()
    yield
    amp_global_state().amp_dtype = previous


def test_overflow_lowers_the_scale_down_to_its_floor_and_good_steps_raise_it():
    scaler = enabled_scaler(scale=4.0, min_loss_scale=2.0)
    scaler.update_after(found_inf=True)
    assert scaler.scale_value == 2.0 and scaler._scale.item() == 2.0
    scaler.update_after(found_inf=True)  # at the floor: stays
    assert scaler.scale_value == 2.0 and scaler._scale.item() == 2.0
    scaler.update_after(found_inf=False)
    scaler.update_after(found_inf=False)
    assert scaler.scale_value == 4.0 and scaler._scale.item() == 4.0  # doubled after incr_every_n_steps good steps


def test_the_host_scale_survives_a_checkpoint():
    saved = enabled_scaler(scale=1024.0)
    saved.update_after(found_inf=True)
    restored = enabled_scaler(scale=65536.0)
    restored.load_state_dict(saved.state_dict())
    assert restored.scale_value == 512.0 and restored._scale.item() == 512.0


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
    scaler.update_after(found_inf=False)
    assert np.allclose(layer.weight.numpy(), before - 1.0)


def fp16_step(model, tmp_path, vae_scale=8.0, disc_scale=8.0, min_loss_scale=2.0, **kw):
    scalers = (enabled_scaler(vae_scale, min_loss_scale), enabled_scaler(disc_scale, min_loss_scale))
    return make_step(model, tmp_path, scalers=scalers, **kw)


def test_vae_overflows_are_counted_skipped_alone_and_stop_the_run(tmp_path, fp16_state):
    """Finite losses, infinite VAE gradients at every step: only the VAE's step is skipped, its scale halves
    down to --min_loss_scale and stays there, and --max_consecutive_overflow_steps stops the run, instead of
    skipping forever while the scale sinks to zero."""
    model = make_model()
    step = fp16_step(model, tmp_path, max_overflow=3, max_nonfinite=1)
    poison_gradient(model.vae.encoder.conv_in.weight)
    vae_before, disc_before = weights(model.vae), weights(model.discriminator)
    report = full_step(step, images(), global_step=0)
    assert report["train/overflow_steps"] == 1 and report["train/skipped_steps"] == 0  # not the NaN guard's
    assert report["train/loss_scale"] == 4.0 and report["train/disc_loss_scale"] == 8.0
    assert unchanged(model.vae, vae_before) and not unchanged(model.discriminator, disc_before)
    report = full_step(step, images(seed=1), global_step=1)
    assert report["train/overflow_steps"] == 2 and report["train/loss_scale"] == 2.0
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer steps had fp16 gradient overflow in the vae"):
        full_step(step, images(seed=2), global_step=2)
    assert step.networks[0].scaler.scale_value == 2.0  # the floor
    assert unchanged(model.vae, vae_before)


def test_a_nan_loss_under_fp16_is_the_nan_guards_not_an_overflow(tmp_path, fp16_state):
    model = make_model()
    step = fp16_step(model, tmp_path)
    before = weights(model)
    bad = images()
    bad[0, 0, 0, 0] = float("nan")
    report = full_step(step, bad, global_step=0)
    assert report["train/skipped_steps"] == 1 and report["train/overflow_steps"] == 0
    assert report["train/disc_overflow_steps"] == 0 and unchanged(model, before)


def test_an_overflowing_adaptive_weight_skips_the_gan_term_and_is_counted(tmp_path, fp16_state):
    """A VAE loss scale so large that the scaled gradients overflow float32: the adaptive weight is not finite,
    the GAN term of the micro-batch is skipped (the loss stays finite), and the step counts it."""
    model = make_model()
    step = fp16_step(model, tmp_path, vae_scale=3e38)
    logs = step.forward_backward(images(), 0, 0)
    assert logs["gan/adaptive_weight_overflow"].item() == 1.0 and logs["gan/adaptive_weight"].item() == 0.0
    assert np.isfinite(logs["loss/total"].item())
    report = step.optimizer_step(global_step=0)[0]
    assert report["train/skipped_gan_terms"] == 1 and report["train/skipped_steps"] == 0


def test_scaler_without_autocast_stays_disabled_on_cpu(tmp_path):
    """On CPU the real LossScaler disables itself: fp16 flags then train in float32 with a scale of 1."""
    scaler = LossScaler(init_loss_scaling=1024.0)
    assert not scaler.is_enable() and scaler.scale_value == 1.0
    step = make_step(make_model(), tmp_path, scalers=(scaler, LossScaler(1024.0)))
    assert not step.networks[0].scaler.is_enable() and step.networks[1].scaler.scale_value == 1.0


def _steps(step, model, first, last, overflow_at, nan_at):
    """Optimizer steps first..last-1: VAE gradient overflow at `overflow_at`, a NaN input (loss) at `nan_at`."""
    reports = []
    for global_step in range(first, last):
        hook = poison_gradient(model.vae.encoder.conv_in.weight) if global_step in overflow_at else None
        x = images(seed=global_step)
        if global_step in nan_at:
            x[0, 0, 0, 0] = float("nan")
        try:
            reports.append(full_step(step, x, global_step=global_step))
        finally:
            if hook is not None:
                hook.remove()
    return reports


def test_skip_counters_survive_a_checkpoint_and_resume_counts_on_exactly(tmp_path, fp16_state):
    """Overflows at steps 1 and 2, a checkpoint after step 2, a NaN loss at step 3 (which neither continues
    nor breaks a run of overflows), an overflow at step 4: the third overflow in a row stops the run at step 4,
    resumed or not, and every counter before that equals the uninterrupted run's."""
    from paddlenlp.trainer import TrainerState

    from vae_trainer import checkpoint as ckpt
    from vae_trainer.build import stateful

    schedule = dict(overflow_at={1, 2, 4}, nan_at={3})
    counters = ("train/skipped_steps", "train/overflow_steps", "train/disc_overflow_steps", "train/loss_scale")

    model = make_model()
    straight = fp16_step(model, tmp_path, max_overflow=3, max_nonfinite=3, min_loss_scale=1.0)
    reports = _steps(straight, model, 0, 4, **schedule)
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer steps had fp16 gradient overflow"):
        _steps(straight, model, 4, 5, **schedule)

    model = make_model()
    first = fp16_step(model, tmp_path, max_overflow=3, max_nonfinite=3, min_loss_scale=1.0)
    before = _steps(first, model, 0, 3, **schedule)
    saved = ckpt.save_checkpoint(str(tmp_path / "out"), 3, model=model, stateful=stateful(first),
                                 trainer_state=TrainerState(global_step=3), rank_state={})
    model = make_model(seed=1)  # a fresh process: other weights, counters at zero, until loaded
    resumed = fp16_step(model, tmp_path, max_overflow=3, max_nonfinite=3, min_loss_scale=1.0)
    ckpt.load_model_state(saved, model)
    ckpt.load_stateful(saved, stateful(resumed))
    after = _steps(resumed, model, 3, 4, **schedule)
    assert [[r[c] for c in counters] for r in before + after] == [[r[c] for c in counters] for r in reports]
    assert after[0]["train/skipped_steps"] == 1 and after[0]["train/overflow_steps"] == 2
    with pytest.raises(NonFiniteError, match="3 consecutive optimizer steps had fp16 gradient overflow"):
        _steps(resumed, model, 4, 5, **schedule)
