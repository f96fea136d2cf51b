"""DC-AE (vae_trainer/models/autoencoder_dc.py) against diffusers 0.42.1's AutoencoderDC, which runs in .venv-flux2
(tests/diffusers_side.py; all of its models are made and run in ONE subprocess, its `batch` command, by the
module fixture `parity`).

Three seeded tiny configs cover every constructor option:
  sana    SANA-1.0-like: ResBlock, ResBlock, EfficientViTBlock (qkv multiscales (5,)); conv down, interpolate up;
          RMSNorm; shortcuts on; attention_head_dim 16, so that the full-size maps take the linear attention and
          the 16 px tiles and 2x2 latents the quadratic one, in the encoder and in the decoder
  in_mix  dc-ae-in/mix-like: layers_per_block[0] == 0 (conv_in a pixel-unshuffle DCDownBlock2d, decoder.conv_out a
          pixel-shuffle DCUpBlock2d); per-stage decoder norms batch_norm, batch_norm, rms_norm and acts relu, relu,
          silu; encoder qkv multiscales (3, 5), decoder none; both shortcuts off; decoder_conv_act_fn silu
  deep    f8, 4 stages, encoder and decoder of different widths; layers_per_block[0] == 0 with conv down (a stride-2
          conv_in) and interpolate up (an interpolating conv_out); block types as one string (encoder) and per
          stage (decoder); decoder_norm_types "batch_norm" as one string (BatchNorm in ResBlocks and in the
          attention's norm_out); decoder acts relu, gelu, mish, silu; decoder qkv multiscales (3, 5)
For each: (a) diffusers folder -> ours, (b) ours -> diffusers, (c) an fp16 variant folder, (d) tiled encode /
decode, (e) a training step (outputs, every gradient, BatchNorm statistics) equal to diffusers' to 1e-4.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from family_parity import assert_loaded_exactly, diffusers_side

CLASS = "AutoencoderDC"
ATOL = 1e-4
COMMON = dict(in_channels=3, latent_channels=8, attention_head_dim=8,
              encoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock"],
              decoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock"],
              encoder_block_out_channels=[8, 16, 32], decoder_block_out_channels=[8, 16, 32])
CONFIGS = {
    # Keys left out (shortcuts, decoder_conv_act_fn, act / norm) take the defaults: test_config checks them.
    "sana": dict(COMMON, attention_head_dim=16, encoder_layers_per_block=[1, 1, 2], decoder_layers_per_block=[1, 1, 2],
                 encoder_qkv_multiscales=[[], [], [5]], decoder_qkv_multiscales=[[], [], [5]],
                 downsample_block_type="Conv", upsample_block_type="interpolate", scaling_factor=0.41407),
    "in_mix": dict(COMMON, encoder_layers_per_block=[0, 2, 2], decoder_layers_per_block=[0, 2, 2],
                   encoder_qkv_multiscales=[[], [], [3, 5]], decoder_qkv_multiscales=[[], [], []],
                   downsample_block_type="pixel_unshuffle", upsample_block_type="pixel_shuffle",
                   decoder_norm_types=["batch_norm", "batch_norm", "rms_norm"],
                   decoder_act_fns=["relu", "relu", "silu"], encoder_out_shortcut=False, decoder_in_shortcut=False, decoder_conv_act_fn="silu",
                   scaling_factor=0.3189),
    "deep": dict(in_channels=3, latent_channels=4, attention_head_dim=8, encoder_block_types="ResBlock",
                 decoder_block_types=["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock"],
                 encoder_block_out_channels=[8, 16, 32, 32], decoder_block_out_channels=[8, 16, 16, 32],
                 encoder_layers_per_block=[0, 1, 1, 1], decoder_layers_per_block=[0, 1, 1, 2],
                 encoder_qkv_multiscales=[[], [], [], []], decoder_qkv_multiscales=[[], [], [], [3, 5]],
                 downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="batch_norm",
                 decoder_act_fns=["relu", "gelu", "mish", "silu"], encoder_out_shortcut=True,
                 decoder_in_shortcut=True, decoder_conv_act_fn="relu", scaling_factor=1.0),
}
# (tile px, stride px, image height, width) per config: images larger than a tile, edge tiles smaller than a tile
# (sana's: 10 x 9 px, which diffusers zero-pads at the bottom / right to a multiple of 4, and which give latent
# rows and columns beyond the blended ones, so that the padding shows).
TILING = {"sana": (16, 12, 46, 45), "in_mix": (16, 8, 40, 36), "deep": (16, 8, 40, 48)}
LATENT_SIZE = 2  # the decoded random latents: 2x2 maps take the quadratic attention


def images(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (count, 3, height, width)).astype(np.float32)


def weights_file(folder: str, variant: str | None = None) -> str:
    return os.path.join(folder, "diffusion_pytorch_model" + (f".{variant}" if variant else "") + ".safetensors")


def max_diff(ours: np.ndarray, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.abs(ours.astype(np.float64) - theirs).max())


def assert_close(ours: dict, theirs: dict, keys, atol: float = ATOL) -> None:
    diffs = {key: max_diff(ours[key], theirs[key]) for key in keys}
    print("max abs diff", diffs)
    assert all(d <= atol for d in diffs.values()), diffs


# ---------------------------------------------------------------------------------------------------- our side


def build(config: dict):
    from vae_trainer.models.autoencoder_dc import AutoencoderDC

    return AutoencoderDC(**config)


def load_from_diffusers(folder: str, config: dict, variant: str | None = None):
    """Ours with the weights of a diffusers folder; asserts the converted keys and shapes are exactly ours."""
    from safetensors.numpy import load_file

    from vae_trainer.models.autoencoder_dc import state_dict_from_diffusers

    model = build(config)
    state = state_dict_from_diffusers(model, load_file(weights_file(folder, variant)))
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert {k: list(v.shape) for k, v in state.items()} == expected
    missing, unexpected = model.set_state_dict(state)
    assert not missing and not unexpected
    return model.eval()


def perturbed(config: dict, seed: int):
    """Ours from Paddle's seeded init, every weight moved off it, BatchNorm statistics made non-trivial."""
    import paddle

    from vae_trainer.models.autoencoder_dc import TorchBatchNorm2D

    paddle.seed(seed)
    model = build(config)
    with paddle.no_grad():
        for param in model.parameters():
            param.set_value(param + paddle.randn(param.shape) * 0.05)
        for layer in model.sublayers():
            if isinstance(layer, TorchBatchNorm2D):
                layer._mean.set_value(paddle.randn(layer._mean.shape) * 0.3)
                layer._variance.set_value(paddle.rand(layer._variance.shape) * 2.0 + 0.5)
                layer.num_batches_tracked.set_value(paddle.full([1], 5, dtype="int64"))
    return model.eval()


