"""Qwen-Image 2.1's VAE (vae_trainer/models/autoencoder_kl_qwenimage21.py) against diffusers 0.42.1's
AutoencoderKLQwenImage21, run in .venv-flux2 (tests/diffusers_side.py through tests/family_parity.py), and the RMS
norm's float32 normalisation of narrow floats (autoencoder_kl_wan.WanRMSNorm, which the port reuses).

One diffusers process does all the diffusers work (module-scoped, family_parity.DiffusersBatch): per config, a seeded
folder and a stressed one (the norms' scales x STRESS, so SiLU sees inputs far below -88); runs of both on a batch of
2 RGBA one-frame images with a training step (--train: gradients of every weight), the first also decoding loud
latents clamped and unclamped; our own perturbed weights saved for diffusers, run tiled (32 px) and untiled (16 px),
and through QwenImage21Pipeline's own latent normalisation. Everything else is Paddle in this process.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import inspect
import json
import os

import numpy as np
import pytest
from conftest import REPO, import_test_extra
from family_parity import DiffusersBatch, assert_loaded_exactly

CLASS = "AutoencoderKLQwenImage21"
ATOL = 1e-4
TILE, STRIDE = 16, 12
STRESS = 40.0
RELATIVE, ABSOLUTE = 1e-3, 1e-6  # gradients: ||ours - theirs|| <= RELATIVE ||theirs|| + ABSOLUTE max ||theirs||
STATS = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
CONFIGS = {
    # The published layout, narrow: residual stages, a wider decoder, one temporal stage, RGBA, factor 4.
    "residual": dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True], scale_factor_spatial=4, **STATS),
    # The other branches of the constructor: flat stages (Resample, UpBlock), an encoder attention, 2x2 patchify.
    "plain": dict(base_dim=8, decoder_base_dim=None, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[0.5],
                  temperal_downsample=[True, False], is_residual=False, patch_size=2, in_channels=16,
                  out_channels=16, scale_factor_spatial=8, **STATS),
}
# diffusers 0.42.1's encoder calls its down-block attention with cache arguments the attention's forward does not
# take (a TypeError for any attn_scales): the minimal fix-up, so that the attention math can be compared at all.
ATTENTION_PRELUDE = """
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21
block = autoencoder_kl_qwenimage21.QwenImage21AttentionBlock
def forward(self, x, *cache_args, _original=block.forward, **cache_kwargs):
    return _original(self, x)
block.forward = forward
"""


def rgba(count: int = 2, size: int = 32, seed: int = 0, frames: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (count, 4, frames, size, size)).astype(np.float32)


def loud_latents(config: dict, size: int = 32) -> np.ndarray:
    """Latents far from the prior: their decode leaves [-1, 1]."""
    side = size // config["scale_factor_spatial"]
    return (np.random.default_rng(7).standard_normal((1, config["z_dim"], 1, side, side)) * 6.0).astype(np.float32)


def our_vae(config: dict):
    from vae_trainer.models.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21(**config)


def ours_from_diffusers_folder(folder: str):
    """Our model from the folder's config, its safetensors converted by ppdiffusers: the key sets and shapes must be
    equal (returns the model and the converted state)."""
    import paddle
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
    from safetensors.numpy import load_file

    from vae_trainer.models.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21

    with open(os.path.join(folder, "config.json")) as handle:
        vae = AutoencoderKLQwenImage21.from_config(json.load(handle))
    state = convert_pytorch_state_dict_to_paddle(vae, load_file(os.path.join(folder,
                                                                           "diffusion_pytorch_model.safetensors")))
    assert {k: list(v.shape) for k, v in state.items()} == {k: list(v.shape) for k, v in vae.state_dict().items()}
    vae.set_state_dict({name: paddle.to_tensor(value) for name, value in state.items()})
    vae.eval()
    return vae, state


def in_channels(config: dict) -> int:
    """Channels of the images (before any patchify)."""
    return config.get("in_channels", 4) // (config.get("patch_size") or 1) ** 2


def run_ours(vae, named_inputs: dict, latents: np.ndarray | None = None) -> dict:
    """What diffusers_side.py's run writes, from our model."""
    import paddle

    out = {}
    with paddle.no_grad():
        for prefix, images in named_inputs.items():
            dist = vae.encode(paddle.to_tensor(images)).latent_dist
            out.update({prefix + "latent": dist.mode().numpy(), prefix + "mean": dist.mean.numpy(),
                        prefix + "logvar": dist.logvar.numpy(),
                        prefix + "decoded": vae.decode(dist.mode()).sample.numpy()})
        if latents is not None:
            out["decoded_latents"] = vae.decode(paddle.to_tensor(latents)).sample.numpy()
            out["decoded_latents_unclamped"] = vae.decode(paddle.to_tensor(latents), clamp=False).sample.numpy()
    return out


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


