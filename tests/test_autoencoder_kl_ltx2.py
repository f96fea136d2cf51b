"""LTX-2's video VAE (vae_trainer/models/autoencoder_kl_ltx2.py) against diffusers 0.42.1's AutoencoderKLLTX2Video,
run in .venv-flux2 (tests/diffusers_side.py through tests/family_parity.py).

One diffusers process does all of this module's diffusers work (module-scoped, family_parity.DiffusersBatch): per
config, make a seeded folder (latents_mean / latents_std buffers set too) and run it on images (T = 1, batch 2),
9-frame clips (batch 2) and loud latents, with a training step on the images; a training step on clips; a stressed
copy's training steps; our own perturbed export run by diffusers; the LTX-2 image-to-video pipeline's latents.
Everything else is Paddle in this process.

The configs are the tiny one that runs (64 px -> 2x2 latents, 9 frames -> 2), three ways: "causal" (the
constructor's defaults: causal encoder and decoder, reflect-padded decoder), "noncausal" (the published LTX-2's
non-causal decoder, a reflect-padded encoder, a "conv" downsampler, a decoder stage of upsample factor 1 that
changes width, so that its conv_in resnet has norm3 / conv_shortcut, no residual in one upsampler) and
"conditioned" (timestep_conditioning and decoder_inject_noise; diffusers' noise draws and ours are made the same
function, NOISE_PRELUDE / matched_noise). Worst errors seen: forward 2.1e-5 (absolute, ATOL 1e-4), gradients
2.9e-5 relative (per tensor, RELATIVE 1e-3); stressed SiLU inputs reach about -285 / +320.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import inspect
import json
import os
from unittest import mock

import numpy as np
import pytest
from conftest import REPO
from family_parity import DiffusersBatch, assert_loaded_exactly

CLASS = "AutoencoderKLLTX2Video"
ATOL = 1e-4  # forward outputs, as the other ports' tests
RELATIVE, ABSOLUTE = 1e-3, 1e-6  # gradients, per tensor, as tests/test_gradients.py
SIZE, CLIP_FRAMES, TEMB = 64, 9, 0.05
STRESS = 100.0
TINY = dict(latent_channels=8, block_out_channels=[8, 16, 32, 64], decoder_block_out_channels=[8, 16, 32],
            layers_per_block=[1, 1, 1, 1, 1], decoder_layers_per_block=[1, 1, 1, 1])
CONFIGS = {
    "causal": dict(TINY),
    "noncausal": dict(TINY, block_out_channels=[8, 16, 32, 32],
                      downsample_type=["spatial", "temporal", "spatiotemporal", "conv"], decoder_causal=False,
                      decoder_block_out_channels=[8, 8, 32], upsample_factor=[2, 1, 2],
                      upsample_residual=[True, False, True],
                      encoder_spatial_padding_mode="reflect", spatial_compression_ratio=32,
                      temporal_compression_ratio=8),
    "conditioned": dict(TINY, timestep_conditioning=True, decoder_inject_noise=[True, False, True, False],
                        decoder_causal=False),
}
# The k-th noise draw of one decode, the same function on both sides (diffusers draws it with torch.randn).
NOISE_SEED = 1000
NOISE_PRELUDE = f"""
import numpy as np
import torch
from unittest import mock
from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

_forward = ltx2.LTX2VideoDecoder3d.forward

def forward(self, *args, **kwargs):
    draws = []
    def randn(*shape, generator=None, device=None, dtype=None, **_):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        draws.append(1)
        noise = np.random.default_rng({NOISE_SEED} + len(draws) - 1).standard_normal(shape).astype(np.float32)
        return torch.from_numpy(noise).to(dtype)
    with mock.patch.object(torch, "randn", randn):
        return _forward(self, *args, **kwargs)

