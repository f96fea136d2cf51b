"""The causal 3D VAEs of Wan 2.1, Wan 2.2 (residual, patchified) and Qwen-Image (vae_trainer/models/autoencoder_kl_wan.py,
autoencoder_kl_qwenimage.py) against diffusers 0.42.1's AutoencoderKLWan / AutoencoderKLQwenImage, run in .venv-flux2
(tests/diffusers_side.py through tests/family_parity.py).

One diffusers process does every config's diffusers work (module-scoped, family_parity.DiffusersBatch): make a seeded
folder; run it on images (T = 1), clips of 5 and 9 frames and a latent that decodes outside [-1, 1] (also unclamped);
run our own perturbed weights, saved for diffusers, tiled (32 px inputs) and untiled (16 px ones). Everything else is
Paddle in this process.
"""

from __future__ import annotations

import ast
import glob
import inspect
import json
import os

import numpy as np
import pytest
from conftest import REPO
from family_parity import DiffusersBatch, assert_loaded_exactly

ATOL = 1e-4
TILE, STRIDE = 16, 12
STATS = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
CONFIGS = {
    # Wan 2.1: temporal downsampling in the first stage, attention in the encoder's second stage.
    "wan21": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                       attn_scales=[0.5], temperal_downsample=[True, False],
                                       scale_factor_temporal=2, scale_factor_spatial=4, **STATS)),
    # Wan 2.2's TI2V layout: residual stages, 2x2 patchify (12 channels in and out), a wider decoder.
    "wan22": ("AutoencoderKLWan", dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=2,
                                       temperal_downsample=[False, True], is_residual=True, patch_size=2,
                                       in_channels=12, out_channels=12, scale_factor_temporal=2,
                                       scale_factor_spatial=8, **STATS)),
    # Qwen-Image: both stages temporal (a clip of 9 frames is 3 latent frames).
    "qwen": ("AutoencoderKLQwenImage", dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                            temperal_downsample=[True, True], **STATS)),
}
# diffusers 0.42.1's encoders call their down-block attention with the cache arguments its forward does not take (a
# TypeError for any attn_scales); the minimal fix-up, so that the attention math can be compared at all.
ATTENTION_PRELUDE = """
from diffusers.models.autoencoders import autoencoder_kl_qwenimage, autoencoder_kl_wan
for block in (autoencoder_kl_wan.WanAttentionBlock, autoencoder_kl_qwenimage.QwenImageAttentionBlock):
    def forward(self, x, *cache_args, _original=block.forward, **cache_kwargs):
        return _original(self, x)
    block.forward = forward
"""
PREFIXES = ("", "clip5_", "clip9_")


def pixels(frames: int, count: int = 1, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + frames).uniform(-1, 1, (count, 3, frames, size, size)).astype(np.float32)


def inputs(size: int = 32) -> dict:
    return {"": pixels(1, count=2, size=size), "clip5_": pixels(5, size=size), "clip9_": pixels(9, size=size)}