def perturbed_export(config: dict, folder) -> object:
    """Our model of `config`, seeded and moved off its initialisation, saved with to_diffusers=True into `folder`."""
    import paddle

    paddle.seed(11)
    vae = our_vae(config)
    with paddle.no_grad():
        for param in vae.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
    vae.eval()
    vae.save_pretrained(str(folder), to_diffusers=True)
    return vae


@pytest.fixture(scope="module")
def diffusers_results(tmp_path_factory) -> dict:
    """Every config's diffusers work, done by one diffusers process (module docstring)."""
    root = tmp_path_factory.mktemp("qwenimage21")
    prelude = root / "prelude.py"
    prelude.write_text(ATTENTION_PRELUDE)
    batch, results = DiffusersBatch(root), {}
    for k, (name, config) in enumerate(CONFIGS.items()):
        work = {part: root / name / part for part in ("run", "stressed_run", "export_run")}
        for folder in work.values():
            folder.mkdir(parents=True)
        images, latents = rgba(size=32, seed=k, count=2)[:, :in_channels(config)], loud_latents(config)
        found = dict(images=images, latents=latents)
        found["folder"] = batch.make(CLASS, root / name / "made", config, seed=3 + k)
        found["theirs"] = batch.run(CLASS, found["folder"], images, work["run"], latents=latents,
                                    flags=["--unclamped", "--train", "--prelude", str(prelude)])
        found["stressed_folder"] = batch.make(CLASS, root / name / "stressed", config, seed=3 + k, stress=STRESS)
        found["stressed_theirs"] = batch.run(CLASS, found["stressed_folder"], images, work["stressed_run"],
                                             flags=["--train"])
        found["exported"] = perturbed_export(config, root / name / "export")
        found["export_inputs"] = {"": images, "small_": rgba(size=16, seed=5)[:, :in_channels(config)]}
        found["export_theirs"] = batch.run(CLASS, root / name / "export", images, work["export_run"], latents=latents,
                                           tile=TILE, stride=STRIDE, more_images={"small": found["export_inputs"]
                                                                                  ["small_"]})
        np.save(root / name / "pipeline_images.npy", images[:, :, 0])
        batch.command("pipeline_encode", root / name / "export", "--config", json.dumps({"class": CLASS}),
                      "--images", root / name / "pipeline_images.npy", "--out", root / name / "pipeline_latents.npy")
        found["pipeline_latents"] = lambda path=root / name / "pipeline_latents.npy": np.load(path)
        results[name] = found
    batch.flush()
    return results


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, diffusers_results) -> dict:
    """One config: diffusers' outputs on its folder, and our model loaded from that folder, with its outputs."""
    name = request.param
    found = diffusers_results[name]
    vae, state = ours_from_diffusers_folder(found["folder"])
    return dict(name=name, config=CONFIGS[name], found=found, theirs=found["theirs"](), vae=vae, state=state,
                ours=run_ours(vae, {"": found["images"]}, found["latents"]))