ltx2.LTX2VideoDecoder3d.forward = forward
"""


def noise_draw(shape, k: int) -> np.ndarray:
    return np.random.default_rng(NOISE_SEED + k).standard_normal(tuple(shape)).astype(np.float32)


@contextlib.contextmanager
def matched_noise():
    """Within: our decoder's noise draws are NOISE_PRELUDE's, counted from 0 (one decode per context)."""
    import paddle

    from vae_trainer.models import autoencoder_kl_ltx2

    draws = []

    def spatial_noise(shape, dtype, generator=None):
        draws.append(1)
        return paddle.to_tensor(noise_draw(shape, len(draws) - 1)).astype(dtype)

    with mock.patch.object(autoencoder_kl_ltx2, "spatial_noise", spatial_noise):
        yield draws


def pixels(frames: int, count: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + frames).uniform(-1, 1, (count, 3, frames, SIZE, SIZE)).astype(np.float32)


def loud_latents(latent_frames: int = 2) -> np.ndarray:
    """Latents far from the prior: their decode leaves [-1, 1]."""
    shape = (1, TINY["latent_channels"], latent_frames, 2, 2)
    return (np.random.default_rng(7).standard_normal(shape) * 6.0).astype(np.float32)


def temb_for(name: str, batch: int):
    """The decode timestep a config needs (one per sample), as a Paddle tensor, or None."""
    import paddle

    return paddle.full([batch], TEMB, "float32") if CONFIGS[name].get("timestep_conditioning") else None


def run_flags(name: str, prelude) -> list:
    flags = ["--prelude", str(prelude)]
    return flags + (["--temb", str(TEMB)] if CONFIGS[name].get("timestep_conditioning") else [])


# ---------------------------------------------------------------------------------------------------- our side


def our_class():
    from vae_trainer.models.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video

    return AutoencoderKLLTX2Video


def ours_from_diffusers_folder(folder: str):
    """Our model from the folder's config, its safetensors converted by ppdiffusers: key sets and shapes must be
    equal (returns the model and the converted state)."""
    import paddle
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as handle:
        vae = our_class().from_config(json.load(handle))
    state = convert_pytorch_state_dict_to_paddle(vae, load_file(os.path.join(folder,
                                                                           "diffusion_pytorch_model.safetensors")))
    assert {k: list(v.shape) for k, v in state.items()} == {k: list(v.shape) for k, v in vae.state_dict().items()}
    vae.set_state_dict({name: paddle.to_tensor(value) for name, value in state.items()})
    vae.eval()
    return vae, state


def run_ours(vae, name: str, named_inputs: dict, latents: np.ndarray | None = None) -> dict:
    """What diffusers_side.py's run writes, from our model."""
    import paddle

    out = {}
    with paddle.no_grad():
        for prefix, images in named_inputs.items():
            dist = vae.encode(paddle.to_tensor(images)).latent_dist
            with matched_noise():
                decoded = vae.decode(dist.mode(), temb_for(name, len(images))).sample
            out.update({prefix + "latent": dist.mode().numpy(), prefix + "mean": dist.mean.numpy(),
                        prefix + "logvar": dist.logvar.numpy(), prefix + "decoded": decoded.numpy()})
        if latents is not None:
            with matched_noise():
                out["decoded_latents"] = vae.decode(paddle.to_tensor(latents), temb_for(name, 1)).sample.numpy()
            with matched_noise():
                out["decoded_latents_clamped"] = vae.decode(paddle.to_tensor(latents), temb_for(name, 1),
                                                            clamp=True).sample.numpy()
    return out


def train_step(vae, name: str, images: np.ndarray):
    """diffusers_side.py's --train on our model: train mode, the posterior's mode, decode (no clamp anywhere),
    loss mean((decoded - images) ** 2), backward. Returns (decoded, {name: gradient} in diffusers' layout)."""
    import paddle

    vae.train()
    vae.clear_gradients(set_to_zero=False)
    x = paddle.to_tensor(images)
    try:
        with matched_noise():
            decoded = vae.decode(vae.encode(x).latent_dist.mode(), temb_for(name, len(images))).sample
        (decoded - x).square().mean().backward()
    finally:
        vae.eval()
    linear = {n + ".weight" for n, layer in vae.named_sublayers() if isinstance(layer, paddle.nn.Linear)}
    grads = {}
    for key, param in vae.named_parameters():
        grad = np.zeros(param.shape, np.float32) if param.grad is None else param.grad.numpy()
        grads[key] = grad.T if key in linear else grad
    return decoded.numpy(), grads