def loud_latents(config: dict, latent_frames: int = 2, size: int = 32) -> np.ndarray:
    """Latents far from the prior: their decode leaves [-1, 1]."""
    ratio = config.get("scale_factor_spatial") or 2 ** len(config["temperal_downsample"])
    shape = (1, config["z_dim"], latent_frames, size // ratio, size // ratio)
    return (np.random.default_rng(7).standard_normal(shape) * 6.0).astype(np.float32)


def ours_from_diffusers_folder(class_name: str, folder: str):
    """Our model from the diffusers folder's config, its safetensors converted by ppdiffusers: key sets and shapes
    must be equal (returns the model and the converted state)."""
    import paddle
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as handle:
        config = json.load(handle)
    vae = our_class(class_name).from_config(config)
    state = convert_pytorch_state_dict_to_paddle(vae, load_file(os.path.join(folder,
                                                                           "diffusion_pytorch_model.safetensors")))
    ours = {name: list(value.shape) for name, value in vae.state_dict().items()}
    assert {name: list(value.shape) for name, value in state.items()} == ours
    vae.set_state_dict({name: paddle.to_tensor(value) for name, value in state.items()})
    vae.eval()
    return vae, state


def our_class(class_name: str):
    from vae_trainer.models.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from vae_trainer.models.autoencoder_kl_wan import AutoencoderKLWan

    return {"AutoencoderKLWan": AutoencoderKLWan, "AutoencoderKLQwenImage": AutoencoderKLQwenImage}[class_name]


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


def assert_close(ours: dict, theirs: dict, keys, atol: float = ATOL) -> None:
    differences = max_differences(ours, theirs, keys)
    assert max(differences.values()) <= atol, differences


def perturbed_export(class_name: str, config: dict, folder) -> object:
    """Our model of `config`, seeded and moved off its initialisation, saved with to_diffusers=True into `folder`."""
    import paddle

    paddle.seed(11)
    vae = our_class(class_name)(**config)
    with paddle.no_grad():
        for param in vae.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
    vae.eval()
    vae.save_pretrained(str(folder), to_diffusers=True)
    return vae


@pytest.fixture(scope="module")
def diffusers_results(tmp_path_factory) -> dict:
    """Every config's diffusers work, done by one diffusers process: make a seeded folder and run it on images,
    clips and loud latents (also unclamped); run our perturbed export of the config tiled on 32 px inputs and
    untiled on 16 px ones (no larger than a tile)."""
    root = tmp_path_factory.mktemp("wan_family")
    prelude = root / "prelude.py"
    prelude.write_text(ATTENTION_PRELUDE)
    batch, results = DiffusersBatch(root), {}
    for name, (class_name, config) in CONFIGS.items():
        work = {part: root / name / part for part in ("made", "run", "export", "export_run")}
        for folder in (work["run"], work["export_run"]):
            folder.mkdir(parents=True)
        named, latents = inputs(), loud_latents(config)
        folder = batch.make(class_name, work["made"], config, seed=3)
        theirs = batch.run(class_name, folder, named[""], work["run"], latents=latents,
                           more_images={"clip5": named["clip5_"], "clip9": named["clip9_"]},
                           flags=["--unclamped", "--prelude", str(prelude)])
        exported = perturbed_export(class_name, config, work["export"])
        export_inputs = {"": named[""], "clip5_": named["clip5_"], "small_": pixels(1, count=2, size=16, seed=5),
                         "small_clip5_": pixels(5, size=16, seed=5)}
        export_theirs = batch.run(class_name, work["export"], export_inputs[""], work["export_run"], latents=latents,
                                  tile=TILE, stride=STRIDE, flags=["--prelude", str(prelude)],
                                  more_images={key[:-1]: value for key, value in export_inputs.items() if key})
        results[name] = dict(folder=folder, named=named, latents=latents, theirs=theirs, exported=exported,
                             export_inputs=export_inputs, export_theirs=export_theirs)
    batch.flush()
    return results


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, diffusers_results) -> dict:
    """One config: diffusers' outputs on its folder, and our model loaded from that folder, with its outputs."""
    name = request.param
    class_name, config = CONFIGS[name]
    found = diffusers_results[name]
    vae, state = ours_from_diffusers_folder(class_name, found["folder"])
    return dict(name=name, class_name=class_name, config=config, folder=found["folder"], theirs=found["theirs"](),
                vae=vae, state=state, latents=found["latents"], ours=run_ours(vae, found["named"], found["latents"]))


@pytest.fixture(scope="module")
def exported(case, diffusers_results) -> dict:
    """Our perturbed export of the case's config, run by diffusers (tiled and untiled) and by us (tiled alike)."""
    found = diffusers_results[case["name"]]
    vae = found["exported"]
    vae.enable_tiling(TILE, TILE, STRIDE, STRIDE)
    return dict(vae=vae, theirs=found["export_theirs"](),
                ours=run_ours(vae, found["export_inputs"], found["latents"]))


# ---- (a) diffusers -> ours

def test_diffusers_folder_loads_with_every_key_and_shape(case):
    from safetensors.numpy import load_file

    theirs = load_file(os.path.join(case["folder"], "diffusion_pytorch_model.safetensors"))
    assert set(case["state"]) == set(theirs) == set(case["vae"].state_dict())
    assert_loaded_exactly(case["theirs"], case["class_name"])