# ---- diffusers -> ours

def test_diffusers_folder_loads_with_every_key_and_shape(case, tmp_path):
    """Every key and shape (ours_from_diffusers_folder); ppdiffusers' own from_diffusers=True load gives the same
    weights, and its save / load keeps them."""
    from safetensors.numpy import load_file

    from vae_trainer.models.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21

    folder = case["found"]["folder"]
    theirs = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    assert set(case["state"]) == set(theirs) == set(case["vae"].state_dict())
    assert_loaded_exactly(case["theirs"], CLASS)
    loaded = AutoencoderKLQwenImage21.from_pretrained(folder, from_diffusers=True)
    loaded.save_pretrained(str(tmp_path / "paddle"))
    again = AutoencoderKLQwenImage21.from_pretrained(str(tmp_path / "paddle"))
    for name, value in case["vae"].state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value.numpy(), err_msg=name)
        np.testing.assert_array_equal(again.state_dict()[name].numpy(), value.numpy(), err_msg=name)


def public(config) -> dict:
    """A config's entries without the bookkeeping ones (_name_or_path, versions)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def diffusers_init_defaults() -> dict:
    paths = glob.glob(os.path.join(REPO, ".venv-flux2", "lib", "python*", "site-packages", "diffusers", "models",
                                   "autoencoders", "autoencoder_kl_qwenimage21.py"))
    if not paths:
        pytest.skip("diffusers' sources are not in .venv-flux2")
    tree = ast.parse(open(paths[0]).read())
    init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == CLASS
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return dict(zip([arg.arg for arg in init.args.args[1:]], [ast.literal_eval(v) for v in init.args.defaults]))


def test_config_keys_and_defaults_are_diffusers(case):
    """Our constructor's parameters and defaults are diffusers 0.42.1's (read from its source, no torch), the 64
    latents_mean / latents_std values included; a diffusers folder's config is ours as loaded."""
    from vae_trainer.models.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21

    theirs = diffusers_init_defaults()
    signature = inspect.signature(AutoencoderKLQwenImage21.__init__)
    assert {name: p.default for name, p in signature.parameters.items() if name != "self"} == theirs
    assert len(theirs["latents_mean"]) == len(theirs["latents_std"]) == theirs["z_dim"] == 64
    with open(os.path.join(case["found"]["folder"], "config.json")) as handle:
        assert public(json.load(handle)) == public(case["vae"].config)


def test_posterior_and_decode_equal_diffusers(case):
    """A batch of 2 RGBA one-frame images (the patchified config folds them to 16 channels): mean, log-variance,
    mode and decode; 4-D images give the same, without the frame axis."""
    import paddle

    differences = assert_close(case["ours"], case["theirs"], ["mean", "logvar", "latent", "decoded"])
    print(case["name"], differences)
    assert case["ours"]["decoded"].shape == case["found"]["images"].shape
    vae, images = case["vae"], case["found"]["images"]
    with paddle.no_grad():
        dist = vae.encode(paddle.to_tensor(images[:, :, 0])).latent_dist
        decoded = vae.decode(dist.mode()).sample.numpy()
    assert dist.mean.ndim == 4 and decoded.shape == images[:, :, 0].shape
    np.testing.assert_array_equal(dist.mean.numpy(), case["ours"]["mean"][:, :, 0])
    np.testing.assert_array_equal(decoded, case["ours"]["decoded"][:, :, 0])
    vae.enable_slicing()  # one sample at a time: the same
    try:
        with paddle.no_grad():
            sliced = vae.encode(paddle.to_tensor(images)).latent_dist.mean
            np.testing.assert_allclose(vae.decode(sliced).sample.numpy(), case["ours"]["decoded"], rtol=0, atol=1e-6)
    finally:
        vae.disable_slicing()
    np.testing.assert_allclose(sliced.numpy(), case["ours"]["mean"], rtol=0, atol=1e-6)


