"""AutoencoderRAE in Paddle (vae_trainer/models/autoencoder_rae.py) against diffusers 0.42.1's, run in .venv-flux2.

Seeded tiny configs (encoder hidden 64 = one head of 64, 2 layers, patch 14; decoder 2 layers), each a diffusers
folder made by diffusers (tests/family_parity.py):
    plain     dinov2, encoder input 28 (2 x 2 tokens), 32 px images resized down, statistics unset, scaling 1,
              reshape_to_2d False (token latents); also decodes 3 x 3 token grids (the decoder resizes them to 2 x 2)
    position  dinov2, input 56 = the images (no resize), statistics per channel and position (C, 4, 4), scaling 1.7
    mae       mae, input 42 (its stored 16 x 16 positions resized), 40 px images resized up, statistics per channel
              (C, 1, 1), scaling 0.5
(a) diffusers' file -> ours: the same keys and shapes after ppdiffusers' conversion; encode (eval) and decode equal
(b) ours, seeded and perturbed -> save_pretrained(to_diffusers=True) -> diffusers loads it exactly, equal outputs
(c) noise_tau: training-mode noise per sample within [0, tau], added before the latent normalisation; eval exact
(d) encoder_state_from_dinov2 of a transformers 5.24 Dinov2WithRegistersModel folder and of a timm state dict
    (tests/rae_torch_side.py): diffusers' RAE latents and transformers' tokens with those weights
(e) gradients through the decoder: finite, none into the frozen encoder
and: __init__ has diffusers' signature; the encoder's bicubic input resize equals torch's to 1e-5; unsupported
encoder types, and DINOv2 files RAE cannot use, are one clear ValueError
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from family_parity import DIFFUSERS_PYTHON, DiffusersBatch, assert_loaded_exactly

from conftest import REPO

CLASS = "AutoencoderRAE"
TOLERANCE = 1e-4
TORCH_SIDE = os.path.join(REPO, "tests", "rae_torch_side.py")
ENCODER = dict(encoder_hidden_size=64, encoder_patch_size=14, encoder_num_hidden_layers=2)
WIDTH = ENCODER["encoder_hidden_size"]


def _stats(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * 0.3).round(4).tolist(), (rng.uniform(0.5, 1.5, size=shape)).round(4).tolist()


_CHANNEL, _POSITION = _stats((WIDTH, 1, 1), 1), _stats((WIDTH, 4, 4), 2)
# name -> (config, image side in px, side of the extra latents' grid to decode (None: the encoder's own grid))
CASES = {
    "plain": (dict(ENCODER, encoder_input_size=28, decoder_hidden_size=32, decoder_num_hidden_layers=2,
                   decoder_num_attention_heads=2, decoder_intermediate_size=64, patch_size=8, reshape_to_2d=False),
              32, 3),
    "position": (dict(ENCODER, encoder_input_size=56, decoder_hidden_size=64, decoder_num_hidden_layers=2,
                      decoder_num_attention_heads=4, decoder_intermediate_size=128, patch_size=16,
                      latents_mean=_POSITION[0], latents_std=_POSITION[1], scaling_factor=1.7), 56, None),
    "mae": (dict(ENCODER, encoder_type="mae", encoder_input_size=42, decoder_hidden_size=48,
                 decoder_num_hidden_layers=2, decoder_num_attention_heads=3, decoder_intermediate_size=96,
                 patch_size=16, latents_mean=_CHANNEL[0], latents_std=_CHANNEL[1], scaling_factor=0.5), 40, None),
}


def _inputs(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images on [0, 1] and latents to decode (normalised space), seeded per case."""
    config, px, side = CASES[name]
    rng = np.random.default_rng(seed + len(name))
    grid = side or config["encoder_input_size"] // config["encoder_patch_size"]
    shape = (2, WIDTH, grid, grid) if config.get("reshape_to_2d", True) else (2, grid * grid, WIDTH)
    return rng.random((2, 3, px, px), dtype=np.float32), rng.normal(size=shape).astype(np.float32)


def _ours(model, images: np.ndarray, latents: np.ndarray) -> dict:
    import paddle

    with paddle.no_grad():
        latent = model.encode(paddle.to_tensor(images)).latent
        return {"latent": latent.numpy(), "decoded": model.decode(latent).sample.numpy(),
                "decoded_latents": model.decode(paddle.to_tensor(latents)).sample.numpy()}


def _assert_close(ours: dict, theirs: dict) -> dict:
    diffs = {}
    for key, value in ours.items():
        assert value.shape == theirs[key].shape, (key, value.shape, theirs[key].shape)
        diffs[key] = float(np.abs(value - theirs[key]).max())
    assert max(diffs.values()) < TOLERANCE, diffs
    return diffs


