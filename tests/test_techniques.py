"""The training techniques of docs/techniques.md: the math of each one, recipes, and both entry points."""

import json
import math
import os

import numpy as np
import paddle
import pytest
from conftest import read_scalars, run_in_process

from vae_trainer.argument_parser import parse_arguments
from vae_trainer.arguments import LossArguments
from vae_trainer.objectives.gan import discriminator_objective, generator_loss, lecam
from vae_trainer.objectives.reconstruction import latent_penalty, lowpass_mask, normalize_gradient, pixel_term
from vae_trainer.objectives import vae_objective
from vae_trainer.models.trainable import VAEWithDiscriminator
from vae_trainer.models.discriminator import build_discriminator
from vae_trainer.models.lpips import LPIPS
from vae_trainer.models.vae_loading import build_vae

paddle.set_device("cpu")
MICRO = "configs/vae_micro.json"


def random_images(n=2, size=32, seed=0):
    return paddle.to_tensor(np.random.default_rng(seed).uniform(-1, 1, (n, 3, size, size)).astype("float32"))


def leaf(tensor):
    tensor = tensor.detach().clone()
    tensor.stop_gradient = False
    return tensor


def per_sample_norms(grad):
    return np.sqrt((grad.numpy().astype(np.float64) ** 2).reshape(grad.shape[0], -1).sum(1))


# ---------------------------------------------------------------- 1. gradnorm
def test_normalize_gradient_sets_the_norm_and_keeps_the_direction():
    x = random_images(n=3)
    coefficients = paddle.to_tensor(np.array([1.0, 10.0, 100.0], "float32").reshape(3, 1, 1, 1))
    raw = 2 * coefficients * x  # the gradient of sum(coefficients * x^2), not normalised
    grad = normalize_gradient(raw, 2.0, "sample")
    np.testing.assert_allclose(per_sample_norms(grad), [2.0 / 3] * 3, rtol=1e-5)  # weight / B each
    for got, want in zip(grad.numpy(), raw.numpy()):
        np.testing.assert_allclose(got / np.linalg.norm(got), want / np.linalg.norm(want), rtol=1e-4, atol=1e-7)

    grad = normalize_gradient(raw, 2.0, "global")
    assert np.linalg.norm(grad.numpy()) == pytest.approx(2.0, rel=1e-5)
    # Global scope keeps the samples' relative sizes (sample 2's gradient is 100x sample 0's).
    norms = per_sample_norms(grad)
    expected = 100 * np.linalg.norm(x[2].numpy()) / np.linalg.norm(x[0].numpy())
    assert norms[2] / norms[0] == pytest.approx(expected, rel=1e-4)


def gradnorm_args(**overrides):
    kw = dict(loss_balancing="gradnorm", gradnorm_scope="global", pixel_weight=0.0, perceptual_weight=0.0,
              disc_weight=0.0, kl_weight=0.0)
    kw.update(overrides)
    return LossArguments(**kw)


@pytest.mark.parametrize("branch,weight", [("pixel_weight", 0.7), ("perceptual_weight", 0.3), ("disc_weight", 0.05)])
def test_each_gradnorm_branch_sends_its_configured_norm_into_the_reconstruction(branch, weight):
    paddle.seed(0)
    x, recon = random_images(seed=1), leaf(random_images(seed=2) * 0.5)
    zeros = paddle.zeros([2, 4, 8, 8])
    lpips = LPIPS() if branch == "perceptual_weight" else None
    disc = build_discriminator(norm="group", num_layers=2, base_channels=8)
    for grad_scale in (1.0, 0.25):  # 0.25: e.g. 4 accumulation steps
        recon.clear_gradient()
        objective = vae_objective(x, recon, zeros, zeros, paddle.zeros([]), loss_args=gradnorm_args(**{branch: weight}),
                                  lpips=lpips, discriminator=disc, last_layer=None,
                                  gan_weight=weight if branch == "disc_weight" else 0, grad_scale=grad_scale)
        objective.backward(recon)
        loss, logs = objective.logs["loss/total"], objective.logs
        assert np.linalg.norm(recon.grad.numpy()) == pytest.approx(weight * grad_scale, rel=1e-4)
    # The branches' weights act only in the backward: the loss is their unweighted sum.
    parts = logs["loss/pixel"] + logs["loss/perceptual"] + logs.get("loss/generator", paddle.zeros([]))
    assert loss.item() == pytest.approx(parts.item(), rel=1e-6)