def test_unclamped_decode_equals_diffusers_before_its_clamp(case):
    ours, theirs = case["ours"], case["theirs"]
    assert np.abs(theirs["decoded_latents_unclamped"]).max() > 1.1  # the latent does decode outside [-1, 1]
    print(case["name"], assert_close(ours, theirs, ["decoded_latents_unclamped", "decoded_latents"]))
    np.testing.assert_array_equal(ours["decoded_latents"], np.clip(ours["decoded_latents_unclamped"], -1, 1))


# ---- the backward, at ordinary and stressed activations

@contextlib.contextmanager
def silu_inputs():
    """Within: [min, max] of every input paddle.nn.functional.silu saw (the network's activations call it)."""
    import paddle

    original, seen = paddle.nn.functional.silu, [np.inf, -np.inf]

    def recording(x, *args, **kwargs):
        with paddle.no_grad():  # nothing saved for the backward: a recompute re-runs the forward unrecorded
            seen[:] = [min(seen[0], x.min().item()), max(seen[1], x.max().item())]
        return original(x, *args, **kwargs)

    paddle.nn.functional.silu = recording
    try:
        yield seen
    finally:
        paddle.nn.functional.silu = original


def training_step(vae, images: np.ndarray):
    """diffusers_side.py's --train step: train mode, posterior mode, unclamped decode, mean squared error, backward.
    Returns the decode, {name: gradient} (zeros where none reached) and the SiLU inputs' range."""
    import paddle

    vae.train()
    x = paddle.to_tensor(images)
    with silu_inputs() as seen:
        decoded = vae.decode(vae.encode(x).latent_dist.mode(), clamp=False).sample
    vae.clear_gradients(set_to_zero=False)
    (decoded - x).square().mean().backward()
    grads = {name: np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy()
             for name, p in vae.named_parameters()}
    vae.eval()
    return decoded.numpy(), grads, seen


def worst_relative_error(ours: dict, theirs: dict) -> tuple:
    """Every gradient finite and within RELATIVE of diffusers' (plus ABSOLUTE times the largest one's norm, for
    gradients that are 0 in exact arithmetic); returns the worst relative error and where."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:10]
    floor = ABSOLUTE * max(float(np.linalg.norm(t)) for t in theirs.values())
    worst, where, failures = 0.0, "", []
    for name, expected in theirs.items():
        assert ours[name].shape == expected.shape, name
        assert np.isfinite(ours[name]).all(), f"{name}: non-finite gradient"
        error, size = float(np.linalg.norm(ours[name] - expected)), float(np.linalg.norm(expected))
        if error > RELATIVE * size + floor:
            failures.append((name, error, size))
        if size > floor and error / size > worst:
            worst, where = error / size, name
    assert not failures, failures[:10]
    return worst, where


@pytest.mark.parametrize("state", ["ordinary", "stressed"])
def test_gradients_of_every_weight_equal_diffusers(case, state):
    """The output and the gradient of every weight equal diffusers' (per tensor); stressed: SiLU really saw inputs
    far below -88 (where Paddle's own SiLU kernel's backward is NaN), and no gradient is non-finite."""
    found = case["found"]
    if state == "ordinary":
        vae, theirs = case["vae"], case["theirs"]
    else:
        vae, _ = ours_from_diffusers_folder(found["stressed_folder"])
        theirs = found["stressed_theirs"]()
    decoded, grads, seen = training_step(vae, found["images"])
    scale = float(np.abs(theirs["train_decoded"]).max())
    assert np.abs(decoded - theirs["train_decoded"]).max() <= 1e-4 * max(1.0, scale)
    worst, where = worst_relative_error(grads, {k[len("grad:"):]: v for k, v in theirs.items()
                                                if k.startswith("grad:")})
    print(f"{case['name']} {state}: worst relative gradient error {worst:.2e} ({where}), SiLU inputs {seen}")
    if state == "stressed":
        assert seen[0] < -100 and seen[1] > 100, seen


# ---- ours -> diffusers, tiling, the pipeline's normalisation

def test_our_export_loads_in_diffusers_exactly_and_decodes_as_ours(case):
    """Our perturbed weights, saved with to_diffusers=True: diffusers loads them with no missing / unexpected /
    mismatched key and encodes and decodes as we do, untiled (16 px) and tiled (32 px, 16 px tiles, stride 12: a
    tiled decode is clamped in both); the config's latents_mean / latents_std are ours to the bit."""
    import paddle

    found = case["found"]
    vae, theirs = found["exported"], found["export_theirs"]()
    assert_loaded_exactly(theirs, CLASS)
    with open(os.path.join(os.path.dirname(found["folder"]), "export", "config.json")) as handle:
        written = json.load(handle)
    assert written["_class_name"] == CLASS
    for key in ("latents_mean", "latents_std"):
        assert written[key] == list(vae.config[key]) == STATS[key]
    vae.enable_tiling(TILE, TILE, STRIDE, STRIDE)
    try:
        ours = run_ours(vae, found["export_inputs"], found["latents"])
    finally:
        vae.disable_tiling()
    keys = [prefix + key for prefix in ("", "small_") for key in ("mean", "logvar", "decoded")] + ["decoded_latents"]
    print(case["name"], assert_close(ours, theirs, keys))
    assert np.abs(theirs["decoded_latents"]).max() <= 1.0
    with paddle.no_grad():  # tiling did happen: the tiled decode is not the untiled one
        untiled = vae.decode(paddle.to_tensor(found["latents"])).sample.numpy()
    assert np.abs(untiled - ours["decoded_latents"]).max() > 1e-3


