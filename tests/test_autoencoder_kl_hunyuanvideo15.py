"""HunyuanVideo 1.5's causal 3D VAE (vae_trainer/models/autoencoder_kl_hunyuanvideo15.py) against diffusers 0.42.1's
AutoencoderKLHunyuanVideo15, run in .venv-flux2 (tests/diffusers_side.py through tests/family_parity.py).

One diffusers process does all of this module's diffusers work (the module fixture `diffusers_results`,
family_parity.DiffusersBatch): make seeded folders of two tiny configs (the published channel matching, and the
unmatched one that has conv_shortcuts) and a stressed copy (norm scales x STRESS: SiLU inputs far below -88); run
them on images (T = 1) and 5-frame clips, each sample on its own (diffusers' mid-block attention fails on a batch
above 1), on latents that decode outside [-1, 1], and one training step (`--train`: posterior mode, decode,
mean squared error, backward) on images and on clips; run our own perturbed export, untiled and tiled. Everything
else is Paddle in this process. Inputs are 32 x 48 px (2 x 3 latents): a swap of H and W shows.
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

CLASS = "AutoencoderKLHunyuanVideo15"
ATOL = 1e-4  # forward outputs, times max(1, the output's scale)
RELATIVE, ABSOLUTE = 1e-4, 1e-6  # gradients, per tensor (worst_relative_error)
STRESS = 40.0
HEIGHT, WIDTH = 32, 48
# 5 blocks for f16 (4 spatial stages, the last 2 temporal); 64 = 2 x 32 latent channels at the bottom.
TINY = dict(block_out_channels=[8, 16, 32, 64, 64], layers_per_block=1)
CONFIGS = {"matched": TINY,
           "unmatched": dict(TINY, downsample_match_channel=False, upsample_match_channel=False)}
TILE, TILE_LATENT, TILED_SIZE = 64, 4, 96  # diffusers' enable_tiling(64, 64, 4, 4) on 96 px: 2 x 2 tiles
INPUTS = ("image", "clip", "image_b", "clip_b")  # a, then b: the batch of two is [a, b]


def pixels(frames: int, seed: int, size: tuple = (HEIGHT, WIDTH)) -> np.ndarray:
    return np.random.default_rng(seed + 17 * frames).uniform(-1, 1, (1, 3, frames, *size)).astype(np.float32)


def named_inputs() -> dict:
    return {"image": pixels(1, 0), "clip": pixels(5, 0), "image_b": pixels(1, 1), "clip_b": pixels(5, 1)}


def loud_latents(frames: int = 2, size: tuple = (HEIGHT // 16, WIDTH // 16)) -> np.ndarray:
    """Latents far from the prior: their decode leaves [-1, 1]."""
    return (np.random.default_rng(7).standard_normal((1, 32, frames, *size)) * 6.0).astype(np.float32)


def our_class():
    from vae_trainer.models.autoencoder_kl_hunyuanvideo15 import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15


def ours_from_diffusers_folder(folder: str):
    """Our model from the diffusers folder's config, its safetensors converted by ppdiffusers: key sets and shapes
    must be equal (returns the model and the converted state)."""
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


def run_ours(vae, inputs: dict, latents: np.ndarray | None = None) -> dict:
    """What diffusers_side.py's run writes (prefixed keys as its --more inputs), from our model."""
    import paddle

    out = {}
    with paddle.no_grad():
        for prefix, x in inputs.items():
            dist = vae.encode(paddle.to_tensor(x)).latent_dist
            decoded = vae.decode(dist.mode()).sample
            out.update({prefix + "latent": dist.mode().numpy(), prefix + "mean": dist.mean.numpy(),
                        prefix + "logvar": dist.logvar.numpy(), prefix + "decoded": decoded.numpy()})
        if latents is not None:
            out["decoded_latents"] = vae.decode(paddle.to_tensor(latents)).sample.numpy()
            out["decoded_latents_clamped"] = vae.decode(paddle.to_tensor(latents), clamp=True).sample.numpy()
    return out


def as_diffusers_keys(inputs: dict) -> dict:
    """run's first input has no prefix, the --more ones are "NAME_"."""
    first, *more = inputs
    return {"": inputs[first], **{name + "_": inputs[name] for name in more}}


def max_differences(ours: dict, theirs: dict, keys) -> dict:
    differences = {}
    for key in keys:
        assert ours[key].shape == theirs[key].shape, (key, ours[key].shape, theirs[key].shape)
        differences[key] = float(np.abs(ours[key] - theirs[key]).max()) / max(1.0, float(np.abs(theirs[key]).max()))
    return differences