def test_gradnorm_branches_add_up():
    x, recon = random_images(seed=1), leaf(random_images(seed=2) * 0.5)
    zeros = paddle.zeros([2, 4, 8, 8])
    grads = {}
    for name, weights in {"pixel": (1.0, 0.0), "adv": (0.0, 0.2), "both": (1.0, 0.2)}.items():
        paddle.seed(0)
        disc = build_discriminator(norm="group", num_layers=2, base_channels=8)
        recon.clear_gradient()
        args = gradnorm_args(pixel_weight=weights[0], disc_weight=weights[1])
        vae_objective(x, recon, zeros, zeros, paddle.zeros([]), loss_args=args, lpips=None,
                      discriminator=disc, last_layer=None, gan_weight=args.disc_weight).backward(recon)
        grads[name] = recon.grad.numpy()
    np.testing.assert_allclose(grads["both"], grads["pixel"] + grads["adv"], rtol=1e-4, atol=1e-8)


# ---------------------------------------------------------------- 2. constant variance
def test_constant_variance_samples_with_the_fixed_std_and_ignores_the_encoder_logvar():
    paddle.seed(0)
    model = VAEWithDiscriminator(build_vae(MICRO), build_discriminator(norm="group", base_channels=8),
                                 posterior_std=0.1)
    decoded = []
    decode = model.vae.decode
    model.vae.decode = lambda z: decoded.append(z.numpy()) or decode(z)
    recon, mean, logvar = model(random_images(n=4, size=32), sample_posterior=True)
    noise = decoded[0] - mean.numpy()
    assert noise.std() == pytest.approx(0.1, rel=0.1) and abs(noise.mean()) < 0.02
    assert np.allclose(logvar.numpy(), math.log(0.01), rtol=1e-6)
    # Without sampling the mean is decoded.
    model(random_images(n=4, size=32), sample_posterior=False)
    np.testing.assert_array_equal(decoded[1], model.vae.encode(random_images(n=4, size=32)).latent_dist.mean.numpy())
    # The encoder's log-variance channels (second half of quant_conv) get no gradient at all.
    (recon.square().mean() + latent_penalty(mean)).backward()
    grad = model.vae.quant_conv.weight.grad.numpy()
    assert np.abs(grad[:4]).sum() > 0 and np.abs(grad[4:]).sum() == 0


def test_latent_penalty_replaces_kl_with_its_own_weight():
    mean = paddle.to_tensor(np.random.default_rng(0).normal(0, 2, (2, 4, 8, 8)).astype("float32"))
    assert latent_penalty(mean).item() == pytest.approx(float((mean.numpy().astype(np.float64) ** 2).mean()), rel=1e-5)
    x = random_images()
    args = LossArguments(perceptual_weight=0.0, kl_weight=0.0, latent_penalty_weight=0.01)
    objective = vae_objective(x, x, mean, paddle.full_like(mean, math.log(0.01)), paddle.zeros([]), loss_args=args,
                              lpips=None, discriminator=None, last_layer=None, gan_weight=0)
    loss, logs = objective.logs["loss/total"], objective.logs
    assert loss.item() == pytest.approx(0.01 * logs["loss/latent_penalty"].item(), rel=1e-6)


# ---------------------------------------------------------------- 3. pooled pixel loss
def test_pooled_pixel_loss_compares_area_downsampled_images():
    x, recon = random_images(seed=1), random_images(seed=2)
    pooled = pixel_term(x, recon, LossArguments(pixel_loss_pool=4))
    a, b = (t.numpy().reshape(2, 3, 8, 4, 8, 4).mean(axis=(3, 5)) for t in (x, recon))
    assert pooled.item() == pytest.approx(np.abs(a - b).mean(), rel=1e-5)
    # A 2x2 checkerboard error (pure high frequency) is invisible to the pooled loss only.
    checker = paddle.to_tensor((np.indices((32, 32)).sum(0) % 2 * 2 - 1).astype("float32") * 0.1)
    noisy = x + checker
    assert pixel_term(x, noisy, LossArguments(pixel_loss_pool=2)).item() < 1e-6
    assert pixel_term(x, noisy, LossArguments(pixel_loss_pool=1)).item() == pytest.approx(0.1, rel=1e-5)


# ---------------------------------------------------------------- 4. low-pass mask
def test_lowpass_mask_is_zero_on_a_sharp_edge_and_one_in_flat_regions():
    image = np.full((1, 3, 32, 32), -0.8, "float32")
    image[..., 16:] = 0.8  # vertical edge between columns 15 and 16
    mask = lowpass_mask(paddle.to_tensor(image)).numpy()[0, 0]
    assert mask.shape == (32, 32) and set(np.unique(mask)) <= {0.0, 1.0}
    assert (mask[:, 14:18] == 0).all()
    assert (mask[:, :10] == 1).all() and (mask[:, 22:] == 1).all()
    assert (lowpass_mask(paddle.full([1, 3, 16, 16], 0.3)).numpy() == 1).all()
    # Faint noise without any real edge is not stretched into edges.
    faint = 0.3 + paddle.to_tensor(np.random.default_rng(0).uniform(-1, 1, (1, 3, 16, 16)).astype("float32")) / 255
    assert (lowpass_mask(faint).numpy() == 1).all()