def test_pipeline_normalises_the_posterior_mode_by_the_config(case):
    """QwenImage21Pipeline._encode_vae_image on our export: (mode - latents_mean) / latents_std per channel, the
    mode ours and the statistics read from the config we wrote."""
    import paddle

    found = case["found"]
    with paddle.no_grad():
        mode = found["exported"].encode(paddle.to_tensor(found["images"][:, :, 0])).latent_dist.mode().numpy()
    mean, std = (np.asarray(STATS[key], np.float32).reshape(1, -1, 1, 1) for key in ("latents_mean", "latents_std"))
    np.testing.assert_allclose(found["pipeline_latents"](), (mode - mean) / std, rtol=0, atol=ATOL)


# ---- recompute, frames, channels, the trainer's handles

def test_recompute_of_every_checkpoint_segment_gives_the_same_gradients(case):
    """Every block of checkpoint_segments() re-run in the backward (Paddle's non-reentrant recompute): the same
    gradients, and the same unreached weights."""
    from paddle.distributed.fleet.utils import recompute

    vae, images = case["vae"], case["found"]["images"]
    _, plain, _ = training_step(vae, images)
    segments = vae.checkpoint_segments()
    assert len(segments) == len(vae.encoder.down_blocks) + len(vae.decoder.up_blocks) + 2
    for _, block in segments:
        block.forward = (lambda forward: lambda *a, **k: recompute(forward, *a, use_reentrant=False, **k))(
            block.forward)
    try:
        _, again, _ = training_step(vae, images)
    finally:
        for _, block in segments:
            del block.forward
    for name in plain:
        np.testing.assert_allclose(again[name], plain[name], rtol=0, atol=1e-6, err_msg=name)


def test_one_frame_only_and_the_images_channels(case):
    """T = 1 or 4-D; any other frame count is refused (diffusers silently encodes 2-4 frames as the first alone);
    with in_channels 4 an RGB image is refused with the hint to add alpha."""
    import paddle

    vae, config = case["vae"], case["config"]
    channels = in_channels(config)
    for frames in (2, 5):
        with pytest.raises(ValueError, match="one-frame"):
            vae.encode(paddle.to_tensor(rgba(1, 16, frames=frames)[:, :channels]))
    side = 32 // config["scale_factor_spatial"]
    with pytest.raises(ValueError, match="one-frame"):
        vae.decode(paddle.zeros([1, config["z_dim"], 2, side, side]))
    if channels == 4:
        with pytest.raises(ValueError, match="alpha"):
            vae.encode(paddle.to_tensor(rgba(1, 16)[:, :3]))