@pytest.fixture(scope="module")
def in_diffusers(tmp_path_factory) -> dict:
    """One diffusers process for the module: each case's folder made by diffusers and run on the case's inputs, and
    our seeded, perturbed model of each case saved for diffusers (b) and run there on other inputs. {case: (folder,
    diffusers' outputs on its inputs, our saved model's outputs, diffusers' outputs of our saved model)}."""
    import paddle

    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    root = tmp_path_factory.mktemp("rae_in_diffusers")
    batch, made, ours = DiffusersBatch(root), {}, {}
    for name, (config, _, _) in CASES.items():
        work = root / name
        os.makedirs(work / "saved")
        folder = batch.make(CLASS, work / "diffusers", config, seed=len(name))
        images, latents = _inputs(name)
        made[name] = (folder, batch.run(CLASS, folder, images, work, latents=latents))
        paddle.seed(7)
        model = AutoencoderRAE(**config)
        for param in model.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
        model.eval()
        model.save_pretrained(str(work / "ours"), to_diffusers=True)
        images, latents = _inputs(name, seed=1)
        ours[name] = (_ours(model, images, latents),
                      batch.run(CLASS, work / "ours", images, work / "saved", latents=latents))
    os.makedirs(root / "dinov2")
    batch.command("script", TORCH_SIDE, root / "dinov2")  # (d)'s folders and references: see dinov2_files
    batch.flush()
    out = {name: (made[name][0], made[name][1](), ours[name][0], ours[name][1]()) for name in CASES}
    out["dinov2"] = str(root / "dinov2")
    return out


@pytest.fixture(params=list(CASES))
def from_diffusers(request, in_diffusers):
    """(case name, diffusers folder, diffusers' outputs on the case's inputs)."""
    folder, result, _, _ = in_diffusers[request.param]
    return request.param, folder, result


def _converted(folder: str):
    """Our model from diffusers' config.json, and diffusers' weights through ppdiffusers' converter."""
    from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
    from safetensors.numpy import load_file

    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    with open(os.path.join(folder, "config.json")) as handle:
        config = {k: v for k, v in json.load(handle).items() if not k.startswith("_")}
    model = AutoencoderRAE(**config)
    state = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    return model, convert_pytorch_state_dict_to_paddle(model, dict(state))


def test_diffusers_weights_convert_exactly(from_diffusers):
    name, folder, result = from_diffusers
    assert_loaded_exactly(result, CLASS)  # diffusers' own folder, as a check of the helper's inputs
    model, state = _converted(folder)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert {k: list(v.shape) for k, v in state.items()} == ours
    assert "decoder.decoder_pos_embed" not in ours and {"_latents_mean", "encoder_std"} <= set(ours)


def test_matches_diffusers(from_diffusers):
    """(a) encode in eval mode and decode (the encoder's latents and other ones) equal diffusers' to 1e-4."""
    name, folder, result = from_diffusers
    model, state = _converted(folder)
    missing, unexpected = model.set_state_dict(state)
    assert not missing and not unexpected
    model.eval()
    diffs = _assert_close(_ours(model, *_inputs(name)), result)
    print(name, "max abs diff vs diffusers", diffs)