def assert_close(ours: dict, theirs: dict, keys, atol: float = ATOL) -> dict:
    differences = max_differences(ours, theirs, keys)
    assert max(differences.values()) <= atol, differences
    return differences


def worst_relative_error(ours: dict, theirs: dict) -> tuple:
    """Every tensor finite and ||ours - theirs|| <= RELATIVE ||theirs|| + ABSOLUTE x the largest ||theirs|| (that
    floor for gradients 0 in exact arithmetic, as the key bias's under softmax); returns the worst relative error
    among tensors above the floor, and its name."""
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))[:10]
    floor = ABSOLUTE * max(float(np.linalg.norm(t)) for t in theirs.values())
    worst, worst_name, failures = 0.0, "", []
    for name, expected in theirs.items():
        got = ours[name]
        assert got.shape == expected.shape, (name, got.shape, expected.shape)
        assert np.isfinite(got).all(), f"{name}: non-finite gradient"
        error, size = float(np.linalg.norm(got - expected)), float(np.linalg.norm(expected))
        if error > RELATIVE * size + floor:
            failures.append((name, error, size))
        if size > floor and error / size > worst:
            worst, worst_name = error / size, name
    assert not failures, failures[:10]
    return worst, worst_name


def perturbed_export(config: dict, folder) -> object:
    """Our model of `config`, seeded and moved off its initialisation, saved with to_diffusers=True into `folder`."""
    import paddle

    paddle.seed(11)
    vae = our_class()(**config)
    with paddle.no_grad():
        for param in vae.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
    vae.eval()
    vae.save_pretrained(str(folder), to_diffusers=True)
    return vae


@pytest.fixture(scope="module")
def diffusers_results(tmp_path_factory) -> dict:
    """All diffusers work of this module, in one diffusers process (module docstring)."""
    root = tmp_path_factory.mktemp("hunyuan15")
    batch, found = DiffusersBatch(root), {"inputs": named_inputs(), "latents": loud_latents()}

    def run(name: str, folder, inputs: dict, **kwargs):
        (root / name).mkdir()
        first, *more = inputs
        return batch.run(CLASS, folder, inputs[first], root / name, more_images={k: inputs[k] for k in more},
                         **kwargs)

    for k, (name, config) in enumerate(CONFIGS.items()):
        folder = batch.make(CLASS, root / f"{name}_made", config, seed=3 + k)
        found[name] = folder, run(f"{name}_run", folder, found["inputs"], latents=found["latents"],
                                  flags=["--train"])
    stressed = batch.make(CLASS, root / "stressed_made", TINY, seed=5, stress=STRESS)
    found["train", "ordinary", "image"] = found["matched"]
    found["train", "ordinary", "clip"] = found["matched"][0], run(
        "ordinary_clip", found["matched"][0], {"clip": found["inputs"]["clip"]}, flags=["--train"])
    for kind in ("image", "clip"):
        found["train", "stressed", kind] = stressed, run(f"stressed_{kind}", stressed, {kind: found["inputs"][kind]},
                                                         flags=["--train"])
    exported = perturbed_export(TINY, root / "export")
    found["export"] = exported, run("export_run", root / "export", {"image": found["inputs"]["image"],
                                                                     "clip": found["inputs"]["clip"]},
                                    latents=found["latents"])
    tiled_inputs = {"image": pixels(1, 2, (TILED_SIZE, TILED_SIZE))}
    tiled_latents = loud_latents(frames=1, size=(TILED_SIZE // 16, TILED_SIZE // 16))
    found["tiled"] = tiled_inputs, tiled_latents, run("export_tiled", root / "export", tiled_inputs,
                                                      latents=tiled_latents, tile=TILE, stride=TILE_LATENT)
    batch.flush()
    return found


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, diffusers_results) -> dict:
    """One config: diffusers' outputs on its folder, and our model loaded from that folder, with its outputs."""
    folder, theirs = diffusers_results[request.param]
    vae, state = ours_from_diffusers_folder(folder)
    inputs = diffusers_results["inputs"]
    return dict(name=request.param, config=CONFIGS[request.param], folder=folder, theirs=theirs(), vae=vae,
                state=state, ours=run_ours(vae, as_diffusers_keys(inputs), diffusers_results["latents"]))


@pytest.fixture(scope="module")
def matched(diffusers_results) -> dict:
    folder, theirs = diffusers_results["matched"]
    vae, _ = ours_from_diffusers_folder(folder)
    return dict(folder=folder, vae=vae, theirs=theirs())


# ---- diffusers -> ours: weights, config, outputs

def test_diffusers_folder_loads_with_every_key_and_shape(case):
    from safetensors.numpy import load_file

    theirs = load_file(os.path.join(case["folder"], "diffusion_pytorch_model.safetensors"))
    assert set(case["state"]) == set(theirs) == set(case["vae"].state_dict())
    assert all(list(case["state"][name].shape) == list(theirs[name].shape) for name in theirs)
    assert_loaded_exactly(case["theirs"], CLASS)
    has_shortcut = any(".conv_shortcut." in name for name in theirs)
    assert has_shortcut == (case["name"] == "unmatched")  # only unmatched channels give resnets a conv_shortcut


def test_from_pretrained_from_diffusers_and_own_round_trip(matched, tmp_path):
    """ppdiffusers' own loading of the diffusers folder gives the same weights; its save / load keeps them."""
    cls = our_class()
    loaded = cls.from_pretrained(matched["folder"], from_diffusers=True)
    loaded.save_pretrained(str(tmp_path / "paddle"))
    again = cls.from_pretrained(str(tmp_path / "paddle"))
    for name, value in matched["vae"].state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value.numpy(), err_msg=name)
        np.testing.assert_array_equal(again.state_dict()[name].numpy(), value.numpy(), err_msg=name)
    assert public(again.config) == public(loaded.config) == public(matched["vae"].config)