def test_fine_tuning_handles(case):
    """The decoder's last layer makes the image, the encoder's the moments; the time_convs are the only weights a
    pass never reaches; a decode alone reaches every decoder-side weight but those and no encoder-side one."""
    import paddle

    vae, config = case["vae"], case["config"]
    assert vae.decoder_last_layer() is vae.decoder.conv_out.weight
    assert vae.decoder_last_layer().shape[:2] == [config.get("out_channels", 4), vae.decoder.conv_out.weight.shape[1]]
    assert vae.encoder_last_layer() is vae.quant_conv and vae.quant_conv.weight.shape[0] == 2 * config["z_dim"]
    assert [name for name, _ in vae.encoder_side_modules()] == ["encoder", "quant_conv"]
    unreached = {w.name for w in vae.video_only_weights()}
    assert unreached and all(".time_conv." in name for name in unreached)
    assert unreached == {name for name, _ in vae.named_parameters() if ".time_conv." in name}
    _, grads, _ = training_step(vae, case["found"]["images"])
    assert {name for name, grad in grads.items() if not np.any(grad)} == unreached
    encoder_side = {f"{prefix}.{name}" for prefix, layer in vae.encoder_side_modules()
                    for name, _ in layer.named_parameters()}
    z = paddle.to_tensor(loud_latents(config))
    vae.clear_gradients(set_to_zero=False)
    vae.decode(z, clamp=False).sample.square().mean().backward()
    untouched = {name for name, p in vae.named_parameters() if p.grad is None}
    assert untouched == encoder_side | {name for name in unreached if name.startswith("decoder.")}


# ---- RMS norms in float32 under half precision (autoencoder_kl_wan.WanRMSNorm, every norm of the port)

def torch_rms_norm(torch, x, gamma: np.ndarray, dtype: str, scale: float):
    """diffusers 0.42.1's WanRMS_norm / QwenImage21RMS_norm forward, in torch: normalise in float32, cast back,
    times scale and gamma (float32 parameters, as under autocast)."""
    normalized = torch.nn.functional.normalize(x.float(), dim=1).to(getattr(torch, dtype))
    return normalized * scale * torch.from_numpy(gamma)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_normalises_narrow_floats_in_float32(dtype):
    """Forward and backward of the norm on float16 / bfloat16 inputs with float32 parameters (AMP's case; Paddle's
    CPU autocast is a no-op, so the tensors are made half by hand) equal diffusers' float32-normalise-then-cast
    computation (torch); inputs of ~1000 over 64 channels, whose float16 sum of squares would overflow."""
    import paddle

    from vae_trainer.models.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21
    from vae_trainer.models.autoencoder_kl_wan import WanRMSNorm

    torch = import_test_extra("torch", reason="PyTorch runs diffusers' RMS norm formula")
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((2, 64, 1, 3, 3)) * 1000).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, (64, 1, 1, 1)).astype(np.float32)
    norm = WanRMSNorm(64, images=False)
    norm.gamma.set_value(paddle.to_tensor(gamma))
    x = paddle.to_tensor(values).astype(dtype)
    x.stop_gradient = False
    out = norm(x)
    weights = rng.standard_normal(values.shape).astype(np.float32)
    (out * paddle.to_tensor(weights)).sum().backward()

    exact = x.astype("float32").numpy()  # the half-precision input's values, exactly
    theirs_x = torch.from_numpy(exact).to(getattr(torch, dtype)).requires_grad_()
    theirs = torch_rms_norm(torch, theirs_x, gamma, dtype, norm.scale)
    (theirs * torch.from_numpy(weights)).sum().backward()
    assert out.dtype == paddle.float32 and theirs.dtype == torch.float32  # promoted by the float32 gamma, as torch's
    assert np.isfinite(out.numpy()).all()
    np.testing.assert_array_equal(out.numpy(), theirs.detach().numpy())
    ours_grad, theirs_grad = x.grad.astype("float32").numpy(), theirs_x.grad.float().numpy()
    assert x.grad.dtype == x.dtype and np.isfinite(ours_grad).all()
    np.testing.assert_allclose(ours_grad, theirs_grad, rtol=0, atol=2 * np.abs(theirs_grad).max() * 2.0 ** -8)
    # The float32 computation cast back, within the narrow type's rounding.
    unit = exact / np.linalg.norm(exact, axis=1, keepdims=True)
    np.testing.assert_allclose(out.numpy(), unit * norm.scale * gamma, rtol=2.0 ** -6, atol=0)
    # Every norm of the Qwen-Image 2.1 port is this layer.
    vae = our_vae(CONFIGS["residual"])
    norms = [layer for name, layer in vae.named_sublayers() if name.rsplit(".", 1)[-1].startswith("norm")]
    assert isinstance(vae, AutoencoderKLQwenImage21) and len(norms) > 10
    assert all(isinstance(layer, WanRMSNorm) for layer in norms)


