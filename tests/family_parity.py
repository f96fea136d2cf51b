"""Paddle side of the autoencoder-family parity checks: seeded diffusers models made, and run, by diffusers 0.42.1 in
.venv-flux2 (tests/diffusers_side.py in a subprocess; .venv's diffusers 0.32.2 has none of these classes); and what
the families' end-to-end tests share (their run flags, inputs, the PSNR of diffusers' reconstructions)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Callable, Mapping, Sequence

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
    diffusers_side(*_make_args(class_name, folder, config, seed, variant))
    return str(folder)


def run_in_diffusers(class_name: str, folder, images: np.ndarray, work, latents: np.ndarray | None = None,
                     variant: str | None = None, tile: int | None = None, stride: int | None = None,
                     more_images: Mapping[str, np.ndarray] | None = None, flags: Sequence[str] = ()) -> dict:
    """What diffusers' `class_name` in `folder` makes of `images` (and decodes of `latents`): see diffusers_side.py.
    `more_images` {name: array}: further inputs run in the same process (outputs keyed "name_..."); `flags`: more
    diffusers_side.py run options (--unclamped, --prelude FILE)."""
    diffusers_side(*_run_args(class_name, folder, images, work, latents, variant, tile, stride, more_images, flags))
    return _run_result(work)


class DiffusersBatch:
    """make_in_diffusers / run_in_diffusers calls queued and then done by one diffusers process (`flush`): each
    process spends seconds importing torch and diffusers, the tiny models' work takes milliseconds. Each run needs
    its own `work` folder; its result is there after the flush (`run` returns the function that reads it)."""

    def __init__(self, work) -> None:
        self.work = str(work)
        self.jobs: list[list[str]] = []
        self.run_folders: set[str] = set()

    def make(self, class_name: str, folder, config: dict, seed: int = 0, variant: str | None = None,
             stress: float = 1.0) -> str:
        self.jobs.append(_make_args(class_name, folder, config, seed, variant, stress))
        return str(folder)

    def run(self, class_name: str, folder, images: np.ndarray, work, latents: np.ndarray | None = None,
            variant: str | None = None, tile: int | None = None, stride: int | None = None,
            more_images: Mapping[str, np.ndarray] | None = None, flags: Sequence[str] = ()) -> Callable[[], dict]:
        assert str(work) not in self.run_folders, f"two runs in one work folder: {work}"
        self.run_folders.add(str(work))
        self.jobs.append(_run_args(class_name, folder, images, work, latents, variant, tile, stride, more_images,
                                   flags))
        return lambda: _run_result(work)

    def command(self, *args) -> None:
        """Any other diffusers_side.py command (dinov2, vit, rae_tokens, rae_release), queued as given."""
        self.jobs.append([str(arg) for arg in args])

    def flush(self) -> None:
        path = os.path.join(self.work, "diffusers_jobs.json")
        with open(path, "w") as handle:
            json.dump(self.jobs, handle)
        self.jobs = []
        diffusers_side("batch", path)


def _make_args(class_name: str, folder, config: dict, seed: int, variant: str | None,
               stress: float = 1.0) -> list[str]:
    return ["make", class_name, str(folder), "--config", json.dumps(config), "--seed", str(seed),
            *(["--variant", variant] if variant else []), *(["--stress", str(stress)] if stress != 1.0 else [])]


def _run_args(class_name: str, folder, images: np.ndarray, work, latents: np.ndarray | None, variant: str | None,
              tile: int | None, stride: int | None, more_images: Mapping[str, np.ndarray] | None,
              flags: Sequence[str]) -> list[str]:
    """run's command line; writes its input files into `work`."""
    np.save(os.path.join(work, "images.npy"), images)
    flags = ["--images", os.path.join(work, "images.npy"), "--out", os.path.join(work, "diffusers_out.npz"), *flags]
    if latents is not None:
        np.save(os.path.join(work, "latents.npy"), latents)
        flags += ["--latents", os.path.join(work, "latents.npy")]
    for name, array in (more_images or {}).items():
        np.save(os.path.join(work, f"more_{name}.npy"), array)
        flags += ["--more", f"{name}={os.path.join(work, f'more_{name}.npy')}"]
    flags += ["--variant", variant] if variant else []
    flags += ["--tile", str(tile), "--stride", str(stride)] if tile else []
    return ["run", class_name, str(folder), *flags]