def run_ours(model, x: np.ndarray, latents: np.ndarray | None = None) -> dict:
    import paddle

    with paddle.no_grad():
        latent = model.encode(paddle.to_tensor(x)).latent
        out = {"latent": latent.numpy(), "decoded": model.decode(latent).sample.numpy()}
        if latents is not None:
            out["decoded_latents"] = model.decode(paddle.to_tensor(latents)).sample.numpy()
    return out


# ---------------------------------------------------------------------------------------------------- fixture


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    """Every config: diffusers' folders (fp32 and fp16 variant) and runs, and the run of our exports, from one
    diffusers process. Returns {name: {"folder", "fp16_folder", "ours", "inputs", "a", "b", "c", "d"}}."""
    root = tmp_path_factory.mktemp("dcae")
    jobs, cases = [], {}
    for k, (name, config) in enumerate(CONFIGS.items()):
        work = root / name
        work.mkdir()
        f = 2 ** (len(config["encoder_block_out_channels"]) - 1)
        tile, stride, height, width = TILING[name]
        inputs = {"images": images(2, 32, 32, seed=k), "big": images(1, height, width, seed=10 + k),
                  "latents": np.random.default_rng(20 + k).normal(
                      size=(2, config["latent_channels"], LATENT_SIZE, LATENT_SIZE)).astype(np.float32)}
        for key, value in inputs.items():
            np.save(work / f"{key}.npy", value)
        ours = perturbed(config, seed=100 + k)
        ours.save_pretrained(str(work / "ours"), to_diffusers=True)
        case = {"folder": str(work / "diffusers"), "fp16_folder": str(work / "diffusers_fp16"), "inputs": inputs,
                "ours": ours, "tiling": (tile, stride), "factor": f}
        make = ["make", CLASS, "--config", json.dumps(config)]
        jobs += [make[:2] + [case["folder"]] + make[2:] + ["--seed", str(k)],
                 make[:2] + [case["fp16_folder"]] + make[2:] + ["--seed", str(50 + k), "--variant", "fp16"]]
        runs = {"a": [case["folder"], "images", "--latents", str(work / "latents.npy"), "--train"],
                "b": [str(work / "ours"), "images", "--latents", str(work / "latents.npy")],
                "c": [case["fp16_folder"], "images", "--variant", "fp16"],
                "d": [case["folder"], "big", "--tile", str(tile), "--stride", str(stride)]}
        for part, (folder, image_key, *flags) in runs.items():
            jobs.append(["run", CLASS, folder, "--images", str(work / f"{image_key}.npy"),
                         "--out", str(work / f"{part}.npz"), *flags])
        cases[name] = case
    with open(root / "jobs.json", "w") as handle:
        json.dump(jobs, handle)
    diffusers_side("batch", str(root / "jobs.json"))
    for name, case in cases.items():
        for part in "abcd":
            result = dict(np.load(root / name / f"{part}.npz"))
            result["loading_info"] = json.loads(str(result["loading_info"]))
            case[part] = result
    return cases


