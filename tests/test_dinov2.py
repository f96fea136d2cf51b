"""DINOv2 in Paddle (issue 31, item 1): patch tokens equal to transformers' DINOv2 to 1e-4, loaded from transformers
folders and from timm / torch-hub state dicts, at 224 and at another size (position embeddings resized).

The PyTorch side (tiny seeded models, their files and reference tokens) is made once by tests/dinov2_torch_side.py
in .venv-flux2 (transformers 5.24.0; requirements-flux2-test.txt), in one subprocess.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from conftest import REPO, REQUIRE_TEST_EXTRAS

FLUX2_PYTHON = os.environ.get("VAE_TRAINER_FLUX2_PYTHON", os.path.join(REPO, ".venv-flux2", "bin", "python"))
TORCH_SIDE = os.path.join(REPO, "tests", "dinov2_torch_side.py")
MEAN, STD = np.array([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1), np.array([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)
TOLERANCE = 1e-4

# (file in the reference folder, reference tokens, input images, patch_tokens size). "odd" images are 154 x 182,
# fed unresized (11 x 13 patches from a 16 x 16 stored grid); "256" images are resized to 224 by us and by torch.
CASES = [(folder, f"{folder}_{images}", images, None if images == "odd" else 224)
         for folder in ("plain", "reg", "swiglu", "w128", "w128reg") for images in ("224", "odd", "256")]
CASES += [("swiglu_bin", "swiglu_224", "224", 224), ("swiglu_bin", "swiglu_odd", "odd", None)]
for _file, _odd in (("w128_timm.safetensors", "w128_odd_timm"), ("w128_timm.pth", "w128_odd_timm"),
                    ("w128_hub.pth", "w128_odd_hub"), ("w128reg_timm.safetensors", "w128reg_odd"),
                    ("w128reg_timm.pth", "w128reg_odd"), ("w128reg_hub.pth", "w128reg_odd")):
    CASES += [(_file, _file.split("_")[0] + "_224", "224", 224), (_file, _odd, "odd", None)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not os.path.isfile(FLUX2_PYTHON):
        message = f"{FLUX2_PYTHON} is missing: `make test` builds it (requirements-flux2-test.txt)"
        if os.environ.get(REQUIRE_TEST_EXTRAS) == "1":
            raise FileNotFoundError(message)
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("dinov2")
    result = subprocess.run([FLUX2_PYTHON, TORCH_SIDE, str(folder)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return str(folder), dict(np.load(folder / "refs.npz"))


@pytest.mark.parametrize("name, ref_key, images, size", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_patch_tokens_match_transformers(reference, name, ref_key, images, size):
    import paddle

    from vae_trainer.models.dinov2 import load_dinov2

    folder, refs = reference
    model = load_dinov2(os.path.join(folder, name))
    pixels = refs[f"images_{images}"]
    with paddle.no_grad():
        tokens, grid = model.patch_tokens(paddle.to_tensor(pixels), size=size)
    expected = refs[ref_key]
    assert grid == ((11, 13) if images == "odd" else (16, 16))
    assert tokens.dtype == paddle.float32 and tuple(tokens.shape) == (2, grid[0] * grid[1], model.feature_dim)
    assert np.abs(tokens.numpy() - expected[:, 1 + model.registers:]).max() < TOLERANCE
    if images != "256":  # the whole sequence: cls and register tokens in their places too
        normalised = paddle.to_tensor((((pixels + 1) / 2 - MEAN) / STD).astype("float32"))
        with paddle.no_grad():
            assert np.abs(model(normalised).numpy() - expected).max() < TOLERANCE


def test_inferred_shapes(reference):
    from vae_trainer.models.dinov2 import load_dinov2

    folder, _ = reference
    for name, width, heads, registers, swiglu, mode in (
            ("plain", 48, 3, 0, False, "bicubic"), ("reg", 48, 3, 4, False, "antialias"),
            ("swiglu", 48, 3, 0, True, "bicubic"), ("w128_timm.safetensors", 128, 2, 0, False, "antialias"),
            ("w128_hub.pth", 128, 2, 0, False, "offset"), ("w128reg_timm.pth", 128, 2, 4, False, "antialias"),
            ("w128reg_hub.pth", 128, 2, 4, False, "antialias")):
        model = load_dinov2(os.path.join(folder, name))
        assert (model.feature_dim, model.blocks[0].heads, model.registers, model.blocks[0].swiglu,
                model.resize_mode, len(model.blocks), model.patch) == (width, heads, registers, swiglu, mode, 2, 14), \
            name


def test_resize_matrix_matches_torch_bicubic(reference):
    """The three position-embedding resizes (torch bicubic; antialias; the hub's scale factor) on a random grid."""
    from vae_trainer.models.dinov2 import resize_matrix

    _, refs = reference
    grid = refs["resize_grid"][0]
    keys = [k for k in refs if k.startswith("resize_") and k != "resize_grid"]
    assert len(keys) == 12
    for key in keys:
        _, mode, size = key.split("_")
        h, w = map(int, size.split("x"))
        ours = np.einsum("ih,chw,jw->cij", resize_matrix(16, h, mode), grid, resize_matrix(16, w, mode))
        assert np.abs(ours - refs[key][0]).max() < 1e-5, key


def test_frozen_and_gradients_reach_images_only(reference):
    import paddle

    from vae_trainer.models.dinov2 import load_dinov2

    model = load_dinov2(os.path.join(reference[0], "reg"))
    assert all(p.stop_gradient for p in model.parameters())
    images = paddle.to_tensor(reference[1]["images_224"], stop_gradient=False)
    tokens, _ = model.patch_tokens(images)
    tokens.sum().backward()
    assert images.grad is not None and float(images.grad.abs().sum()) > 0
    assert all(p.grad is None for p in model.parameters())


def test_pth_reads_without_torch(reference, monkeypatch):
    from vae_trainer.models.dinov2 import load_dinov2

    monkeypatch.setitem(sys.modules, "torch", None)  # any `import torch` would fail
    assert load_dinov2(os.path.join(reference[0], "w128reg_hub.pth")).registers == 4


def _pickle_zip(path, obj) -> str:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(obj, protocol=2))
    return str(path)


def test_bad_files_are_one_clear_error(tmp_path):
    from safetensors.numpy import save_file

    from vae_trainer.models.dinov2 import load_dinov2
    from vae_trainer.user_errors import USER_ERROR_TYPES

    save_file({"encoder.conv_in.weight": np.zeros((4, 3, 3, 3), np.float32)}, str(tmp_path / "vae.safetensors"))
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "empty_folder" / "config.json").write_text("{}")
    cases = [(tmp_path / "missing", FileNotFoundError, "not found"),
             (tmp_path / "vae.safetensors", ValueError, "not a DINOv2 checkpoint"),
             (tmp_path / "notes.pth", ValueError, "cannot read"),
             (tmp_path / "empty_folder", FileNotFoundError, "holds no"),
             # a pickle naming a callable is refused, never called
             (_pickle_zip(tmp_path / "evil.pth", {"x": os.system}), ValueError,
              "not part of a plain tensor state dict")]
    for path, error_type, words in cases:
        with pytest.raises(error_type) as raised:
            load_dinov2(str(path))
        assert isinstance(raised.value, USER_ERROR_TYPES)
        assert str(path) in str(raised.value) and words in str(raised.value), str(raised.value)
        assert "expected" in str(raised.value)