def _run_result(work) -> dict:
    result = dict(np.load(os.path.join(work, "diffusers_out.npz")))
    result["loading_info"] = json.loads(str(result["loading_info"]))
    return result


def assert_loaded_exactly(result: dict, class_name: str) -> None:
    """diffusers loaded the folder as `class_name` with no missing, unexpected or mismatched key."""
    info = result["loading_info"]
    assert info["class"] == class_name
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert info.get(key, []) == [], (key, info[key])


def trainer_args(file_list, output_dir, **overrides) -> list[str]:
    """Flags for a few steps of a family's VAE at 32 px on CPU, either entry point: LPIPS, the GAN from step 3, EMA,
    accumulation 2 (an override of None drops that flag)."""
    args = {"file_list": file_list, "output_dir": output_dir, "resolution": 32, "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2, "max_steps": 4, "disc_start": 2, "logging_steps": 1, "save_steps": 2,
            "seed": 5, "device": "cpu", "dataloader_num_workers": 0, "disc_base_channels": 8,
            "learning_rate": 2e-3, "disable_tqdm": "true", "use_ema": "true", "ema_decay": 0.9}
    args.update(overrides)
    return [str(item) for key, value in args.items() if value is not None for item in (f"--{key}", value)]


def random_images(count: int = 2, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (count, 3, size, size)).astype(np.float32)


def folder_pixels(folder: str) -> np.ndarray:
    """The images of `folder` in name order, NCHW on [-1, 1] (as eval_vae.py reads same-size images)."""
    from PIL import Image

    names = sorted(os.listdir(folder))
    return np.stack([np.asarray(Image.open(os.path.join(folder, n)).convert("RGB"), np.float32) / 127.5 - 1
                     for n in names]).transpose(0, 3, 1, 2)


def mean_psnr(decoded: np.ndarray, pixels: np.ndarray) -> float:
    """eval_vae.py's PSNR of reconstructions `decoded` (clamped to [-1, 1]) of `pixels`, on [0, 1], image by image."""
    recon, target = (np.clip(decoded, -1, 1) + 1) / 2, (pixels + 1) / 2
    return float((10 * np.log10(1 / ((recon - target) ** 2).reshape(len(pixels), -1).mean(axis=1))).mean())


def assert_resume_is_exact(file_list: str, work, straight: str | None = None, in_process: bool = False,
                           **flags) -> None:
    """A run of `flags` stopped at step 2 and resumed by the other entry point ends with the weights of the run
    straight through (the Paddle export, bit for bit). `straight`: the output folder of that run straight through
    when a test has already made it (the plain loop's, trainer_args(file_list, ..., **flags));
    `in_process`: the runs call the entry points' main() in this process (conftest.run_in_process)."""
    from conftest import DRIVERS, run_entry_point, run_in_process
    from safetensors.numpy import load_file

    run = run_in_process if in_process else run_entry_point
    resumed = os.path.join(work, "resumed")
    if straight is None:
        straight = os.path.join(work, "straight")
        run(DRIVERS[1], trainer_args(file_list, straight, **flags))
    run(DRIVERS[1], trainer_args(file_list, resumed, **{**flags, "max_steps": 2}))
    run(DRIVERS[0], trainer_args(file_list, resumed, resume_from_checkpoint="latest", **flags))
    a, b = (load_file(os.path.join(out, "vae", "diffusion_paddle_model.safetensors")) for out in (straight, resumed))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
