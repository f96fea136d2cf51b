"""Backward numerics (issue 42): every family's gradients equal PyTorch diffusers 0.42.1's, at ordinary weights and at
stressed ones (the trainable norms' scales multiplied, so that activations see inputs far beyond +-100); our PatchGAN's and
LPIPS's equal PyTorch re-implementations of taming's and lpips' networks on the same weights; Paddle's SiLU has a
correct backward (vae_trainer/models/activations.py) and the other activations the families use agree with
PyTorch's at extreme inputs; a SANA-shaped DC-AE whose pre-activations go below -89 fine-tunes without a skipped step.

Every PyTorch-side job (tests/diffusers_side.py: make --stress, run --train, patchgan, lpips) runs in ONE .venv-flux2
process (the module fixture `torch_side`); the activations compare with .venv's torch in this process. The Paddle side
takes the trainer's path: build_vae on the diffusers folder, the family's encode / decode through
VAEWithDiscriminator in train mode (BatchNorm on batch statistics, no dropout, RAE's encoder frozen), the posterior's
mode, loss mean((decoded - images) ** 2).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import paddle
import pytest
from conftest import DRIVERS, import_test_extra, read_scalars, run_in_process
from family_parity import DiffusersBatch, random_images, trainer_args
from test_autoencoder_dc import CONFIGS as DC_CONFIGS
from test_autoencoder_kl_wan import ATTENTION_PRELUDE
from test_autoencoder_kl_wan import CONFIGS as VIDEO_CONFIGS
from test_autoencoder_rae import CASES as RAE_CASES
from test_dc_ae import TINY_DC
from test_flux2 import TINY_FLUX2

from vae_trainer.models.activations import KERNEL_SILU  # importing vae_trainer.models installs the fix

RELATIVE = 1e-3  # per tensor: ||ours - theirs|| <= RELATIVE * ||theirs|| + ABSOLUTE * (the largest ||theirs||)
ABSOLUTE = 1e-6
SIZE = 32
# name -> (class, config, stress: the factor on the norms' scales of the stressed copy, diffusers_side.py's _stress)
FAMILIES = {
    "kl": ("AutoencoderKL", dict(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                                 up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1, latent_channels=4,
                                 norm_num_groups=4, sample_size=SIZE), 40.0),
    "flux2": ("AutoencoderKLFlux2", TINY_FLUX2, 40.0),
    "dc_sana": ("AutoencoderDC", DC_CONFIGS["sana"], 20.0),
    "dc_in_mix": ("AutoencoderDC", DC_CONFIGS["in_mix"], 30.0),
    "rae": ("AutoencoderRAE", dict(RAE_CASES["plain"][0], patch_size=16, reshape_to_2d=True, noise_tau=0.0), 80.0),
    "qwen": (*VIDEO_CONFIGS["qwen"], 40.0),
    "wan21": (*VIDEO_CONFIGS["wan21"], 40.0),
    "wan22": (*VIDEO_CONFIGS["wan22"], 40.0),
    # Clips of 5 frames (issue 43): the causal cache across chunks, the time_convs and the earlier-frame taps.
    "qwen_clip": (*VIDEO_CONFIGS["qwen"], 40.0),
    "wan22_clip": (*VIDEO_CONFIGS["wan22"], 40.0),
}
CLIP_FRAMES = 5
STATES = ("ordinary", "stressed")
PATCHGAN_NORMS = ("batch", "group", "none")
FINE_TUNE_STRESS = 20.0


def images(count: int = 2, seed: int = 0) -> np.ndarray:
    return random_images(count, SIZE, seed)


def network_input(name: str) -> np.ndarray:
    """What family `name`'s step takes: images, one-frame clips (video VAEs) or clips of CLIP_FRAMES frames."""
    seed = list(FAMILIES).index(name)
    if name.endswith("_clip"):
        return np.stack([images(CLIP_FRAMES, seed=seed + 100 * k) for k in range(2)]).transpose(0, 2, 1, 3, 4)
    return images(seed=seed)[:, :, None] if name in VIDEO_CONFIGS else images(seed=seed)


