"""Paddle side of the autoencoder-family parity checks: seeded diffusers models made, and run, by diffusers 0.42.1 in
.venv-flux2 (tests/diffusers_side.py in a subprocess; .venv's diffusers 0.32.2 has none of these classes)."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import REPO, REQUIRE_TEST_EXTRAS

DIFFUSERS_PYTHON = os.environ.get("VAE_TRAINER_FLUX2_PYTHON", os.path.join(REPO, ".venv-flux2", "bin", "python"))
DIFFUSERS_SIDE = os.path.join(REPO, "tests", "diffusers_side.py")


def diffusers_side(*args: str) -> None:
    if not os.path.isfile(DIFFUSERS_PYTHON):
        message = f"{DIFFUSERS_PYTHON} is missing: `make test` builds it (requirements-flux2-test.txt)"
        if os.environ.get(REQUIRE_TEST_EXTRAS) == "1":
            raise FileNotFoundError(message)
        pytest.skip(message)
    result = subprocess.run([DIFFUSERS_PYTHON, DIFFUSERS_SIDE, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def make_in_diffusers(class_name: str, folder, config: dict, seed: int = 0, variant: str | None = None) -> str:
    """A diffusers `class_name` folder with seeded weights moved off their initialisation."""
    diffusers_side("make", class_name, str(folder), "--config", json.dumps(config), "--seed", str(seed),
                   *(["--variant", variant] if variant else []))
    return str(folder)


def run_in_diffusers(class_name: str, folder, images: np.ndarray, work, latents: np.ndarray | None = None,
                     variant: str | None = None, tile: int | None = None, stride: int | None = None) -> dict:
    """What diffusers' `class_name` in `folder` makes of `images` (and decodes of `latents`): see diffusers_side.py."""
    np.save(os.path.join(work, "images.npy"), images)
    flags = ["--images", os.path.join(work, "images.npy"), "--out", os.path.join(work, "diffusers_out.npz")]
    if latents is not None:
        np.save(os.path.join(work, "latents.npy"), latents)
        flags += ["--latents", os.path.join(work, "latents.npy")]
    flags += ["--variant", variant] if variant else []
    flags += ["--tile", str(tile), "--stride", str(stride)] if tile else []
    diffusers_side("run", class_name, str(folder), *flags)
    result = dict(np.load(os.path.join(work, "diffusers_out.npz")))
    result["loading_info"] = json.loads(str(result["loading_info"]))
    return result


def assert_loaded_exactly(result: dict, class_name: str) -> None:
    """diffusers loaded the folder as `class_name` with no missing, unexpected or mismatched key."""
    info = result["loading_info"]
    assert info["class"] == class_name
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert info.get(key, []) == [], (key, info[key])
