"""The Paddle FID InceptionV3 against pytorch-fid's torch model with identical random weights.

The reference is pytorch-fid 0.3.0's own ``InceptionV3([3])`` (its FID-patched blocks and its
forward: resize, normalise, pool). pytorch-fid builds on torchvision, whose PyPI wheels do not run
beside the torch CPU wheel used here, so when torchvision is missing a small stand-in module provides
the few torchvision pieces pytorch-fid touches: ``inception_v3`` (the layer container, no forward)
and the ``InceptionA/C/E`` base classes whose ``__init__`` builds the layers that pytorch-fid's
``forward`` overrides use. That stand-in is a second transcription of torchvision's layer shapes;
``load_fid_inception`` additionally checks every shape of the converted file.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import paddle
import pytest
from conftest import import_test_extra, load_script
from skimage import data as skimage_data
from skimage.transform import resize

from vae_trainer.models.inception import FIDInceptionV3, load_fid_inception

torch = import_test_extra(
    "torch", reason="torch is needed for the reference model: pip install -r requirements-test.txt"
)
nn = torch.nn


def _conv(in_channels: int, out_channels: int, **kwargs) -> nn.Module:
    return _BasicConv2d(in_channels, out_channels, **kwargs)


class _BasicConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, **kwargs) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _InceptionA(nn.Module):
    def __init__(self, in_channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = _conv(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = _conv(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = _conv(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = _conv(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = _conv(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = _conv(96, 96, kernel_size=3, padding=1)
        self.branch_pool = _conv(in_channels, pool_features, kernel_size=1)


class _InceptionB(nn.Module):
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3 = _conv(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = _conv(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = _conv(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = _conv(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        pooled = nn.functional.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([self.branch3x3(x), dbl, pooled], 1)


class _InceptionC(nn.Module):
    def __init__(self, in_channels: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = _conv(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = _conv(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = _conv(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = _conv(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = _conv(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = _conv(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = _conv(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = _conv(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = _conv(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = _conv(in_channels, 192, kernel_size=1)


class _InceptionD(nn.Module):
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3_1 = _conv(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = _conv(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = _conv(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = _conv(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = _conv(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = _conv(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        pooled = nn.functional.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, pooled], 1)


class _InceptionE(nn.Module):
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch1x1 = _conv(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = _conv(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = _conv(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = _conv(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = _conv(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = _conv(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = _conv(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = _conv(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = _conv(in_channels, 192, kernel_size=1)


class _Inception3(nn.Module):
    """Layer container with torchvision's names; pytorch-fid swaps in its FID blocks."""

    def __init__(self, num_classes: int = 1000, aux_logits: bool = True, **_ignored) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = _conv(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = _conv(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = _conv(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = _conv(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = _conv(80, 192, kernel_size=3)
        self.Mixed_5b = _InceptionA(192, pool_features=32)
        self.Mixed_5c = _InceptionA(256, pool_features=64)
        self.Mixed_5d = _InceptionA(288, pool_features=64)
        self.Mixed_6a = _InceptionB(288)
        self.Mixed_6b = _InceptionC(768, channels_7x7=128)
        self.Mixed_6c = _InceptionC(768, channels_7x7=160)
        self.Mixed_6d = _InceptionC(768, channels_7x7=160)
        self.Mixed_6e = _InceptionC(768, channels_7x7=192)
        self.Mixed_7a = _InceptionD(768)
        self.Mixed_7b = _InceptionE(1280)
        self.Mixed_7c = _InceptionE(2048)
        self.fc = nn.Linear(2048, num_classes)


def _torchvision_stand_in() -> types.ModuleType:
    torchvision = types.ModuleType("torchvision")
    torchvision.__version__ = "0.20.0"
    models = types.ModuleType("torchvision.models")
    inception = types.ModuleType("torchvision.models.inception")
    inception.InceptionA, inception.InceptionC, inception.InceptionE = (
        _InceptionA,
        _InceptionC,
        _InceptionE,
    )
    models.inception = inception
    models.inception_v3 = _Inception3
    torchvision.models = models
    return torchvision


@pytest.fixture
def pytorch_fid_inception(monkeypatch):
    """pytorch_fid.inception, imported with real torchvision if it works, else the stand-in."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        stand_in = _torchvision_stand_in()
        monkeypatch.setitem(sys.modules, "torchvision", stand_in)
        monkeypatch.setitem(sys.modules, "torchvision.models", stand_in.models)
        monkeypatch.setitem(sys.modules, "torchvision.models.inception", stand_in.models.inception)
        monkeypatch.delitem(sys.modules, "pytorch_fid.inception", raising=False)
    module = pytest.importorskip(
        "pytorch_fid.inception",
        reason="pytorch-fid is the reference: pip install --no-deps pytorch-fid==0.3.0",
    )
    yield module
    sys.modules.pop("pytorch_fid.inception", None)  # never leave a stand-in-backed copy cached


def _photos(size: int, names: tuple[str, ...] = ("astronaut", "chelsea")) -> np.ndarray:
    """Real photos, [N, 3, size, size] in [0, 1]."""
    photos = [getattr(skimage_data, name)() for name in names]
    resized = [resize(p, (size, size), anti_aliasing=True) for p in photos]
    return np.stack(resized).transpose(0, 3, 1, 2).astype(np.float32)


def _randomise_and_calibrate(reference, calibration_images) -> None:
    """Random conv/BN weights, then BN running stats set from data so activations stay O(1).

    Default-initialised BNs (mean 0, var 1) would let activations shrink layer by layer until any
    two implementations agree to 1e-4; calibrated statistics keep every feature meaningful.
    """
    for module in reference.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            # Positive shifts keep most ReLUs open: a random BN network with half its units
            # off is chaotic enough to blow float32 rounding up past 1e-4 by itself.
            nn.init.normal_(module.bias, 1.0, 0.2)
            module.reset_running_stats()
            module.momentum = None  # cumulative average: one pass sets the batch statistics
    reference.train()
    with torch.no_grad():
        reference(calibration_images)
    reference.eval()


@pytest.fixture
def converted_weights(tmp_path, pytorch_fid_inception, monkeypatch):
    """(torch reference model, path of the converted .pdparams) with random calibrated weights."""
    torch.manual_seed(0)
    built = []
    # fid_inception_v3() fetches the published weights by URL; hand it back its own state instead,
    # remembering the Inception3 whose state dict has the published file's layout.
    original_inception_v3 = pytorch_fid_inception._inception_v3

    def recording_inception_v3(*args, **kwargs):
        built.append(original_inception_v3(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(pytorch_fid_inception, "_inception_v3", recording_inception_v3)
    monkeypatch.setattr(
        pytorch_fid_inception, "load_state_dict_from_url", lambda *a, **k: built[-1].state_dict()
    )
    reference = pytorch_fid_inception.InceptionV3([3])
    # Calibrate on other photos than the ones compared, so the statistics are not a perfect fit.
    calibration = _photos(64, ("coffee", "rocket", "hubble_deep_field"))
    _randomise_and_calibrate(reference, torch.from_numpy(calibration))

    source = tmp_path / "pt_inception-random.pth"
    torch.save(built[-1].state_dict(), source)
    output = tmp_path / "weights" / "fid_inception_v3.pdparams"
    load_script("convert_inception_weights").main(["--source", str(source), "--output", str(output)])
    return reference, output


def test_paddle_port_matches_pytorch_fid_features(converted_weights):
    reference, weights_path = converted_weights
    images_01 = _photos(64)
    with torch.no_grad():
        expected = reference(torch.from_numpy(images_01))[0].squeeze(-1).squeeze(-1).numpy()

    paddle.set_device("cpu")
    model = load_fid_inception(weights_path)
    with paddle.no_grad():
        # The port takes [-1, 1]; pytorch-fid maps [0, 1] -> [-1, 1] itself.
        features = model(paddle.to_tensor(images_01 * 2 - 1)).numpy()

    assert features.shape == (2, 2048)
    assert expected.std() > 0.1, "reference features collapsed; the comparison would be vacuous"
    assert np.abs(features[0] - features[1]).max() > 0.1, "the two photos must give distinct features"
    np.testing.assert_allclose(features, expected, rtol=0, atol=1e-4)


def test_conversion_renames_batch_norm_buffers_and_drops_the_classifier():
    state = {
        "Conv2d_1a_3x3.conv.weight": np.ones((32, 3, 3, 3)),
        "Conv2d_1a_3x3.bn.running_mean": np.full(32, 2.0),
        "Conv2d_1a_3x3.bn.running_var": np.full(32, 3.0),
        "Conv2d_1a_3x3.bn.num_batches_tracked": np.array(7),
        "fc.weight": np.zeros((1008, 2048)),
        "fc.bias": np.zeros(1008),
    }
    converted = load_script("convert_inception_weights").convert_torch_state_dict(state)
    assert sorted(converted) == [
        "Conv2d_1a_3x3.bn._mean", "Conv2d_1a_3x3.bn._variance", "Conv2d_1a_3x3.conv.weight"
    ]
    assert converted["Conv2d_1a_3x3.bn._variance"][0] == 3.0
    assert set(converted) <= set(FIDInceptionV3().state_dict())


def test_loading_rejects_an_incomplete_weights_file(tmp_path):
    path = tmp_path / "partial.pdparams"
    full_state = FIDInceptionV3().state_dict()
    paddle.save({k: v for k, v in full_state.items() if not k.startswith("Mixed_7c")}, str(path))
    with pytest.raises(ValueError, match="missing keys"):
        load_fid_inception(path)
    name = "Conv2d_1a_3x3.conv.weight"
    paddle.save({**full_state, name: paddle.zeros([32, 3, 5, 5])}, str(path))
    with pytest.raises(ValueError, match=rf"{name} has shape \[32, 3, 5, 5\], expected \[32, 3, 3, 3\]"):
        load_fid_inception(path)
