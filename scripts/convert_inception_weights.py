"""Convert pytorch-fid's published InceptionV3 FID weights (torch state dict) to Paddle.

    python scripts/convert_inception_weights.py \\
        --source pt_inception-2015-12-05-6726825d.pth --output weights/fid_inception_v3.pdparams

The source file is the one pytorch-fid downloads (FID_WEIGHTS_URL in pytorch_fid/inception.py);
nothing is downloaded here. torch is needed only to read it and is imported only when this runs.
The result is checked by building ``FIDInceptionV3`` from it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from vae_trainer.models.inception import load_fid_inception  # noqa: E402

_BATCH_NORM_RENAMES = {"running_mean": "_mean", "running_var": "_variance"}  # torch -> Paddle BatchNorm buffers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="pt_inception-2015-12-05-*.pth (torch)")
    parser.add_argument("--output", default="weights/fid_inception_v3.pdparams")
    return parser.parse_args(argv)


def convert_torch_state_dict(torch_state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """pytorch-fid's Inception3 state dict (numpy arrays) in `FIDInceptionV3` names: convolutions (OIHW in both)
    and BatchNorms (buffers renamed); the classifier, unused by FID, dropped."""
    converted = {}
    for name, value in torch_state.items():
        if not name.startswith(("fc.", "AuxLogits.")) and not name.endswith("num_batches_tracked"):
            prefix, _, leaf = name.rpartition(".")
            converted[f"{prefix}.{_BATCH_NORM_RENAMES.get(leaf, leaf)}"] = np.asarray(value)
    return converted


def read_torch_state_dict(path: str) -> dict:
    import torch  # only the conversion needs torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return {name: tensor.detach().cpu().numpy() for name, tensor in state.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    converted = convert_torch_state_dict(read_torch_state_dict(args.source))
    output_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(output_dir, exist_ok=True)
    paddle.save({name: paddle.to_tensor(value) for name, value in converted.items()}, args.output)
    load_fid_inception(args.output)  # raises on missing/unexpected/mis-shaped parameters
    print(f"wrote {len(converted)} tensors to {args.output}")


if __name__ == "__main__":
    main()