def test_from_pretrained_from_diffusers_and_own_round_trip(case, tmp_path):
    """ppdiffusers' own loading of the diffusers folder gives the same weights; its save / load keeps them."""
    cls = our_class(case["class_name"])
    loaded = cls.from_pretrained(case["folder"], from_diffusers=True)
    loaded.save_pretrained(str(tmp_path / "paddle"))
    again = cls.from_pretrained(str(tmp_path / "paddle"))
    for name, value in case["vae"].state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value.numpy(), err_msg=name)
        np.testing.assert_array_equal(again.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    assert public(again.config) == public(loaded.config) == public(case["vae"].config)


def public(config) -> dict:
    """A config's entries without the bookkeeping ones (_name_or_path, versions)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def test_slicing_changes_nothing(case):
    import paddle

    vae, x = case["vae"], paddle.to_tensor(pixels(1, count=2))
    with paddle.no_grad():
        whole = vae.encode(x).latent_dist.mean
        vae.enable_slicing()
        try:
            sliced = vae.encode(x).latent_dist.mean
            np.testing.assert_allclose(vae.decode(sliced).sample.numpy(), vae.decode(whole).sample.numpy(),
                                       rtol=0, atol=1e-6)
        finally:
            vae.disable_slicing()
    np.testing.assert_allclose(sliced.numpy(), whole.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("prefix", PREFIXES, ids=["image_T1", "clip_T5", "clip_T9"])
def test_posterior_and_decode_equal_diffusers(case, prefix):
    keys = [prefix + key for key in ("mean", "logvar", "latent", "decoded")]
    assert_close(case["ours"], case["theirs"], keys)
    frames = case["ours"][prefix + "decoded"].shape[2]
    assert frames == {"": 1, "clip5_": 5, "clip9_": 9}[prefix]


def test_config_keys_and_defaults_are_diffusers(case):
    """Our constructor's parameters and defaults are diffusers 0.42.1's (read from its source, no torch)."""
    class_name = case["class_name"]
    theirs = diffusers_init_defaults(class_name)
    signature = inspect.signature(our_class(class_name).__init__)
    ours = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    assert ours == theirs
    with open(os.path.join(case["folder"], "config.json")) as handle:
        saved = public(json.load(handle))
    assert saved == public(case["vae"].config)


def diffusers_init_defaults(class_name: str) -> dict:
    module = {"AutoencoderKLWan": "autoencoder_kl_wan", "AutoencoderKLQwenImage": "autoencoder_kl_qwenimage"}
    paths = glob.glob(os.path.join(REPO, ".venv-flux2", "lib", "python*", "site-packages", "diffusers", "models",
                                   "autoencoders", module[class_name] + ".py"))
    if not paths:
        pytest.skip("diffusers' sources are not in .venv-flux2")
    tree = ast.parse(open(paths[0]).read())
    init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == class_name
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    names = [arg.arg for arg in init.args.args[1:]]
    defaults = [ast.literal_eval(value) for value in init.args.defaults]
    return dict(zip(names, defaults))


# ---- (c) the unclamped decode

def test_unclamped_decode_equals_diffusers_before_its_clamp(case):
    ours, theirs = case["ours"], case["theirs"]
    assert np.abs(theirs["decoded_latents_unclamped"]).max() > 1.5  # the latent does decode outside [-1, 1]
    assert_close(ours, theirs, ["decoded_latents_unclamped", "decoded_latents"])
    np.testing.assert_array_equal(ours["decoded_latents"], np.clip(ours["decoded_latents_unclamped"], -1, 1))


# ---- (b) ours -> diffusers, and (d) tiling

def test_our_weights_load_in_diffusers_exactly_and_match_untiled(case, exported):
    assert_loaded_exactly(exported["theirs"], case["class_name"])
    keys = [prefix + key for prefix in ("small_", "small_clip5_") for key in ("mean", "logvar", "decoded")]
    assert_close(exported["ours"], exported["theirs"], keys)


def test_tiled_encode_and_decode_equal_diffusers_tiled(case, exported):
    keys = [prefix + key for prefix in ("", "clip5_") for key in ("mean", "logvar", "decoded")] + ["decoded_latents"]
    assert_close(exported["ours"], exported["theirs"], keys)
    # diffusers' Qwen-Image does not clamp a tiled decode, Wan does; the loud latents tell them apart.
    out_of_range = np.abs(exported["theirs"]["decoded_latents"]).max() > 1.0
    assert out_of_range == (case["class_name"] == "AutoencoderKLQwenImage")


# ---- one frame: the stateless path, gradients, recompute

def test_one_frame_path_equals_the_cached_path(case):
    import paddle

    from vae_trainer.models.autoencoder_kl_wan import patchify

    vae = case["vae"]
    x = paddle.to_tensor(pixels(1, count=2))
    with paddle.no_grad():
        x = patchify(x, vae.patch_size)
        np.testing.assert_array_equal(vae.run_encoder(x).numpy(), vae.run_encoder(x, cached=True).numpy())
        z = vae.post_quant_conv(paddle.to_tensor(loud_latents(case["config"], latent_frames=1)))
        np.testing.assert_array_equal(vae.run_decoder(z).numpy(), vae.run_decoder(z, cached=True).numpy())


def one_frame_loss(vae, seed: int = 0):
    """A training-like loss on images (T = 1): sampled posterior, unclamped decode, reconstruction + KL."""
    import paddle

    paddle.seed(seed)
    x = paddle.to_tensor(pixels(1, count=2, seed=seed))
    posterior = vae.encode(x).latent_dist
    recon = vae.decode(posterior.sample(), clamp=False).sample
    return (recon - x).square().mean() + 1e-3 * posterior.kl().mean()


def gradients(vae, loss) -> dict:
    vae.clear_gradients(set_to_zero=False)
    loss.backward()
    return {name: None if p.grad is None else p.grad.numpy() for name, p in vae.named_parameters()}


def test_one_frame_gradients_finite_and_video_only_weights_untouched(case):
    vae = case["vae"]
    grads = gradients(vae, one_frame_loss(vae))
    video_only = vae.video_only_weights()
    whole = {w.name for w in video_only if w.taps is None}
    assert whole and {name for name, grad in grads.items() if grad is None} == whole
    for name, grad in grads.items():
        assert grad is None or np.isfinite(grad).all(), name
    taps = [w for w in video_only if w.taps is not None]
    assert len(taps) >= 6
    for weight in taps:
        assert not np.any(weight.part(grads[weight.name])), weight.name  # the earlier-frame taps: exactly zero
        assert np.abs(grads[weight.name][:, :, weight.taps:]).max() > 0, weight.name
    assert all(np.abs(grads[name]).max() > 0 for name in grads if name not in whole and name.endswith(".bias"))


def test_a_clip_backward_reaches_the_video_only_weights(case):
    """The same weights are live for video (T = 5): the list is of weights images do not reach, not of dead ones."""
    import paddle

    vae = case["vae"]
    x = paddle.to_tensor(pixels(5))
    posterior = vae.encode(x).latent_dist
    loss = (vae.decode(posterior.mode(), clamp=False).sample - x).square().mean()
    grads = gradients(vae, loss)
    for weight in vae.video_only_weights():
        assert grads[weight.name] is not None and np.isfinite(grads[weight.name]).all(), weight.name
        assert np.abs(weight.part(grads[weight.name])).max() > 0, weight.name


def test_one_frame_pass_may_be_recomputed_in_the_backward(case):
    """Every block re-run in the backward (Paddle's recompute) gives the same gradients: no state between calls."""
    from paddle.distributed.fleet.utils import recompute

    vae = case["vae"]
    plain = gradients(vae, one_frame_loss(vae, seed=1))
    segments = vae.checkpoint_segments()
    for _, block in segments:
        block.forward = (lambda forward: lambda *a, **k: recompute(forward, *a, use_reentrant=False, **k))(
            block.forward)
    try:
        again = gradients(vae, one_frame_loss(vae, seed=1))
    finally:
        for _, block in segments:
            del block.forward
    assert plain.keys() == again.keys()
    for name in plain:
        if plain[name] is None:
            assert again[name] is None, name
        else:
            np.testing.assert_allclose(again[name], plain[name], rtol=0, atol=1e-6, err_msg=name)


def test_fine_tuning_handles(case):
    """The decoder's last layer makes the (patchified) image, the encoder's the moments; a decode alone reaches no
    encoder-side weight and every decoder-side one (bar the video-only ones)."""
    import paddle

    vae, config = case["vae"], case["config"]
    assert vae.decoder_last_layer() is vae.decoder.conv_out.weight
    assert vae.decoder_last_layer().shape[0] == config.get("out_channels", config.get("input_channels", 3))
    assert vae.encoder_last_layer() is vae.quant_conv and vae.quant_conv.weight.shape[0] == 2 * config["z_dim"]
    assert [name for name, _ in vae.encoder_side_modules()] == ["encoder", "quant_conv"]
    encoder_side = {f"{prefix}.{name}" for prefix, layer in vae.encoder_side_modules()
                    for name, _ in layer.named_parameters()}
    assert encoder_side == {name for name, _ in vae.named_parameters() if name.startswith(("encoder.", "quant_conv."))}
    z = paddle.to_tensor(loud_latents(config, latent_frames=1))
    grads = gradients(vae, vae.decode(z, clamp=False).sample.square().mean())
    video_only = {w.name for w in vae.video_only_weights() if w.taps is None}
    assert {name for name, grad in grads.items() if grad is None} == encoder_side | {
        name for name in video_only if name.startswith("decoder.")}


def test_posterior_is_five_dimensional(case):
    import paddle

    vae = case["vae"]
    with paddle.no_grad():
        dist = vae.encode(paddle.to_tensor(pixels(5))).latent_dist
    latent_frames = case["ours"]["clip5_mean"].shape[2]
    assert dist.mean.shape == dist.logvar.shape == dist.std.shape == dist.var.shape == dist.sample().shape
    assert dist.mode().shape[:3] == [1, case["config"]["z_dim"], latent_frames]
    np.testing.assert_allclose(dist.var.numpy(), np.exp(dist.logvar.numpy()), rtol=1e-5)
    kl = dist.kl()
    assert kl.shape == [1]
    expected = 0.5 * (dist.mean.numpy() ** 2 + dist.var.numpy() - 1 - dist.logvar.numpy()).sum()
    np.testing.assert_allclose(kl.numpy(), [expected], rtol=1e-4)
