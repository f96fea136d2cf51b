"""Turn the RAE authors' own files into a diffusers `AutoencoderRAE` folder that this trainer fine-tunes and that
ppdiffusers' and PyTorch diffusers' `from_pretrained` load.

    python scripts/convert_rae.py --decoder model.pt --stats stat.pt --encoder /models/dinov2-with-registers-base \
        --output_dir /models/rae-dinov2-b-vitxl

--decoder: a decoder's weights as the authors save them (bytetriper/RAE: extract_decoder.py's GeneralDecoder state
dict, e.g. their release's decoders/dinov2/wReg_base/ViTXL_n08/model.pt), or a stage-1 training checkpoint
(ep-*.pt: --weights ema, the default, or model). --stats: the latent statistics it was trained with (stat.pt:
{"mean", "var"} per channel and position), stored as diffusers converts them, latents_std = sqrt(var + 1e-5);
without it the folder normalises nothing. --encoder: the DINOv2 with registers it was trained on (a transformers
folder such as facebook/dinov2-with-registers-base, or a timm / torch-hub file). The decoder's sizes come from its
weights, its attention heads from the released widths (ViT-B 12, ViT-L 16, ViT-XL 16) unless --decoder_heads.
Nothing is downloaded; torch is not needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from vae_trainer.console import quiet_third_party  # noqa: E402

quiet_third_party()  # before Paddle, PaddleNLP and ppdiffusers are imported

import numpy as np  # noqa: E402

from vae_trainer.models.autoencoder_rae import (authors_decoder_state, decoder_sizes_from_authors,  # noqa: E402
                                                decoder_state_from_authors, encoder_state_from_dinov2)
from vae_trainer.models.families.rae import RAE  # noqa: E402
from vae_trainer.models.torch_files import read_state_dict  # noqa: E402
from vae_trainer.models.vae_saving import save_vae  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoder", required=True, help="the authors' decoder model.pt (or a training ep-*.pt)")
    parser.add_argument("--stats", default=None, help="the authors' stat.pt the decoder was trained with")
    parser.add_argument("--encoder", required=True, help="the DINOv2-with-registers it was trained on")
    parser.add_argument("--output_dir", required=True, help="the AutoencoderRAE folder to write")
    parser.add_argument("--weights", choices=("ema", "model"), default="ema",
                        help="of a training checkpoint: its EMA (the authors' released weights) or raw weights")
    parser.add_argument("--encoder_input_size", type=int, default=224, help="the encoder's input side (RAE: 224)")
    parser.add_argument("--decoder_heads", type=int, default=None, help="attention heads of a decoder of another width")
    parser.add_argument("--noise_tau", type=float, default=0.8,
                        help="the training noise it was trained with (RAE's n08 decoders: 0.8); a fine-tune's default")
    parser.add_argument("--scaling_factor", type=float, default=1.0, help="the exported scaling_factor")
    return parser.parse_args(argv)


def read_decoder(path: str, weights: str) -> dict:
    """The decoder's state dict in the authors' names (a training checkpoint's `weights` entry)."""
    state = read_state_dict(path)
    if isinstance(state.get("ema"), dict) or isinstance(state.get("model"), dict):
        if not isinstance(state.get(weights), dict):
            raise ValueError(f"--decoder {path}: a training checkpoint without its {weights!r} weights")
        state = state[weights]
    state = state.get("state_dict", state)
    return authors_decoder_state(state)


def read_statistics(path: Optional[str], shape: List[int]) -> dict:
    """{latents_mean, latents_std} of stat.pt (float32 lists of the latent's (C, h, w), or (C, 1, 1))."""
    if path is None:
        return {}
    stats = read_state_dict(path)
    if "mean" not in stats or "var" not in stats:
        raise ValueError(f"--stats {path}: expected RAE's stat.pt, {{'mean': ..., 'var': ...}}; it holds "
                         f"{sorted(stats)}")
    mean, variance = np.asarray(stats["mean"], np.float32), np.asarray(stats["var"], np.float32)
    if mean.shape != variance.shape or list(mean.shape) not in (shape, [shape[0], 1, 1]):
        raise ValueError(f"--stats {path}: mean {list(mean.shape)} and var {list(variance.shape)}, expected the "
                         f"latent's shape {shape} (per channel and position, as RAE's calculate_stat.py writes it)")
    latents_std = np.sqrt(variance.astype(np.float64) + RAE.normalisation.eps).astype(np.float32)
    return {"latents_mean": mean.tolist(), "latents_std": latents_std.tolist()}


def convert(args: argparse.Namespace) -> str:
    """Write the folder; returns its path."""
    decoder = read_decoder(args.decoder, args.weights)
    try:
        sizes = decoder_sizes_from_authors(decoder, args.decoder_heads)
    except ValueError as error:
        raise ValueError(f"--decoder {args.decoder}: {error}: give them, --decoder_heads N") from None
    encoder, encoder_sizes = encoder_state_from_dinov2(args.encoder)
    if encoder_sizes["encoder_hidden_size"] != sizes["encoder_hidden_size"]:
        raise ValueError(f"--decoder {args.decoder} decodes {sizes['encoder_hidden_size']}-wide tokens, --encoder "
                         f"{args.encoder} makes {encoder_sizes['encoder_hidden_size']}-wide ones: not its encoder")
    grid = args.encoder_input_size // encoder_sizes["encoder_patch_size"]
    config = {"_class_name": RAE.class_name, **sizes, **encoder_sizes, "encoder_input_size": args.encoder_input_size,
              "noise_tau": args.noise_tau, "scaling_factor": args.scaling_factor,
              **read_statistics(args.stats, [sizes["encoder_hidden_size"], grid, grid])}
    vae = RAE.build(config, args.decoder)
    try:
        vae.set_state_dict({**vae.state_dict(), **encoder, **decoder_state_from_authors(decoder, vae)})
    except ValueError as error:
        raise ValueError(f"--decoder {args.decoder}: {error}") from None
    save_vae(vae, args.output_dir)
    print(f"wrote {args.output_dir}: AutoencoderRAE, decoder {sizes['decoder_num_hidden_layers']} x "
          f"{sizes['decoder_hidden_size']} (patch {sizes['patch_size']}, {grid * sizes['patch_size']} px), encoder "
          f"{args.encoder}, latent statistics {'from ' + args.stats if args.stats else 'unset'}")
    return args.output_dir


@exit_on_user_error
def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    with start_up():  # a missing file or a wrong one: one error line
        return convert(args)


if __name__ == "__main__":
    main()