def perturbed_export(config: dict, folder) -> object:
    """Our model of `config`, seeded, every weight and the latent statistics moved, saved with to_diffusers=True."""
    import paddle

    paddle.seed(11)
    vae = our_class()(**config)
    with paddle.no_grad():
        for param in vae.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
        vae.latents_mean.set_value(paddle.randn(vae.latents_mean.shape) * 0.5)
        vae.latents_std.set_value(paddle.rand(vae.latents_std.shape) + 0.5)
    vae.eval()
    vae.save_pretrained(str(folder), to_diffusers=True)
    return vae


# ---------------------------------------------------------------------------------------------------- comparisons


def max_differences(ours: dict, theirs: dict, keys) -> dict:
    differences = {}
    for key in keys:
        assert ours[key].shape == theirs[key].shape, (key, ours[key].shape, theirs[key].shape)
        differences[key] = float(np.abs(ours[key] - theirs[key]).max())
    return differences


def assert_close(ours: dict, theirs: dict, keys, atol: float = ATOL) -> dict:
    differences = max_differences(ours, theirs, keys)
    assert max(differences.values()) <= atol, differences
    return differences


def assert_within(ours: np.ndarray, theirs: np.ndarray, atol: float, what: str = "") -> None:
    """|ours - theirs| <= atol everywhere (numpy.testing's array compare is broken by ppdiffusers' np.bool)."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    worst = float(np.abs(ours - theirs).max())
    assert worst <= atol, (what, worst)


def worst_relative_error(ours: dict, theirs: dict) -> tuple:
    """Every gradient finite and within RELATIVE of diffusers' (plus ABSOLUTE times the largest norm, for those 0
    in exact arithmetic); returns the worst relative error among those above that floor, and its name."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:10]
    floor = ABSOLUTE * max(float(np.linalg.norm(t)) for t in theirs.values())
    worst, where, failures = 0.0, "", []
    for key, expected in theirs.items():
        got = ours[key]
        assert got.shape == expected.shape, (key, got.shape, expected.shape)
        assert np.isfinite(got).all(), f"{key}: non-finite gradient"
        error, size = float(np.linalg.norm(got - expected)), float(np.linalg.norm(expected))
        if error > RELATIVE * size + floor:
            failures.append((key, error, size))
        if size > floor and error / size > worst:
            worst, where = error / size, key
    assert not failures, failures[:10]
    return worst, where


@contextlib.contextmanager
def silu_inputs():
    """Within: [min, max] of every input paddle.nn.functional.silu saw (nn.Silu and ppdiffusers' swish call it)."""
    import paddle

    seen, original = [np.inf, -np.inf], paddle.nn.functional.silu

    def recording(x, *args, **kwargs):
        seen[0], seen[1] = min(seen[0], x.min().item()), max(seen[1], x.max().item())
        return original(x, *args, **kwargs)

    with mock.patch.object(paddle.nn.functional, "silu", recording):
        yield seen


# ---------------------------------------------------------------------------------------------------- fixtures


# (config, state, frames) of the backward comparisons; ordinary images ride on each config's main run.
GRADIENT_CASES = [(name, "ordinary", 1) for name in CONFIGS] + [
    ("causal", "ordinary", CLIP_FRAMES), ("noncausal", "ordinary", CLIP_FRAMES),
    ("conditioned", "ordinary", CLIP_FRAMES), ("conditioned", "stressed", 1), ("conditioned", "stressed", CLIP_FRAMES)]


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}-T{case[2]}"