NAMES = list(CONFIGS)


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", NAMES)
def test_config_keys_and_defaults_are_diffusers(parity, name):
    """Built from the same kwargs, our config is the one diffusers saved (its defaults for the keys left out)."""
    with open(os.path.join(parity[name]["folder"], "config.json")) as handle:
        theirs = {k: v for k, v in json.load(handle).items() if not k.startswith("_")}
    ours = {k: v for k, v in dict(build(CONFIGS[name]).config).items() if not k.startswith("_")}
    assert json.loads(json.dumps(ours)) == theirs


@pytest.mark.parametrize("name", NAMES)
def test_a_diffusers_folder_loads_into_ours_with_diffusers_outputs(parity, name):
    case = parity[name]
    model = load_from_diffusers(case["folder"], CONFIGS[name])
    ours = run_ours(model, case["inputs"]["images"], case["inputs"]["latents"])
    assert_close(ours, case["a"], ("latent", "decoded", "decoded_latents"))
    assert ours["latent"].shape[-1] == 32 // case["factor"]
    assert np.abs(case["a"]["decoded"]).max() > 0.1  # not a degenerate model


@pytest.mark.parametrize("name", NAMES)
def test_b_our_export_loads_in_diffusers_with_our_outputs(parity, name):
    case = parity[name]
    assert_loaded_exactly(case["b"], CLASS)
    ours = run_ours(case["ours"], case["inputs"]["images"], case["inputs"]["latents"])
    assert_close(ours, case["b"], ("latent", "decoded", "decoded_latents"))
    with open(os.path.join(case["folder"], "..", "ours", "config.json")) as handle:
        assert json.load(handle)["_class_name"] == CLASS


@pytest.mark.parametrize("name", NAMES)
def test_c_an_fp16_variant_folder_reads_into_float32(parity, name):
    import paddle

    case = parity[name]
    assert_loaded_exactly(case["c"], CLASS)
    model = load_from_diffusers(case["fp16_folder"], CONFIGS[name], variant="fp16")
    assert all(p.dtype == paddle.float32 for p in model.parameters())
    ours = run_ours(model, case["inputs"]["images"])
    assert_close(ours, case["c"], ("latent", "decoded"))