def test_masked_pixel_loss_ignores_errors_on_edges():
    image = np.full((1, 3, 32, 32), -0.8, "float32")
    image[..., 16:] = 0.8
    x = paddle.to_tensor(image)
    on_edge, off_edge = image.copy(), image.copy()
    on_edge[..., 15:17] += 0.5
    off_edge[..., 3:5] += 0.5
    args = LossArguments(pixel_loss_mask="lowpass")
    assert pixel_term(x, paddle.to_tensor(on_edge), args).item() == 0.0
    assert pixel_term(x, paddle.to_tensor(off_edge), args).item() == pytest.approx(0.5 * 2 / 32, rel=1e-5)


# ---------------------------------------------------------------- 5. VGG16-feature discriminator
def test_vgg_discriminator_starts_at_zero_trains_its_heads_only():
    paddle.seed(0)
    disc = build_discriminator("vgg", base_channels=8)
    real, fake = random_images(n=2, seed=3) * 0.2, random_images(n=2, seed=4)
    logits = disc(real)
    assert logits.shape == [2, 1] and np.abs(logits.numpy()).max() == 0.0
    trainable = [p for p in disc.parameters() if not p.stop_gradient]
    assert len(trainable) == 5 * 4  # 5 heads x (conv weight, bias) x 2 convs
    optimizer = paddle.optimizer.Adam(1e-3, parameters=trainable)
    for _ in range(5):
        loss, _ = discriminator_objective(disc, real, fake, LossArguments())
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    assert disc(real).mean().item() > disc(fake).mean().item()
    assert all(p.grad is None for p in disc.backbone.parameters())
    # Gradients still reach the input (the generator's adversarial loss needs them).
    x = leaf(fake)
    disc(x).sum().backward()
    assert np.abs(x.grad.numpy()).sum() > 0


# ---------------------------------------------------------------- 6. adversarial variants
def test_generator_losses():
    real = paddle.to_tensor([[1.0], [0.0], [2.0]])
    fake = paddle.to_tensor([[0.5], [0.5], [-1.0]])
    assert generator_loss(fake, "hinge").item() == pytest.approx(0.0)  # -mean(0.5, 0.5, -1)
    assert generator_loss(fake, "vanilla").item() == pytest.approx(np.log1p(np.exp(-np.array([0.5, 0.5, -1]))).mean())
    # relu(real - fake - 0.25) = relu(0.25, -0.75, 2.75)
    assert generator_loss(fake, "relative_hinge", real, 0.25).item() == pytest.approx(3.0 / 3)


def test_lecam_regularization_and_its_ema():
    real, fake = paddle.to_tensor([[2.0], [0.0]]), paddle.to_tensor([[-1.0], [1.0]])
    # relu(real - ema_fake)^2 with ema_fake 0.5: (1.5^2, 0); relu(ema_real - fake)^2 with ema_real 0.5: (1.5^2, 0)
    reg = lecam(paddle.to_tensor([0.5, 0.5]), real, fake, 0.99)
    assert reg.item() == pytest.approx(2.25 / 2 + 2.25 / 2)

    paddle.seed(0)
    model = VAEWithDiscriminator(build_vae(MICRO), build_discriminator(norm="group", num_layers=2, base_channels=8))
    assert "lecam_ema" in model.state_dict()  # saved in model_state.pdparams with the weights
    model.lecam_ema.set_value(paddle.to_tensor([0.5, -0.5]))
    x, recon = random_images(seed=1), random_images(seed=2)
    plain, _ = discriminator_objective(model.discriminator, x, recon, LossArguments())
    with_lecam, logs = discriminator_objective(model.discriminator, x, recon, LossArguments(lecam_weight=0.1,
                                               lecam_decay=0.9), lecam_ema=model.lecam_ema)
    d_real, d_fake = model.discriminator(x), model.discriminator(recon)
    expected = lecam(paddle.to_tensor([0.5, -0.5]), d_real, d_fake, 0.9)
    assert with_lecam.item() == pytest.approx(plain.item() + 0.1 * expected.item(), rel=1e-5)
    want_ema = 0.9 * np.array([0.5, -0.5]) + 0.1 * np.array([d_real.mean().item(), d_fake.mean().item()])
    np.testing.assert_allclose(model.lecam_ema.numpy(), want_ema, rtol=1e-5)