@pytest.fixture(scope="module")
def diffusers_results(tmp_path_factory) -> dict:
    """All of this module's diffusers work, in one diffusers process (module docstring)."""
    root = tmp_path_factory.mktemp("ltx2")
    prelude = root / "noise_prelude.py"
    prelude.write_text(NOISE_PRELUDE)
    batch, results = DiffusersBatch(root), {"gradients": {}}

    def work(*parts):
        folder = root.joinpath(*parts)
        folder.mkdir(parents=True)
        return folder

    clips = pixels(CLIP_FRAMES)
    for name, config in CONFIGS.items():
        folder = batch.make(CLASS, root / name / "made", config, seed=3)
        theirs = batch.run(CLASS, folder, pixels(1), work(name, "run"), latents=loud_latents(),
                           more_images={"clip9": clips}, flags=run_flags(name, prelude) + ["--train"])
        exported = perturbed_export(config, root / name / "export")
        export_theirs = batch.run(CLASS, root / name / "export", pixels(1, seed=5), work(name, "export_run"),
                                  latents=loud_latents(), more_images={"clip9": pixels(CLIP_FRAMES, seed=5)},
                                  flags=run_flags(name, prelude) + ["--train"])
        results[name] = dict(folder=folder, theirs=theirs, exported=exported, export_theirs=export_theirs,
                             exported_folder=str(root / name / "export"))
        results["gradients"][name, "ordinary", 1] = folder, theirs
    stressed = batch.make(CLASS, root / "conditioned" / "stressed", CONFIGS["conditioned"], seed=4, stress=STRESS)
    for name, state, frames in GRADIENT_CASES:
        if frames == 1 and state == "ordinary":
            continue
        folder = stressed if state == "stressed" else results[name]["folder"]
        results["gradients"][name, state, frames] = folder, batch.run(
            CLASS, folder, pixels(frames, seed=9), work(name, f"{state}_T{frames}"),
            flags=run_flags(name, prelude) + ["--train"])
    pipeline_images = pixels(1, seed=13)[:, :, 0]
    np.save(root / "pipeline_images.npy", pipeline_images)
    batch.command("pipeline_encode", results["causal"]["folder"], "--config", json.dumps({"class": CLASS}),
                  "--images", root / "pipeline_images.npy", "--out", root / "pipeline_latents.npy")
    results["pipeline"] = pipeline_images, lambda: np.load(root / "pipeline_latents.npy")
    batch.flush()
    return results


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, diffusers_results) -> dict:
    """One config: diffusers' outputs on its folder, and our model loaded from that folder, with its outputs."""
    name = request.param
    found = diffusers_results[name]
    vae, state = ours_from_diffusers_folder(found["folder"])
    named = {"": pixels(1), "clip9_": pixels(CLIP_FRAMES)}
    return dict(name=name, config=CONFIGS[name], folder=found["folder"], theirs=found["theirs"](), vae=vae,
                state=state, ours=run_ours(vae, name, named, loud_latents()))


# ---------------------------------------------------------------------------------------------------- diffusers -> ours


def test_diffusers_folder_loads_with_every_key_and_shape(case):
    from safetensors.numpy import load_file

    theirs = load_file(os.path.join(case["folder"], "diffusion_pytorch_model.safetensors"))
    assert set(case["state"]) == set(theirs) == set(case["vae"].state_dict())
    assert {"latents_mean", "latents_std"} <= set(theirs)
    assert_loaded_exactly(case["theirs"], CLASS)


def test_latent_statistics_are_buffers_loaded_bit_exact(case):
    from safetensors.numpy import load_file

    theirs = load_file(os.path.join(case["folder"], "diffusion_pytorch_model.safetensors"))
    vae = case["vae"]
    for key in ("latents_mean", "latents_std"):
        buffer = getattr(vae, key)
        assert buffer.stop_gradient and key not in dict(vae.named_parameters())
        assert buffer.numpy().tobytes() == theirs[key].tobytes(), key
        assert buffer.numpy().tobytes() == case["theirs"][f"buffer:{key}"].tobytes(), key
    assert not np.allclose(theirs["latents_mean"], 0) and not np.allclose(theirs["latents_std"], 1)