def test_from_pretrained_from_diffusers(from_diffusers):
    """ppdiffusers' own loader reads the diffusers folder completely too (and returns the model in eval mode)."""
    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    name, folder, result = from_diffusers
    model, info = AutoencoderRAE.from_pretrained(folder, from_diffusers=True, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert not model.training
    _assert_close(_ours(model, *_inputs(name)), result)


@pytest.mark.parametrize("name", list(CASES))
def test_saved_for_diffusers_loads_exactly(name, in_diffusers):
    """(b) our seeded, perturbed model -> save_pretrained(to_diffusers=True) -> diffusers: no missing, unexpected
    or mismatched key (the unset statistics keep their shape (1,)), the same outputs."""
    _, _, ours, result = in_diffusers[name]
    assert_loaded_exactly(result, CLASS)
    diffs = _assert_close(ours, result)
    print(name, "max abs diff, ours saved for diffusers", diffs)


def test_noise_tau_in_training_only():
    """(c) tau * U(0, 1) * N(0, 1) on the tokens, one U per sample, before the normalisation and the scaling."""
    import paddle

    from vae_trainer.models.autoencoder_rae import LATENT_EPS, AutoencoderRAE

    tau, std, scale = 0.3, 2.0, 3.0
    paddle.seed(3)
    model = AutoencoderRAE(**dict(CASES["position"][0], latents_mean=None, latents_std=[std], scaling_factor=scale,
                                  noise_tau=tau))
    images = paddle.to_tensor(np.random.default_rng(0).random((16, 3, 56, 56), dtype=np.float32))
    model.eval()
    with paddle.no_grad():
        clean = model.encode(images).latent.numpy()
        assert np.array_equal(clean, model.encode(images).latent.numpy())
        model.train()
        noisy = [model.encode(images).latent.numpy() for _ in range(2)]
    assert not np.array_equal(noisy[0], noisy[1])
    noise = (noisy[0] - clean) * (std + LATENT_EPS) / scale  # back to the tokens' scale
    per_sample = noise.reshape(16, -1).std(axis=1)  # 1024 values each: within ~5 % of that sample's sigma
    assert per_sample.min() >= 0 and per_sample.max() <= tau * 1.1, per_sample
    assert per_sample.max() - per_sample.min() > tau / 4, per_sample  # one level per sample, not one for all
    assert np.abs(noise.reshape(16, -1).mean(axis=1)).max() < tau * 0.15


@pytest.fixture(scope="module")
def dinov2_files(in_diffusers):
    """tests/rae_torch_side.py's DINOv2 folders and references (made in in_diffusers' diffusers process)."""
    folder = in_diffusers["dinov2"]
    return folder, dict(np.load(os.path.join(folder, "refs.npz")))


@pytest.mark.parametrize("source", ["reg", "reg_timm.safetensors"])
def test_encoder_from_dinov2(dinov2_files, source):
    """(d) a downloaded DINOv2 with registers as the RAE encoder: diffusers' latents, transformers' tokens."""
    import paddle

    from vae_trainer.models.autoencoder_rae import AutoencoderRAE, encoder_state_from_dinov2

    folder, refs = dinov2_files
    state, sizes = encoder_state_from_dinov2(os.path.join(folder, source))
    assert sizes == ENCODER
    model = AutoencoderRAE(**sizes, encoder_input_size=42, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                           decoder_num_attention_heads=2, decoder_intermediate_size=64, patch_size=8)
    assert set(state) == {k for k in model.state_dict() if k.startswith("encoder.")}
    missing, _ = model.set_state_dict(state)
    assert not [k for k in missing if k.startswith("encoder.")]
    model.eval()
    images = paddle.to_tensor(refs["images"])
    with paddle.no_grad():
        latent = model.encode(images).latent.numpy()
        tokens = model.encoder.patch_tokens(model._encoder_pixels(images)).numpy()
    diffs = (np.abs(latent - refs["rae_latent"]).max(), np.abs(tokens - refs["hf_tokens"]).max())
    assert max(diffs) < TOLERANCE, diffs
    print(source, "max abs diff: diffusers latent, transformers tokens", diffs)


def test_encoder_resize_is_torch_bicubic(dinov2_files):
    """The encoder's input resize equals torch's F.interpolate(mode="bicubic", align_corners=False) to 1e-5."""
    import paddle

    from vae_trainer.models.autoencoder_rae import resize_bicubic

    refs = dinov2_files[1]
    keys = [k for k in refs if k.startswith("resize_")]
    assert len(keys) == 5
    for key in keys:
        size = int(key.rsplit("_", 1)[1])
        ours = resize_bicubic(paddle.to_tensor(refs[key]), size).numpy()
        assert np.abs(ours - refs["resized" + key[len("resize"):]]).max() < 1e-5, key


def test_dinov2_without_registers_is_one_clear_error(dinov2_files):
    from vae_trainer.models.autoencoder_rae import encoder_state_from_dinov2

    path = os.path.join(dinov2_files[0], "plain")
    with pytest.raises(ValueError) as raised:
        encoder_state_from_dinov2(path)
    assert path in str(raised.value) and "registers 0 (RAE: 4)" in str(raised.value), str(raised.value)


def test_signature_is_diffusers():
    """__init__'s arguments, their order and defaults are diffusers' (read from its source: no torch import)."""
    import ast
    import glob
    import inspect

    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    sources = glob.glob(os.path.join(os.path.dirname(DIFFUSERS_PYTHON), "..", "lib", "python3*", "site-packages",
                                     "diffusers", "models", "autoencoders", "autoencoder_rae.py"))
    if not sources:
        pytest.skip("diffusers 0.42.1 (.venv-flux2) is missing")
    with open(sources[0]) as handle:
        tree = ast.parse(handle.read())
    init = next(node for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == CLASS
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    names = [a.arg for a in init.args.args[1:]]
    theirs = dict(zip(names, [ast.literal_eval(d) for d in init.args.defaults]))
    ours = {k: p.default for k, p in list(inspect.signature(AutoencoderRAE.__init__).parameters.items())[1:]}
    assert list(ours) == names and ours == theirs


def test_unsupported_encoder_types_are_one_clear_error():
    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    for encoder_type in ("siglip2", "clip"):
        with pytest.raises(ValueError, match=f"encoder_type='{encoder_type}'.*supported: dinov2, mae"):
            AutoencoderRAE(**CASES["plain"][0], encoder_type=encoder_type)


def test_decoder_gradients_finite_encoder_frozen():
    """(e) a reconstruction loss's gradients reach every decoder parameter, finite; none reach the encoder."""
    import paddle
    import paddle.nn.functional as F

    from vae_trainer.models.autoencoder_rae import AutoencoderRAE

    paddle.seed(5)
    model = AutoencoderRAE(**dict(CASES["position"][0], noise_tau=0.5))
    model.train()
    images = paddle.to_tensor(np.random.default_rng(1).random((2, 3, 64, 64), dtype=np.float32))
    recon = model(images).sample
    loss = F.mse_loss(recon, images)
    loss.backward()
    for name, param in model.decoder.named_parameters():
        assert param.grad is not None and np.isfinite(param.grad.numpy()).all(), name
    assert float(model.decoder_last_layer().grad.abs().sum()) > 0
    assert model.decoder_last_layer() is model.decoder.decoder_pred.weight
    assert all(p.stop_gradient and p.grad is None for p in model.encoder.parameters())