def test_rms_norm_in_bfloat16_throughout():
    """A norm cast to bfloat16 (O2's case; Paddle's CPU has bfloat16 multiply but no bfloat16 p_norm): the output
    stays bfloat16 and equals torch's float32-normalise, cast, scale in bfloat16."""
    import paddle

    from vae_trainer.models.autoencoder_kl_wan import WanRMSNorm

    torch = import_test_extra("torch", reason="PyTorch runs diffusers' RMS norm formula")
    values = (np.random.default_rng(1).standard_normal((2, 16, 4, 4)) * 30).astype(np.float32)
    norm = WanRMSNorm(16)  # images=True: the attention's norm
    norm.to(dtype="bfloat16")
    x = paddle.to_tensor(values).astype("bfloat16")
    out = norm(x)
    assert out.dtype == paddle.bfloat16
    exact = torch.from_numpy(x.astype("float32").numpy()).bfloat16()
    theirs = torch.nn.functional.normalize(exact.float(), dim=1).bfloat16() * norm.scale * torch.ones(
        16, 1, 1, dtype=torch.bfloat16)
    np.testing.assert_array_equal(out.astype("float32").numpy(), theirs.float().numpy())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_unit_normalize_is_float32_cast_back(dtype):
    """The normalisation itself, for every narrow float diffusers upcasts (float8 too, whose scale and multiply
    Paddle's CPU lacks, so only this part runs here): float32's result cast to the input's dtype, bit for bit;
    float32 and float64 are normalised as they are."""
    import paddle

    from vae_trainer.models.autoencoder_kl_wan import unit_normalize

    values = (np.random.default_rng(2).standard_normal((2, 8, 1, 3, 3)) * 3).astype(np.float32)
    x = paddle.to_tensor(values).astype(dtype)
    unit = unit_normalize(x, axis=1)
    assert unit.dtype == x.dtype
    exact = x.astype("float32")
    expected = paddle.nn.functional.normalize(exact, axis=1).astype(dtype)
    np.testing.assert_array_equal(unit.astype("float32").numpy(), expected.astype("float32").numpy())
    for wide in ("float32", "float64"):
        wide_x = paddle.to_tensor(values).astype(wide)
        assert unit_normalize(wide_x, axis=1).dtype == wide_x.dtype
        np.testing.assert_allclose(unit_normalize(wide_x, axis=1).numpy(),
                                   values / np.linalg.norm(values, axis=1, keepdims=True), rtol=1e-6)