def public(config) -> dict:
    """A config's entries without the bookkeeping ones (_name_or_path, versions)."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def diffusers_init_defaults() -> dict:
    paths = glob.glob(os.path.join(REPO, ".venv-flux2", "lib", "python*", "site-packages", "diffusers", "models",
                                   "autoencoders", "autoencoder_kl_hunyuanvideo15.py"))
    if not paths:
        pytest.skip("diffusers' sources are not in .venv-flux2")
    tree = ast.parse(open(paths[0]).read())
    init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == CLASS
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    names = [arg.arg for arg in init.args.args[1:]]
    return dict(zip(names, [ast.literal_eval(value) for value in init.args.defaults]))


def test_config_keys_and_defaults_are_diffusers(case):
    """Our constructor's parameters and defaults are diffusers 0.42.1's (read from its source, no torch), and the
    config diffusers saved is ours."""
    theirs = diffusers_init_defaults()
    signature = inspect.signature(our_class().__init__)
    assert {name: p.default for name, p in signature.parameters.items() if name != "self"} == theirs
    assert theirs["latent_channels"] == 32 and theirs["spatial_compression_ratio"] == 16
    assert theirs["temporal_compression_ratio"] == 4 and "scaling_factor" in theirs
    with open(os.path.join(case["folder"], "config.json")) as handle:
        assert public(json.load(handle)) == public(case["vae"].config)


@pytest.mark.parametrize("prefix", ["", "clip_"], ids=["image_T1", "clip_T5"])
def test_posterior_and_decode_equal_diffusers(case, prefix):
    keys = [prefix + key for key in ("mean", "logvar", "latent", "decoded")]
    differences = assert_close(case["ours"], case["theirs"], keys)
    print(case["name"], prefix or "image_", differences)
    frames = 1 if prefix == "" else 5
    assert case["ours"][prefix + "mean"].shape == (1, 32, 1 + (frames - 1) // 4, HEIGHT // 16, WIDTH // 16)
    assert case["ours"][prefix + "decoded"].shape == (1, 3, frames, HEIGHT, WIDTH)


def test_decode_is_unclamped_as_diffusers(case):
    """diffusers' decode clamps nothing: ours neither; clamp=True is ours clipped to [-1, 1]."""
    ours, theirs = case["ours"], case["theirs"]
    assert np.abs(theirs["decoded_latents"]).max() > 1.5  # the latents do decode outside [-1, 1]
    assert_close(ours, theirs, ["decoded_latents"])
    np.testing.assert_array_equal(ours["decoded_latents_clamped"], np.clip(ours["decoded_latents"], -1, 1))