def test_from_pretrained_from_diffusers_and_own_round_trip(case, tmp_path):
    """ppdiffusers' own loading of the diffusers folder gives the same weights (buffers too); its save / load keeps
    them bit for bit."""
    cls = our_class()
    loaded = cls.from_pretrained(case["folder"], from_diffusers=True)
    loaded.save_pretrained(str(tmp_path / "paddle"))
    again = cls.from_pretrained(str(tmp_path / "paddle"))
    for key, value in case["vae"].state_dict().items():
        assert loaded.state_dict()[key].numpy().tobytes() == value.numpy().tobytes(), key
        assert again.state_dict()[key].numpy().tobytes() == value.numpy().tobytes(), key
    assert public(again.config) == public(loaded.config) == public(case["vae"].config)


def public(config) -> dict:
    """A config's entries without the bookkeeping ones (_name_or_path, versions)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def test_config_keys_and_defaults_are_diffusers(case):
    """Our constructor's parameters and defaults are diffusers 0.42.1's (read from its source, no torch)."""
    signature = inspect.signature(our_class().__init__)
    ours = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    assert ours == diffusers_init_defaults()
    with open(os.path.join(case["folder"], "config.json")) as handle:
        saved = public(json.load(handle))
    assert saved == public(case["vae"].config)


def diffusers_init_defaults() -> dict:
    paths = glob.glob(os.path.join(REPO, ".venv-flux2", "lib", "python*", "site-packages", "diffusers", "models",
                                   "autoencoders", "autoencoder_kl_ltx2.py"))
    if not paths:
        pytest.skip("diffusers' sources are not in .venv-flux2")
    tree = ast.parse(open(paths[0]).read())
    init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == CLASS
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    names = [arg.arg for arg in init.args.args[1:]]
    return dict(zip(names, [ast.literal_eval(value) for value in init.args.defaults]))


@pytest.mark.parametrize("prefix", ["", "clip9_"], ids=["image_T1", "clip_T9"])
def test_posterior_and_decode_equal_diffusers(case, prefix):
    keys = [prefix + key for key in ("mean", "logvar", "latent", "decoded")]
    differences = assert_close(case["ours"], case["theirs"], keys)
    print(f"{case['name']} {prefix or 'image_'}: worst {max(differences.values()):.2e}")
    frames = case["ours"][prefix + "decoded"].shape[2]
    assert frames == (1 if prefix == "" else CLIP_FRAMES)
    assert case["ours"][prefix + "mean"].shape == (2, 8, 1 if prefix == "" else 2, 2, 2)


def test_decode_is_unclamped_as_diffusers(case):
    """diffusers' decode does not clamp (the loud latents decode outside [-1, 1] there); ours equals it, and
    clamp=True is the clip of it."""
    ours, theirs = case["ours"], case["theirs"]
    assert np.abs(theirs["decoded_latents"]).max() > 1.5
    assert_close(ours, theirs, ["decoded_latents"])
    np.testing.assert_array_equal(ours["decoded_latents_clamped"], np.clip(ours["decoded_latents"], -1, 1))


def test_the_image_to_video_pipeline_normalises_our_posterior_mode_as_normalize_latents(diffusers_results):
    """LTX2ImageToVideoPipeline's latents of an image: the posterior's mode, (z - latents_mean) / latents_std
    (scaling_factor 1.0); `normalize_latents` of our mode gives them, and `denormalize_latents` undoes it."""
    import paddle

    images, read = diffusers_results["pipeline"]
    vae, _ = ours_from_diffusers_folder(diffusers_results["causal"]["folder"])
    with paddle.no_grad():
        mode = vae.encode(paddle.to_tensor(images[:, :, None])).latent_dist.mode()
        ours = vae.normalize_latents(mode)
    theirs = read()
    assert ours.shape == list(theirs.shape)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(vae.denormalize_latents(ours).numpy(), mode.numpy(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("grad_case", GRADIENT_CASES, ids=case_id)
def test_gradients_of_every_trainable_weight_equal_diffusers(diffusers_results, grad_case):
    """diffusers_side.py's --train step: the decoded output and every parameter's gradient equal diffusers' (per
    tensor); stressed: SiLU inputs really went below -100 (Paddle's SiLU kernel gives NaN below -89)."""
    name, state, frames = grad_case
    folder, result = diffusers_results["gradients"][grad_case]
    theirs = result()
    vae, _ = ours_from_diffusers_folder(folder)
    images = pixels(1) if (state, frames) == ("ordinary", 1) else pixels(frames, seed=9)
    with silu_inputs() as seen:
        decoded, grads = train_step(vae, name, images)
    scale = max(1.0, float(np.abs(theirs["train_decoded"]).max()))
    assert np.abs(decoded - theirs["train_decoded"]).max() <= ATOL * scale
    worst, where = worst_relative_error(grads, {k[len("grad:"):]: v for k, v in theirs.items()
                                                if k.startswith("grad:")})
    print(f"{case_id(grad_case)}: {len(grads)} weights, worst relative gradient error {worst:.2e} ({where}), "
          f"SiLU inputs {seen}")
    assert all(np.abs(g).max() > 0 for g in grads.values())  # every weight is reached, clips or not
    if state == "stressed":
        assert seen[0] < -100 and seen[1] > 100, seen


# ---------------------------------------------------------------------------------------------------- ours -> diffusers


def test_our_export_loads_in_diffusers_exactly_and_decodes_as_ours(case, diffusers_results):
    """save_pretrained(to_diffusers=True): diffusers loads it with no missing / unexpected key, its latent
    statistics bit-exact, and its posterior and decode (images and clips) are ours (Linear weights transposed
    right: linear_2 of the time embedders is square, a wrong layout would still load)."""
    found = diffusers_results[case["name"]]
    vae, theirs = found["exported"], found["export_theirs"]()
    assert_loaded_exactly(theirs, CLASS)
    for key in ("latents_mean", "latents_std"):
        assert getattr(vae, key).numpy().tobytes() == theirs[f"buffer:{key}"].tobytes(), key
    ours = run_ours(vae, case["name"], {"": pixels(1, seed=5), "clip9_": pixels(CLIP_FRAMES, seed=5)},
                    loud_latents())
    keys = [prefix + key for prefix in ("", "clip9_") for key in ("mean", "logvar", "decoded")] + ["decoded_latents"]
    differences = assert_close(ours, theirs, keys)
    print(f"{case['name']} export: worst {max(differences.values()):.2e}")
    if case["config"].get("timestep_conditioning"):  # a 0-d parameter, 0-d in the file as in diffusers' own
        from safetensors.numpy import load_file

        saved = load_file(os.path.join(found["exported_folder"], "diffusion_pytorch_model.safetensors"))
        assert saved["decoder.timestep_scale_multiplier"].shape == ()
        assert saved["decoder.timestep_scale_multiplier"].item() == vae.decoder.timestep_scale_multiplier.item()


# ---------------------------------------------------------------------------------------------------- training hooks


def gradients(vae, loss) -> dict:
    vae.clear_gradients(set_to_zero=False)
    loss.backward()
    return {name: None if p.grad is None else p.grad.numpy() for name, p in vae.named_parameters()}


def recon_loss(vae, name: str, frames: int, seed: int = 1):
    """A training-like loss: sampled posterior (seeded), unclamped decode, reconstruction + KL."""
    import paddle

    paddle.seed(seed)
    x = paddle.to_tensor(pixels(frames, seed=seed))
    posterior = vae.encode(x).latent_dist
    with matched_noise():
        recon = vae.decode(posterior.sample(), temb_for(name, len(x))).sample
    return (recon - x).square().mean() + 1e-3 * posterior.kl().mean()


@pytest.mark.parametrize("frames", [1, CLIP_FRAMES], ids=["image_T1", "clip_T9"])
def test_checkpoint_segments_recomputed_give_the_same_gradients(case, frames):
    """Every segment re-run in the backward (Paddle's non-reentrant recompute) gives the same gradients."""
    from paddle.distributed.fleet.utils import recompute

    vae = case["vae"]
    plain = gradients(vae, recon_loss(vae, case["name"], frames))
    segments = vae.checkpoint_segments()
    for _, block in segments:
        block.forward = (lambda forward: lambda *a, **k: recompute(forward, *a, use_reentrant=False, **k))(
            block.forward)
    try:
        again = gradients(vae, recon_loss(vae, case["name"], frames))
    finally:
        for _, block in segments:
            del block.forward
    assert plain.keys() == again.keys()
    for key in plain:
        assert (plain[key] is None) == (again[key] is None), key
        if plain[key] is not None:
            assert_within(again[key], plain[key], 1e-6, key)


def test_checkpoint_segments_are_the_pure_blocks(case):
    vae = case["vae"]
    names = [name for name, _ in vae.checkpoint_segments()]
    expected = [f"encoder.down_blocks.{i}" for i in range(4)] + ["encoder.mid_block", "decoder.mid_block"] + [
        f"decoder.up_blocks.{i}" for i in range(3)]
    if case["name"] == "conditioned":  # decoder_inject_noise, listed encoder-side first, reversed: up_blocks 0, 2
        expected = [n for n in expected if n not in ("decoder.up_blocks.0", "decoder.up_blocks.2")]
    assert names == expected
    assert all(block is not vae.decoder.conv_out for _, block in vae.checkpoint_segments())


def test_fine_tuning_handles(case):
    """The decoder's last layer makes the patchified image; the encoder's the moments; a decode alone reaches every
    decoder-side weight and no encoder-side one."""
    import paddle

    vae = case["vae"]
    assert vae.decoder_last_layer() is vae.decoder.conv_out.conv.weight
    assert vae.decoder_last_layer().shape[0] == 3 * 4 * 4
    assert vae.encoder_last_layer() is vae.encoder.conv_out and vae.encoder.conv_out.out_channels == 8 + 1
    assert [name for name, _ in vae.encoder_side_modules()] == ["encoder"]
    encoder_side = {f"encoder.{name}" for name, _ in vae.encoder.named_parameters()}
    assert encoder_side == {name for name, _ in vae.named_parameters() if name.startswith("encoder.")}
    with matched_noise():
        loss = vae.decode(paddle.to_tensor(loud_latents(1)), temb_for(case["name"], 1)).sample.square().mean()
    grads = gradients(vae, loss)
    assert {name for name, grad in grads.items() if grad is None} == encoder_side


def test_the_posterior(case):
    """mean / logvar / var / std / mode() / sample() on 5-D latents; logvar is one channel repeated; kl sums over
    every non-batch axis."""
    import paddle

    vae = case["vae"]
    with paddle.no_grad():
        dist = vae.encode(paddle.to_tensor(pixels(CLIP_FRAMES))).latent_dist
    assert dist.mean.shape == dist.logvar.shape == dist.std.shape == dist.var.shape == dist.sample().shape
    assert dist.mode().shape == [2, 8, 2, 2, 2]
    logvar = dist.logvar.numpy()
    np.testing.assert_array_equal(logvar, np.broadcast_to(logvar[:, :1], logvar.shape))
    np.testing.assert_allclose(dist.var.numpy(), np.exp(logvar), rtol=1e-5)
    np.testing.assert_allclose(dist.std.numpy(), np.exp(0.5 * logvar), rtol=1e-5)
    expected = 0.5 * (dist.mean.numpy() ** 2 + dist.var.numpy() - 1 - logvar).reshape(2, -1).sum(axis=1)
    np.testing.assert_allclose(dist.kl().numpy(), expected, rtol=1e-4)


def test_slicing_changes_nothing(case):
    """One sample at a time (each with its own timestep): the same posterior, and the decode of each sample as
    decoded alone (a noise-injecting decoder draws anew for each slice, as diffusers'); without noise, the batch's."""
    import paddle

    vae, name = case["vae"], case["name"]
    x = paddle.to_tensor(pixels(1))
    with paddle.no_grad():
        whole = vae.encode(x).latent_dist.mean
        with matched_noise():
            decoded = vae.decode(whole, temb_for(name, 2)).sample
        vae.enable_slicing()
        try:
            sliced = vae.encode(x).latent_dist.mean
            with matched_noise() as draws:
                sliced_decoded = vae.decode(sliced, temb_for(name, 2)).sample
        finally:
            vae.disable_slicing()
        with matched_noise():
            first = vae.decode(sliced[:1], temb_for(name, 1)).sample
    assert_within(sliced.numpy(), whole.numpy(), 1e-5)  # batch 1 against 2: sums in another order
    assert_within(sliced_decoded[:1].numpy(), first.numpy(), 0.0)
    if not draws:
        assert_within(sliced_decoded.numpy(), decoded.numpy(), 1e-5)


# ---------------------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_a_one_frame_conv_is_the_3d_conv(causal, mode):
    """The 2D path of a one-frame input equals the 3D conv over the frame repeated (forward and weight gradient)."""
    import paddle

    from vae_trainer.models.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d

    paddle.seed(0)
    conv = LTX2VideoCausalConv3d(4, 6, 3, stride=(2, 2, 2) if causal else 1, spatial_padding_mode=mode)
    x = paddle.randn([2, 4, 1, 8, 8])
    fast = conv(x, causal=causal)
    fast.square().sum().backward()
    fast_grad = conv.conv.weight.grad.numpy().copy()
    conv.clear_gradients()
    full = conv.conv(conv._pad_space(conv._pad_time(x, causal)))
    full.square().sum().backward()
    np.testing.assert_allclose(fast.numpy(), full.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(fast_grad, conv.conv.weight.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_frames_and_sizes():
    """1 + 8k frames and sides that are multiples of 32 (the published layout); clear errors otherwise; diffusers'
    compression ratios kept as it computes them."""
    vae = our_class()(**CONFIGS["causal"])
    assert vae.latent_shape(1, 64, 64) == (1, 2, 2) and vae.latent_shape(17, 96, 32) == (3, 3, 1)
    assert (vae.spatial_downsample_factor(), vae.temporal_downsample_factor()) == (32, 8)
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (64, 16)  # diffusers' formula
    for shape in [(5, 64, 64), (8, 64, 64), (9, 48, 64), (1, 64, 66)]:
        with pytest.raises(ValueError, match="AutoencoderKLLTX2Video"):
            vae.latent_shape(*shape)
    with pytest.raises(NotImplementedError, match="tiled"):
        vae.enable_tiling()
    other = our_class()(**CONFIGS["noncausal"])
    assert (other.spatial_compression_ratio, other.temporal_compression_ratio) == (32, 8)
    assert other.latent_shape(9, 64, 64) == (2, 2, 2)


def test_the_timestep_is_needed_exactly_with_timestep_conditioning(case):
    """Conditioned: decode without a timestep is a clear error; otherwise a timestep is ignored, as in diffusers."""
    import paddle

    vae, z = case["vae"], paddle.to_tensor(loud_latents(1))
    if case["config"].get("timestep_conditioning"):
        with pytest.raises(ValueError, match="timestep"):
            vae.decode(z)
        return
    with paddle.no_grad():
        assert_within(vae.decode(z, paddle.full([1], 0.5)).sample.numpy(), vae.decode(z).sample.numpy(), 0.0)


def test_half_precision_norms_run_in_float32():
    """The per-pixel RMS norm of float16 values whose squares overflow float16 (|x| > 256): finite, as float32."""
    import paddle

    from vae_trainer.models.autoencoder_kl_ltx2 import ChannelLayerNorm, PerChannelRMSNorm

    x = paddle.to_tensor(np.random.default_rng(0).uniform(-1000, 1000, (1, 4, 1, 2, 2)).astype(np.float32))
    half = PerChannelRMSNorm()(x.astype("float16"))
    assert half.dtype == paddle.float16
    np.testing.assert_allclose(half.astype("float32").numpy(), PerChannelRMSNorm()(x).numpy(), rtol=2e-3)
    norm = ChannelLayerNorm(4)
    out = norm(x.astype("float16"))
    assert out.dtype == paddle.float16 and np.isfinite(out.astype("float32").numpy()).all()