@pytest.fixture(scope="module")
def torch_side(tmp_path_factory) -> dict:
    """Every PyTorch-side job of this file in one diffusers process: {key: the function reading its result}."""
    root = tmp_path_factory.mktemp("gradients")
    prelude = root / "prelude.py"
    prelude.write_text(ATTENTION_PRELUDE)  # diffusers' Wan / Qwen-Image down-block attention, made callable
    batch, results = DiffusersBatch(root), {}
    for k, (name, (class_name, config, stress)) in enumerate(FAMILIES.items()):
        for state in STATES:
            work = root / f"{name}_{state}"
            (work / "run").mkdir(parents=True)
            folder = batch.make(class_name, work / "made", config, seed=k, stress=stress if state == "stressed" else 1)
            results[name, state] = folder, batch.run(class_name, folder, network_input(name), work / "run",
                                                     flags=["--train", "--prelude", str(prelude)])
    for norm in PATCHGAN_NORMS:
        results["patchgan", norm] = _patchgan_job(batch, root / f"patchgan_{norm}", norm)
    results["lpips"] = _lpips_job(batch, root / "lpips")
    results["fine_tune"] = batch.make("AutoencoderDC", root / "fine_tune", TINY_DC, seed=3, stress=FINE_TUNE_STRESS)
    batch.flush()
    return results


# ---------------------------------------------------------------------------------------------------- helpers


def worst_relative_error(ours: dict, theirs: dict) -> tuple[float, str]:
    """Asserts every tensor finite and within RELATIVE of PyTorch's (plus an absolute floor: ABSOLUTE times the
    largest tensor's norm, for gradients that are 0 in exact arithmetic, such as the key bias's under softmax);
    returns the worst ||ours - theirs|| / ||theirs|| among the tensors above that floor, and its name."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:10]
    floor = ABSOLUTE * max(float(np.linalg.norm(t)) for t in theirs.values())
    worst, worst_name, failures = 0.0, "", []
    for name, theirs_grad in theirs.items():
        ours_grad = ours[name]
        assert ours_grad.shape == theirs_grad.shape, (name, ours_grad.shape, theirs_grad.shape)
        assert np.isfinite(ours_grad).all(), f"{name}: non-finite gradient"
        error, size = float(np.linalg.norm(ours_grad - theirs_grad)), float(np.linalg.norm(theirs_grad))
        if error > RELATIVE * size + floor:
            failures.append((name, error, size))
        if size > floor and error / size > worst:
            worst, worst_name = error / size, name
    assert not failures, failures[:10]
    return worst, worst_name


@contextlib.contextmanager
def activation_inputs():
    """Within: {activation: [min, max] of every input it saw} for the activations the families call through
    paddle.nn.functional (nn.Silu, nn.GELU, ... and ppdiffusers' get_activation look them up at each call)."""
    seen = {}
    originals = {name: getattr(paddle.nn.functional, name) for name in ("silu", "gelu", "relu", "relu6", "mish")}

    def recording(name, function):
        def call(x, *args, **kwargs):
            low, high = seen.setdefault(name, [np.inf, -np.inf])
            seen[name] = [min(low, x.min().item()), max(high, x.max().item())]
            return function(x, *args, **kwargs)
        return call

    try:
        for name, function in originals.items():
            setattr(paddle.nn.functional, name, recording(name, function))
        yield seen
    finally:
        for name, function in originals.items():
            setattr(paddle.nn.functional, name, function)


def paddle_step(folder: str, x: np.ndarray):
    """The trainer's reconstruction step on the VAE of `folder`: (decoded, {name: gradient} of every trainable
    weight in diffusers' layout, the activations' input ranges)."""
    from vae_trainer.models.trainable import VAEWithDiscriminator
    from vae_trainer.models.vae_loading import build_vae

    vae = build_vae(pretrained_model_name_or_path=folder)
    model = VAEWithDiscriminator(vae, paddle.nn.Identity())
    model.train()
    pixels = paddle.to_tensor(x)
    with activation_inputs() as ranges:
        decoded, _, _ = model(pixels, sample_posterior=False)
    (decoded - pixels).pow(2).mean().backward()
    linear = {n + ".weight" for n, layer in vae.named_sublayers() if isinstance(layer, paddle.nn.Linear)}
    grads = {}
    for name, param in vae.named_parameters():
        if not param.stop_gradient:
            grad = np.zeros(param.shape, np.float32) if param.grad is None else param.grad.numpy()
            grads[name] = grad.T if name in linear else grad
    return decoded.numpy(), grads, ranges


# ---------------------------------------------------------------------------------------------------- activations


def test_paddles_silu_kernel_is_still_wrong():
    """When this fails, Paddle's SiLU kernel has a finite backward: delete vae_trainer/models/activations.py (and its
    call in vae_trainer/models/__init__.py)."""
    x = paddle.to_tensor([-100.0], stop_gradient=False)
    KERNEL_SILU(x).sum().backward()
    assert np.isnan(x.grad.numpy()).all()


@pytest.mark.parametrize("silu", ["functional", "layer", "ppdiffusers silu", "ppdiffusers swish", "input alias"])
def test_every_silu_has_pytorchs_values_and_gradient_at_extreme_inputs(silu):
    from ppdiffusers.models.activations import get_activation

    torch = import_test_extra("torch", reason="PyTorch's SiLU is the reference: pip install -r requirements-test.txt")
    call = {"functional": paddle.nn.functional.silu, "layer": paddle.nn.Silu(),
            "ppdiffusers silu": get_activation("silu"), "ppdiffusers swish": get_activation("swish"),
            "input alias": lambda x: paddle.nn.functional.silu(input=x)}[silu]
    x = np.array([-1000, -200, -100, -89, -88, -87, -20, -1, 0.5, 3, 88, 100, 1000], np.float32)
    ours = paddle.to_tensor(x, stop_gradient=False)
    out = call(ours)
    out.sum().backward()
    theirs = torch.from_numpy(x).requires_grad_()
    expected = torch.nn.functional.silu(theirs)
    expected.sum().backward()
    assert np.isfinite(ours.grad.numpy()).all()
    np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-6, atol=1e-30)
    assert ours.grad.numpy()[:4].tolist() == [0.0] * 4  # at and below -89: 0 (the kernel's: NaN)