def test_batch_of_two_equals_two_batches_of_one(case):
    """diffusers 0.42.1 cannot run a batch above 1 (its attention mask does not broadcast); ours takes [a, b] and
    gives each what a batch of one gives, ours and diffusers'."""
    import paddle

    vae, inputs = case["vae"], named_inputs()
    for kind in ("image", "clip"):
        both = paddle.to_tensor(np.concatenate([inputs[kind], inputs[kind + "_b"]]))
        with paddle.no_grad():
            dist = vae.encode(both).latent_dist
            decoded = vae.decode(dist.mode()).sample.numpy()
        together = {"mean": dist.mean.numpy(), "logvar": dist.logvar.numpy(), "decoded": decoded}
        for k, name in enumerate((kind, kind + "_b")):
            prefix = "" if name == "image" else name + "_"
            alone = {key: case["ours"][prefix + key] for key in together}
            for key, value in together.items():
                np.testing.assert_allclose(value[k:k + 1], alone[key], rtol=0, atol=1e-5, err_msg=f"{name} {key}")
            assert_close({prefix + key: value[k:k + 1] for key, value in together.items()}, case["theirs"],
                         [prefix + key for key in together])


def test_slicing_changes_nothing(case):
    import paddle

    vae = case["vae"]
    x = paddle.to_tensor(np.concatenate([named_inputs()["image"], named_inputs()["image_b"]]))
    with paddle.no_grad():
        whole = vae.encode(x).latent_dist.mean
        vae.enable_slicing()
        try:
            sliced = vae.encode(x).latent_dist.mean
            np.testing.assert_allclose(vae.decode(sliced).sample.numpy(), vae.decode(whole).sample.numpy(),
                                       rtol=0, atol=1e-5)
        finally:
            vae.disable_slicing()
    np.testing.assert_allclose(sliced.numpy(), whole.numpy(), rtol=0, atol=1e-5)


# ---- gradients: diffusers' training step, at ordinary and stressed activations

def train_step(vae, x: np.ndarray, record_swish: bool = False):
    """diffusers_side.py's --train on our model: train mode, posterior mode, decode (unclamped), mean squared error,
    backward. Returns (decoded, {name: gradient}, [min, max] of every swish input or None)."""
    import paddle

    vae.train()
    vae.clear_gradients(set_to_zero=False)
    seen = [np.inf, -np.inf]
    original = paddle.nn.functional.swish

    def recording(t, *args, **kwargs):
        seen[:] = [min(seen[0], t.min().item()), max(seen[1], t.max().item())]
        return original(t, *args, **kwargs)

    pixels_in = paddle.to_tensor(x)
    if record_swish:
        paddle.nn.functional.swish = recording
    try:
        decoded = vae.decode(vae.encode(pixels_in).latent_dist.mode()).sample
    finally:
        paddle.nn.functional.swish = original
    (decoded - pixels_in).pow(2).mean().backward()
    grads = {name: np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy()
             for name, p in vae.named_parameters() if not p.stop_gradient}
    vae.eval()
    return decoded.numpy(), grads, seen if record_swish else None


@pytest.mark.parametrize("kind", ["image", "clip"])
@pytest.mark.parametrize("state", ["ordinary", "stressed"])
def test_gradients_of_every_weight_equal_diffusers(diffusers_results, state, kind):
    folder, result = diffusers_results["train", state, kind]
    theirs = result()
    vae, _ = ours_from_diffusers_folder(folder)
    decoded, grads, swish = train_step(vae, named_inputs()[kind], record_swish=True)
    scale = max(1.0, float(np.abs(theirs["train_decoded"]).max()))
    assert np.abs(decoded - theirs["train_decoded"]).max() <= ATOL * scale
    worst, where = worst_relative_error(grads, {k[len("grad:"):]: v for k, v in theirs.items()
                                                if k.startswith("grad:")})
    print(f"{state} {kind}: {len(grads)} weights, worst relative gradient error {worst:.2e} ({where}); "
          f"swish inputs {swish}; decode scale {scale:.1f}")
    if state == "stressed":  # the stress is real: Paddle's SiLU kernel would give NaN below -89
        assert swish[0] < -100 and swish[1] > 100, swish


# ---- ours -> diffusers, and tiling

def test_our_export_loads_in_diffusers_exactly_and_decodes_as_ours(diffusers_results):
    vae, result = diffusers_results["export"]
    theirs = result()
    assert_loaded_exactly(theirs, CLASS)
    inputs = diffusers_results["inputs"]
    ours = run_ours(vae, {"": inputs["image"], "clip_": inputs["clip"]}, diffusers_results["latents"])
    differences = assert_close(ours, theirs, [p + k for p in ("", "clip_") for k in ("mean", "logvar", "decoded")]
                               + ["decoded_latents"])
    print("export", differences)