@pytest.mark.parametrize("name", NAMES)
def test_d_tiled_encode_and_decode_are_diffusers(parity, name):
    case = parity[name]
    tile, stride = case["tiling"]
    model = load_from_diffusers(case["folder"], CONFIGS[name])
    big, f = case["inputs"]["big"], case["factor"]
    whole = big[:, :, :big.shape[2] // f * f, :big.shape[3] // f * f]  # the untiled encoder needs multiples of f
    untiled = run_ours(model, whole)
    model.enable_tiling(tile, tile, stride, stride)
    tiled = run_ours(model, big)
    assert_close(tiled, case["d"], ("latent", "decoded"))
    # The tiles really were blended: a seam-free full-image pass gives other numbers.
    assert tiled["latent"].shape == untiled["latent"].shape
    assert max_diff(tiled["latent"], untiled["latent"]) > 1e-3
    model.disable_tiling()
    assert max_diff(run_ours(model, whole)["latent"], untiled["latent"]) == 0


@pytest.mark.parametrize("name", NAMES)
def test_e_a_training_step_is_diffusers(parity, name):
    """Train mode: the output (BatchNorm on batch statistics), a finite gradient for every parameter equal to
    PyTorch's, and the BatchNorm running statistics and counters PyTorch leaves."""
    import paddle

    case, theirs = parity[name], parity[name]["a"]
    model = load_from_diffusers(case["folder"], CONFIGS[name])
    model.train()
    images = paddle.to_tensor(case["inputs"]["images"])
    sample = model(images).sample
    (sample - images).pow(2).mean().backward()  # diffusers_side.py's training step
    assert max_diff(sample.numpy(), theirs["train_decoded"]) <= ATOL
    linear = {n + ".weight" for n, layer in model.named_sublayers() if isinstance(layer, paddle.nn.Linear)}
    # Paddle keeps BatchNorm's statistics as parameters that take no gradient; the others are PyTorch's parameters.
    trainable = {n: p for n, p in model.named_parameters() if not p.stop_gradient}
    assert set(trainable) == {k[len("grad:"):] for k in theirs if k.startswith("grad:")}
    worst = 0.0
    for pname, param in trainable.items():
        assert param.grad is not None, pname
        grad = param.grad.numpy()
        assert np.isfinite(grad).all(), pname
        torch_grad = theirs[f"grad:{pname}"]
        worst = max(worst, max_diff(grad, torch_grad.T if pname in linear else torch_grad))
    print("max abs gradient diff", worst)
    assert worst <= ATOL
    # What is not trained: BatchNorm's running statistics (Paddle's _mean / _variance) and counters.
    statistics = {k: v.numpy() for k, v in model.state_dict().items() if k not in trainable}
    torch_names = {k.replace("._mean", ".running_mean").replace("._variance", ".running_var"): k for k in statistics}
    assert set(torch_names) == {k[len("buffer:"):] for k in theirs if k.startswith("buffer:")}
    worst = 0.0
    for torch_name, ours_name in torch_names.items():  # float32 variances of ~10: an ulp is ~1e-6
        expected = theirs[f"buffer:{torch_name}"]
        scale = max(1.0, float(np.abs(expected).max()))
        worst = max(worst, max_diff(statistics[ours_name].reshape(expected.shape), expected) / scale)
    print("max statistics diff, relative to the largest", worst)
    assert worst <= 1e-6
    counters = [v.item() for k, v in statistics.items() if k.endswith("num_batches_tracked")]
    assert counters == [1] * len(counters) and bool(counters) == (name != "sana")


def test_slicing_gives_the_batched_outputs(parity):
    case = parity["in_mix"]
    model = case["ours"]
    batched = run_ours(model, case["inputs"]["images"])
    model.enable_slicing()
    try:
        sliced = run_ours(model, case["inputs"]["images"])
    finally:
        model.disable_slicing()
    assert_close(sliced, batched, ("latent", "decoded"), atol=1e-5)


def test_compression_ratio_and_forward(parity):
    import paddle

    case = parity["deep"]
    model = case["ours"]
    assert model.spatial_compression_ratio == 8
    x = paddle.to_tensor(case["inputs"]["images"])
    with paddle.no_grad():
        np.testing.assert_array_equal(model(x).sample.numpy(), model(x, return_dict=False)[0].numpy())
        np.testing.assert_array_equal(model(x).sample.numpy(), run_ours(model, case["inputs"]["images"])["decoded"])


def test_constructor_signature_is_diffusers():
    """Our __init__'s arguments, in order, with diffusers' defaults (read from diffusers' source in .venv-flux2)."""
    import ast
    import glob
    import inspect

    from family_parity import DIFFUSERS_PYTHON

    from vae_trainer.models.autoencoder_dc import AutoencoderDC

    sources = glob.glob(os.path.join(os.path.dirname(os.path.dirname(DIFFUSERS_PYTHON)), "lib", "python*",
                                     "site-packages", "diffusers", "models", "autoencoders", "autoencoder_dc.py"))
    if not sources:
        pytest.skip(f"no diffusers AutoencoderDC source beside {DIFFUSERS_PYTHON}")
    tree = ast.parse(open(sources[0]).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    theirs = {a.arg: ast.literal_eval(d) for a, d in zip(init.args.args[1:], init.args.defaults)}
    ours = {name: p.default for name, p in inspect.signature(AutoencoderDC.__init__).parameters.items()
            if name != "self"}
    assert list(ours) == list(theirs) and ours == theirs


def test_paddle_folders_and_from_pretrained_round_trip(parity, tmp_path):
    """ppdiffusers' own save_pretrained / from_pretrained (Paddle weights, or a diffusers folder with
    from_diffusers=True, which leaves the BatchNorm counters at 0: ppdiffusers' conversion drops them)."""
    from vae_trainer.models.autoencoder_dc import AutoencoderDC

    case = parity["in_mix"]
    x = case["inputs"]["images"]
    expected = run_ours(case["ours"], x)
    case["ours"].save_pretrained(str(tmp_path / "paddle"))
    for folder, kwargs in ((tmp_path / "paddle", {}), (os.path.join(case["folder"], "..", "ours"),
                                                       {"from_diffusers": True})):
        loaded = AutoencoderDC.from_pretrained(str(folder), **kwargs)
        assert not loaded.training
        assert_close(run_ours(loaded, x), expected, ("latent", "decoded"), atol=0)


def test_fresh_weights_are_drawn_like_pytorch_defaults():
    """Conv / Linear weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as a fresh diffusers model's; norms 1 / 0."""
    import paddle

    from vae_trainer.models.autoencoder_dc import ChannelRMSNorm, TorchBatchNorm2D

    paddle.seed(0)
    model = build(CONFIGS["deep"])
    for name, layer in model.named_sublayers():
        if isinstance(layer, (paddle.nn.Conv2D, paddle.nn.Linear)):
            weight = layer.weight.numpy()
            fan_in = weight.shape[0] if isinstance(layer, paddle.nn.Linear) else np.prod(weight.shape[1:])
            bound = 1 / np.sqrt(fan_in)
            for values in (weight, None if layer.bias is None else layer.bias.numpy()):
                if values is not None:
                    assert np.abs(values).max() <= bound, name
            if weight.size >= 2000:
                assert abs(weight.std() / (bound / np.sqrt(3)) - 1) < 0.1, name
        elif isinstance(layer, (ChannelRMSNorm, TorchBatchNorm2D)):
            assert (layer.weight.numpy() == 1).all() and (layer.bias.numpy() == 0).all(), name