def test_the_forward_is_the_kernels_within_one_ulp():
    x = paddle.to_tensor(np.random.default_rng(0).normal(0, 20, 100000).astype(np.float32))
    ours, kernels = paddle.nn.functional.silu(x).numpy(), KERNEL_SILU(x).numpy()
    assert np.all(np.abs(ours - kernels) <= np.spacing(np.abs(kernels)))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "relu6", "mish", "sigmoid", "leaky_relu",
                                        "tanh", "softplus"])
def test_other_activations_agree_with_pytorch_at_extreme_inputs(activation):
    """Values and gradients at +-88 ... +-1000 (0 left out: LeakyReLU's gradient there is 1 in Paddle, its slope in
    PyTorch, both valid). Paddle's softplus and mish compute log(1 + exp(x)) without log1p: up to ~8e-7 absolute off
    PyTorch's for x in (-20, -10), within the absolute tolerance."""
    torch = import_test_extra("torch", reason="PyTorch's activations are the reference")
    functional, torch_functional = paddle.nn.functional, torch.nn.functional
    ours, theirs = {
        "gelu": (functional.gelu, torch_functional.gelu),
        "gelu_tanh": (lambda x: functional.gelu(x, approximate=True),
                      lambda x: torch_functional.gelu(x, approximate="tanh")),
        "relu": (functional.relu, torch.relu), "relu6": (functional.relu6, torch_functional.relu6),
        "mish": (functional.mish, torch_functional.mish), "sigmoid": (functional.sigmoid, torch.sigmoid),
        "leaky_relu": (lambda x: functional.leaky_relu(x, 0.2), lambda x: torch_functional.leaky_relu(x, 0.2)),
        "tanh": (functional.tanh, torch.tanh), "softplus": (functional.softplus, torch_functional.softplus),
    }[activation]
    x = np.array([-1000, -200, -100, -89, -88, -50, -15, -3, -0.5, 0.5, 3, 15, 50, 88, 89, 100, 200, 1000], np.float32)
    a, b = paddle.to_tensor(x, stop_gradient=False), torch.from_numpy(x).requires_grad_()
    out, expected = ours(a), theirs(b)
    out.sum().backward()
    expected.sum().backward()
    assert np.isfinite(out.numpy()).all() and np.isfinite(a.grad.numpy()).all()
    np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- the families


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_of_every_trainable_weight_are_pytorchs(torch_side, name, state):
    """The trainer's reconstruction step: the output and the gradient of every trainable weight equal diffusers'
    (per tensor); stressed: activations really saw inputs beyond +-100, and still no non-finite gradient."""
    folder, result = torch_side[name, state]
    theirs = result()
    x = network_input(name)
    decoded, grads, ranges = paddle_step(folder, x if name.endswith("_clip") else x[:, :, 0] if x.ndim == 5 else x)
    if name in VIDEO_CONFIGS:
        theirs["train_decoded"] = theirs["train_decoded"][:, :, 0]  # one-frame clips
    if name.endswith("_clip"):  # every weight a clip reaches, the temporal ones too, has a gradient
        assert decoded.shape[2] == CLIP_FRAMES and all(np.abs(g).max() > 0 for g in grads.values())
    scale = float(np.abs(theirs["train_decoded"]).max())
    assert np.abs(decoded - theirs["train_decoded"]).max() <= 1e-4 * max(1.0, scale)
    worst, where = worst_relative_error(grads, {k[len("grad:"):]: v for k, v in theirs.items()
                                                if k.startswith("grad:")})
    print(f"{name} {state}: {len(grads)} weights, worst relative gradient error {worst:.2e} ({where}), "
          f"activation inputs {ranges}")
    if state == "stressed":  # the stress is real: below -89 Paddle's SiLU kernel gives NaN (RAE's decoder: GELUs)
        low, high = ranges["silu" if "silu" in ranges else "gelu"]
        assert low < -100 and high > 100, ranges