def test_tiled_encode_and_decode_equal_diffusers_tiled(diffusers_results):
    """diffusers' own tiling (enable_tiling(64, 64, 4, 4)) of a 96 px image and of 6 x 6 latents."""
    import paddle

    vae, _ = diffusers_results["export"]
    inputs, latents, result = diffusers_results["tiled"]
    theirs = result()
    vae.enable_tiling(TILE, TILE, TILE_LATENT, TILE_LATENT)
    try:
        ours = run_ours(vae, {"": inputs["image"]}, latents)
    finally:
        vae.disable_tiling()
    assert ours["mean"].shape[-2:] == (TILED_SIZE // 16,) * 2 and ours["decoded_latents"].shape[-1] == TILED_SIZE
    print("tiled", assert_close(ours, theirs, ["mean", "logvar", "decoded", "decoded_latents"]))
    with paddle.no_grad():  # and tiling does change the numbers (the tiles really blend)
        untiled = vae.encode(paddle.to_tensor(inputs["image"])).latent_dist.mean.numpy()
    assert np.abs(untiled - ours["mean"]).max() > 1e-3


# ---- recompute, the handles fine-tuning needs, the one-frame facts

@pytest.mark.parametrize("kind", ["image", "clip"])
def test_checkpoint_segments_may_be_recomputed(matched, kind):
    """Every segment's forward under non-reentrant recompute gives the one-shot gradients exactly, and so does
    ppdiffusers' enable_gradient_checkpointing (the same blocks)."""
    from paddle.distributed.fleet.utils import recompute

    vae, x = matched["vae"], named_inputs()[kind]
    plain = train_step(vae, x)[1]
    segments = vae.checkpoint_segments()
    assert "decoder.conv_out" not in [name for name, _ in segments]
    assert not any(layer is vae.decoder.conv_out for _, layer in segments)
    for _, block in segments:
        block.forward = (lambda forward: lambda *a, **k: recompute(forward, *a, use_reentrant=False, **k))(
            block.forward)
    try:
        again = train_step(vae, x)[1]
    finally:
        for _, block in segments:
            del block.forward
    vae.enable_gradient_checkpointing()
    try:
        assert vae.encoder.gradient_checkpointing and vae.decoder.gradient_checkpointing
        switched = train_step(vae, x)[1]
    finally:
        vae.disable_gradient_checkpointing()
    for name in plain:
        np.testing.assert_array_equal(again[name], plain[name], err_msg=name)
        np.testing.assert_array_equal(switched[name], plain[name], err_msg=name)


def test_fine_tuning_handles(matched):
    """The decoder's last layer makes the pixels, the encoder's the moments; a decode alone reaches no encoder-side
    weight and every decoder-side one."""
    import paddle

    vae = matched["vae"]
    assert vae.decoder_last_layer() is vae.decoder.conv_out.conv.weight and vae.decoder_last_layer().shape[0] == 3
    assert vae.encoder_last_layer() is vae.encoder.conv_out.conv and vae.encoder_last_layer().weight.shape[0] == 64
    assert [name for name, _ in vae.encoder_side_modules()] == ["encoder"]
    encoder_side = {f"{prefix}.{name}" for prefix, layer in vae.encoder_side_modules()
                    for name, _ in layer.named_parameters()}
    assert encoder_side == {name for name, _ in vae.named_parameters() if name.startswith("encoder.")}
    vae.clear_gradients(set_to_zero=False)
    vae.decode(paddle.to_tensor(loud_latents())).sample.square().mean().backward()
    untouched = {name for name, p in vae.named_parameters() if p.grad is None}
    assert untouched == encoder_side
    names = [name for name, _ in vae.checkpoint_segments()]
    assert names == [f"encoder.down_blocks.{i}" for i in range(5)] + ["encoder.mid_block", "decoder.mid_block"] + [
        f"decoder.up_blocks.{i}" for i in range(5)]


def test_video_only_weights(matched):
    """A one-frame pass gives exactly zero gradient to the temporal upsamplers' output channels frame 0 drops, and a
    gradient to everything else (the temporal taps too: replicate padding feeds them the frame); a clip reaches
    those channels."""
    vae = matched["vae"]
    video_only = vae.video_only_weights()
    assert sorted(w.name for w in video_only) == sorted(f"decoder.up_blocks.{i}.upsamplers.0.conv.conv.{leaf}"
                                                        for i in (0, 1) for leaf in ("weight", "bias"))
    images = train_step(vae, named_inputs()["image"])[1]
    for weight in video_only:
        assert len(weight.channels) * 2 == images[weight.name].shape[0]
        assert not np.any(weight.part(images[weight.name])), weight.name
        rest = np.delete(images[weight.name], list(weight.channels), axis=0)
        assert np.all(np.abs(rest).reshape(len(rest), -1).max(axis=1) > 0), weight.name
    assert all(np.abs(g).max() > 0 for g in images.values())
    clip = train_step(vae, named_inputs()["clip"])[1]
    for weight in video_only:
        part = np.abs(weight.part(clip[weight.name])).reshape(len(weight.channels), -1)
        assert np.all(part.max(axis=1) > 0), weight.name


def test_one_frame_conv_equals_the_padded_3d_conv(matched):
    """A single frame runs as a 2D conv with the temporal taps summed: the replicate-padded 3D conv's numbers."""
    import paddle

    conv = matched["vae"].encoder.down_blocks[1].resnets[0].conv1
    x = paddle.to_tensor(np.random.default_rng(3).standard_normal((2, 16, 1, 8, 12)).astype(np.float32))
    with paddle.no_grad():
        fast = conv(x).numpy()
        conv._one_frame_ok = False
        try:
            padded = conv(x).numpy()
        finally:
            conv._one_frame_ok = True
    np.testing.assert_allclose(fast, padded, rtol=0, atol=1e-5)


def test_posterior_frames_rule_and_shapes(matched):
    """5-D posterior (mean, logvar, var, std, mode, sample, kl); T = 1 + 4k frames in, 1 + 4 (T' - 1) out; other
    frame counts and 4-D input are refused."""
    import paddle

    vae = matched["vae"]
    with paddle.no_grad():
        dist = vae.encode(paddle.to_tensor(pixels(9, 0))).latent_dist
        assert dist.mean.shape == [1, 32, 3, 2, 3]
        assert dist.mean.shape == dist.logvar.shape == dist.std.shape == dist.var.shape == dist.sample().shape
        np.testing.assert_array_equal(dist.mode().numpy(), dist.mean.numpy())
        np.testing.assert_allclose(dist.var.numpy(), np.exp(dist.logvar.numpy()), rtol=1e-5)
        np.testing.assert_allclose(dist.std.numpy(), np.exp(0.5 * dist.logvar.numpy()), rtol=1e-5)
        assert dist.kl().shape == [1]
        assert vae.decode(dist.mode()).sample.shape == [1, 3, 9, HEIGHT, WIDTH]
        for frames in (2, 3, 6):
            with pytest.raises(ValueError, match="1 \\+ 4k frames"):
                vae.encode(paddle.to_tensor(pixels(frames, 0)))
        with pytest.raises(ValueError, match="N, C, T, H, W"):
            vae.encode(paddle.to_tensor(pixels(1, 0)[:, :, 0]))
    assert vae.temporal_compression_ratio == 4 and vae.spatial_compression_ratio == 16
    assert vae.config.scaling_factor == 1.03682


def test_rms_norm_normalises_half_precision_in_float32():
    """As diffusers 0.42.1 (PR #13316): the L2 normalisation of a half input is taken in float32, cast back, then
    scaled by sqrt(dim) * gamma in the input's dtype. bfloat16 only: CPU Paddle has no float16 multiply kernel, and
    no bfloat16 p_norm either (so without the upcast this raises here)."""
    dtype = "bfloat16"
    import paddle
    import paddle.nn.functional as F

    from vae_trainer.models.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15RMSNorm

    norm = HunyuanVideo15RMSNorm(64, images=False)
    norm.gamma.set_value(paddle.to_tensor(np.random.default_rng(0).uniform(0.5, 1.5, (64, 1, 1, 1)), "float32"))
    norm.to(dtype=dtype)
    x32 = paddle.to_tensor(np.random.default_rng(1).standard_normal((1, 64, 2, 3, 3)).astype(np.float32) * 300)
    x = x32.astype(dtype)
    out = norm(x)
    assert out.dtype == x.dtype
    expected = F.normalize(x.astype("float32"), axis=1).astype(dtype) * 8.0 * norm.gamma
    np.testing.assert_array_equal(out.astype("float32").numpy(), expected.astype("float32").numpy())