# ---------------------------------------------------------------- 8. recipes
BASE = ["--file_list", "x.filelist", "--vae_config_file", MICRO, "--output_dir", "/tmp/unused", "--max_steps", "1"]


def test_recipes_set_flags_and_explicit_flags_win(tmp_path):
    model_args, _, loss_args, _ = parse_arguments(BASE + ["--recipe", "balanced"])
    assert (loss_args.loss_balancing, model_args.posterior_std, loss_args.pixel_loss_mask, model_args.disc_type,
            loss_args.kl_weight) == ("gradnorm", 0.1, "lowpass", "vgg", 0.0)
    # Explicit flags win wherever they appear, including booleans' --no_ form and --flag=value.
    model_args, _, loss_args, _ = parse_arguments(
        ["--posterior_std=0.3"] + BASE + ["--recipe", "balanced", "--disc_type", "patch", "--loss_balancing", "none",
                                          "--no_adaptive_disc_weight"])
    assert (model_args.posterior_std, model_args.disc_type, loss_args.loss_balancing,
            loss_args.adaptive_disc_weight) == (0.3, "patch", "none", False)
    # ldm equals the defaults, except what is given and the GAN's start: LDM's term at full weight at once.
    _, _, ldm, _ = parse_arguments(BASE + ["--recipe", "ldm", "--kl_weight", "1e-5"])
    _, _, default, _ = parse_arguments(BASE + ["--kl_weight", "1e-5"])
    assert (ldm.disc_weight_warmup_steps, default.disc_weight_warmup_steps) == (0, 1000)
    assert {**vars(ldm), "recipe": None, "disc_weight_warmup_steps": 1000} == vars(default)
    # A JSON file of flags: its keys are the explicit ones.
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"file_list": "x.filelist", "vae_config_file": MICRO, "output_dir": str(tmp_path),
                                  "max_steps": 1, "recipe": "balanced", "pixel_loss_mask": "none"}))
    _, _, loss_args, _ = parse_arguments([str(config)])
    assert (loss_args.pixel_loss_mask, loss_args.loss_balancing) == ("none", "gradnorm")


def test_invalid_technique_flags_are_rejected(capsys):
    for flag, value in (("--recipe", "magic"), ("--gradnorm_scope", "rank")):  # typed choices: at parse time
        with pytest.raises(SystemExit):
            parse_arguments(BASE + [flag, value])
        assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="learn_logvar"):
        parse_arguments(BASE + ["--recipe", "balanced", "--learn_logvar", "true"])


# ---------------------------------------------------------------- one entry point, every technique
# balanced = gradnorm + constant variance + low-pass mask + VGG discriminator; plus the rest. One driver: the two
# are proven equal by test_train_e2e.py, and the techniques live in the shared step.
TECHNIQUE_FLAGS = {"recipe": "balanced", "gradnorm_scope": "sample", "pixel_loss_pool": 2, "gen_loss": "relative_hinge",
                   "lecam_weight": 0.1}


def test_every_technique_runs_in_an_entry_point(photo_filelist, tmp_path):
    output_dir = str(tmp_path / "out")
    args = {
        "file_list": photo_filelist, "vae_config_file": MICRO, "output_dir": output_dir, "resolution": 32,
        "per_device_train_batch_size": 2, "max_steps": 3, "disc_start": 1, "logging_steps": 1, "save_steps": 3,
        "image_logging_steps": 0, "seed": 3, "device": "cpu", "dataloader_num_workers": 0, "disc_base_channels": 8,
        "learning_rate": 1e-3, "disable_tqdm": "true", **TECHNIQUE_FLAGS,
    }
    run_in_process("train_vae_trainer.py", [item for key, value in args.items() for item in (f"--{key}", value)])
    logdir = os.path.join(output_dir, "logs")
    for tag in ("loss/total", "loss/pixel", "loss/perceptual", "loss/latent_penalty"):
        values = read_scalars(logdir, tag)
        assert sorted(values) == [1, 2, 3] and np.isfinite(list(values.values())).all(), tag
    for tag in ("loss/generator", "loss/discriminator", "gan/lecam"):
        values = read_scalars(logdir, tag)
        assert sorted(values) == [2, 3] and np.isfinite(list(values.values())).all(), tag
    assert os.path.isfile(os.path.join(output_dir, "vae", "config.json"))
    with open(os.path.join(output_dir, "discriminator", "config.json")) as handle:
        assert json.load(handle)["disc_type"] == "vgg"
    state = paddle.load(os.path.join(output_dir, "checkpoint-3", "model_state.pdparams"))
    assert np.abs(state["lecam_ema"].numpy()).sum() > 0  # the LeCAM EMA was updated and checkpointed