# ---------------------------------------------------------------------------------------------------- discriminator


def _patchgan_job(batch: DiffusersBatch, work, norm: str):
    from vae_trainer.models.discriminator import PatchDiscriminator

    work.mkdir()
    paddle.seed(7)
    disc = PatchDiscriminator(3, 8, 3, norm)
    np.savez(work / "weights.npz", **{k: v.numpy() for k, v in disc.state_dict().items()})
    np.save(work / "images.npy", images(4, seed=11))
    batch.command("patchgan", work / "weights.npz", "--images", work / "images.npy", "--out", work / "out.npz",
                  "--config", json.dumps({"num_layers": 3, "norm": norm}))
    return disc, lambda: dict(np.load(work / "out.npz"))


@pytest.mark.parametrize("norm", PATCHGAN_NORMS)
def test_patchgan_gradients_are_taming_nlayerdiscriminators(torch_side, norm):
    disc, result = torch_side["patchgan", norm]
    theirs = result()
    disc.train()
    x = paddle.to_tensor(images(4, seed=11), stop_gradient=False)
    logits = disc(x)
    logits.pow(2).mean().backward()
    np.testing.assert_allclose(logits.numpy(), theirs["logits"], rtol=0, atol=1e-5)
    ours = {name: p.grad.numpy() for name, p in disc.named_parameters() if not p.stop_gradient}
    ours["images"] = x.grad.numpy()
    worst, where = worst_relative_error(ours, {k[len("grad:"):]: v for k, v in theirs.items() if k.startswith("grad:")})
    print(f"patchgan {norm}: worst relative gradient error {worst:.2e} ({where})")


# ---------------------------------------------------------------------------------------------------- LPIPS


def _lpips_job(batch: DiffusersBatch, work):
    from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS

    if not os.path.isfile(DEFAULT_LPIPS_WEIGHTS):
        return None
    work.mkdir()
    model = LPIPS(DEFAULT_LPIPS_WEIGHTS)
    np.savez(work / "weights.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    x, y = images(2, seed=21), images(2, seed=22)
    np.save(work / "x.npy", x)
    np.save(work / "y.npy", y)
    batch.command("lpips", work / "weights.npz", "--images", work / "x.npy", "--targets", work / "y.npy",
                  "--out", work / "out.npz")
    return model, x, y, lambda: dict(np.load(work / "out.npz"))


def test_lpips_distance_and_its_gradient_are_lpips(torch_side):
    """The real LPIPS weights (make setup's)."""
    if torch_side["lpips"] is None:
        pytest.skip("no LPIPS weights: run `make setup`")
    model, x, y, result = torch_side["lpips"]
    theirs = result()
    ours = paddle.to_tensor(x, stop_gradient=False)
    distance = model(ours, paddle.to_tensor(y))
    distance.sum().backward()
    np.testing.assert_allclose(distance.numpy(), theirs["distances"], rtol=1e-5)
    worst, _ = worst_relative_error({"images": ours.grad.numpy()}, {"images": theirs["grad:images"]})
    print(f"lpips: relative gradient error {worst:.2e}")


# ---------------------------------------------------------------------------------------------------- end to end


def test_a_dc_ae_with_pre_activations_below_minus_89_fine_tunes_without_a_skipped_step(torch_side, photo_filelist,
                                                                                        tmp_path):
    """SANA-shaped (ResBlock stages then EfficientViT), norms scaled so that SiLU inputs go below -89: before
    activations.py each step's gradients were NaN, the step skipped (here the first stops the run)."""
    from vae_trainer.models.vae_loading import build_vae

    folder = torch_side["fine_tune"]
    vae = build_vae(pretrained_model_name_or_path=folder)
    vae.train()
    with activation_inputs() as ranges:
        vae(paddle.to_tensor(images(2, seed=5)))
    assert ranges["silu"][0] < -89, ranges  # the stress is real
    output_dir = tmp_path / "out"
    run_in_process(DRIVERS[1], trainer_args(
        photo_filelist, output_dir, pretrained_model_name_or_path=folder, max_steps=2, disc_start=100,
        gradient_accumulation_steps=1, use_ema=None, ema_decay=None, save_steps=100, perceptual_weight=0,
        learning_rate=1e-3, max_consecutive_nonfinite_steps=1))
    assert read_scalars(os.path.join(output_dir, "logs"), "train/skipped_steps") == {1: 0, 2: 0}
