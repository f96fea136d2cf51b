"""Standalone VAE evaluation: reconstruction metrics, rFID, latent diagnostics and statistics of a saved VAE.

    python scripts/eval_vae.py --vae out/vae --data data/filelist --resolution 256 --num_images 1000 \\
        --output_dir eval_out [--inception_weights weights/fid_inception_v3.pdparams]
    python scripts/eval_vae.py --vae wan_vae --data DIR_OF_CLIPS --num_frames 17 [--frame_stride 2] ...
    python scripts/eval_vae.py --vae out/tiny/vae --teacher sdxl/vae --data data/filelist --output_dir eval_out

Prints the protocol once and a table, and writes metrics.json (the numbers, the protocol, the settings) and
reconstructions.png (RGBA images on a checkerboard) to --output_dir. Data parallel under `python -m paddle.distributed.launch`: each process
decodes its share of the same images, rank 0 prints and writes. Flags and protocol: docs/measuring.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from types import SimpleNamespace
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from vae_trainer.console import quiet_third_party  # noqa: E402

quiet_third_party()  # before Paddle, PaddleNLP and ppdiffusers are imported

if __name__ == "__main__":  # first: Paddle, imported below, reads OMP_NUM_THREADS only once
    from vae_trainer.threads import set_default_threads

    set_default_threads(sys.argv[1:])

import paddle  # noqa: E402
from PIL import Image  # noqa: E402

from vae_trainer.data.dataset import build_eval_dataloader  # noqa: E402
from vae_trainer.distributed import init_distributed, rank, run_and_exit, world_size  # noqa: E402
from vae_trainer.evaluation import (EvalResult, eval_batch_size, evaluate_vae,  # noqa: E402
                                    protocol_of, result_record)
from vae_trainer.flag_checks import DEFAULT_TILE_SIZE, check_tiling_flags  # noqa: E402
from vae_trainer.refusals import refuse  # noqa: E402
from vae_trainer.objectives.clips import CLIPS_NO_INPUT_SIZE, CLIPS_NO_RFID  # noqa: E402
from vae_trainer.models.dinov2 import INPUT_CONVENTIONS, load_dinov2  # noqa: E402
from vae_trainer.models.families import check_reconstruction_shape, family_of  # noqa: E402
from vae_trainer.models.lpips import DEFAULT_LPIPS_WEIGHTS  # noqa: E402
from vae_trainer.user_errors import exit_on_user_error, start_up  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", required=True,
                        help="a VAE folder (ours, ppdiffusers or PyTorch diffusers), an original single-file "
                             "checkpoint, or a config JSON (an untrained baseline)")
    parser.add_argument("--subfolder", default=None, help="e.g. 'vae' inside a pipeline directory")
    parser.add_argument("--vae_config_file", default=None,
                        help="the VAE's config (e.g. configs/sdxl_vae.json) for a single-file checkpoint whose config "
                             "cannot be inferred from its tensors (SDXL's scaling factor, FLUX, non-SD widths)")
    parser.add_argument("--data", required=True, help="filelist or image folder")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--input_size", type=int, nargs=2, default=None, metavar=("H", "W"),
                        help="the encoder sees the images resized to HxW (a VAE trained with --input_size)")
    parser.add_argument("--num_images", type=int, default=1000,
                        help="total over all processes (clips with --num_frames)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="per process (default: as many images as hold the pixels of 8 images of 256 px, 1 to "
                             "8: 8 up to 256 px, 2 from 419 to 512 px, 1 above 512 px); the numbers do not depend "
                             "on it")
    parser.add_argument("--eval_tiled", action="store_true",
                        help="encode and decode images larger than --eval_tile_size tile by tile (ppdiffusers' "
                             "tiled VAE, for 1024 px and larger); the protocol says when tiling was used")
    parser.add_argument("--eval_tile_size", type=int, default=None,
                        help="tile size in pixels for --eval_tiled (default 512; a multiple of 4 x the VAE's "
                             "downsampling factor)")
    parser.add_argument("--sample_posterior", action="store_true", help="decode a posterior sample instead of its mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lpips_weights", default=None, help=f"default {DEFAULT_LPIPS_WEIGHTS} if it exists")
    parser.add_argument("--skip_lpips", action="store_true", help="do not compute LPIPS")
    parser.add_argument("--inception_weights", default=None,
                        help="converted FID Inception .pdparams (scripts/convert_inception_weights.py); rFID is "
                             "skipped without it")
    parser.add_argument("--vf_model_path", default=None,
                        help="a DINOv2 (transformers folder, timm / torch-hub state dict): adds vf_alignment_cka")
    parser.add_argument("--vf_input_convention", choices=INPUT_CONVENTIONS, default=None,
                        help="what the DINOv2 sees, as the training's flag: imagenet (the default) or vavae "
                             "(VA-VAE's [-1, 1] images, not normalised)")
    parser.add_argument("--num_frames", type=int, default=1,
                        help="> 1: evaluate clips, each video's first window of N frames (a video VAE; Wan / "
                             "Qwen-Image / HunyuanVideo 1.5: 1 + 4k, LTX-2: 1 + 8k); adds flicker and "
                             "psnr_position_0..k")
    parser.add_argument("--frame_stride", type=int, default=1, help="with --num_frames: every K-th frame")
    parser.add_argument("--teacher", default=None,
                        help="a distilled student's teacher VAE folder: the student (--vae, an AutoencoderTiny) "
                             "decodes the teacher's normalised latents; adds psnr/ssim/lpips_vs_teacher, latent_mse, "
                             "the teacher's own psnr/ssim/lpips and both decode times")
    parser.add_argument("--teacher_subfolder", default=None, help="e.g. 'vae' inside the teacher's pipeline folder")
    parser.add_argument("--grid_images", type=int, default=8, help="images (clips: frame strips) in the grid")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    try:
        if args.vf_input_convention and not args.vf_model_path:
            raise ValueError("--vf_input_convention: it sets what the DINOv2 of --vf_model_path sees, which is not "
                             "given: add it, or drop it")
        if args.num_frames > 1 and args.inception_weights:
            raise ValueError(f"--inception_weights: {CLIPS_NO_RFID}")
        if args.num_frames > 1 and args.input_size:
            raise ValueError(f"--input_size: {CLIPS_NO_INPUT_SIZE}")
        if args.teacher and (args.num_frames > 1 or args.input_size or args.sample_posterior):
            raise ValueError("--teacher: a student decodes its teacher's latents of whole images: drop --num_frames, "
                             "--input_size and --sample_posterior")
        check_tiling_flags(args, None, "the VAE's config")  # the VAE's factor: once it is loaded
        args.batch_size = eval_batch_size(args.resolution, args.batch_size, flag="--batch_size")  # as recorded
    except ValueError as error:
        parser.error(str(error))
    return args


def check_clip_flags(args: argparse.Namespace, family, geometry) -> None:
    """--num_frames / --frame_stride (and --vf_model_path with clips) against the VAE's family and `geometry`:
    training's refusals, the training flags eval_vae.py does not have at their defaults."""
    from vae_trainer.argument_parser import REFUSALS
    from vae_trainer.arguments import DataArguments, LossArguments, ModelArguments

    defaults = {f.name: f.default for cls in (ModelArguments, DataArguments, LossArguments)
                for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    flags = SimpleNamespace(**{**defaults, "num_frames": args.num_frames, "frame_stride": args.frame_stride,
                               "vf_model_path": args.vf_model_path, "vf_weight": 0.0,  # (no VF loss: the CKA alone)
                               "eval_steps": None, "family": family, "family_known": True, "video": geometry.frames,
                               "single_frames": args.num_frames == 1, "frozen_latent": not geometry.encoder_trains,
                               "distils": False})
    given = {"num_frames", "frame_stride"} | ({"vf_model_path"} if args.vf_model_path else set())
    refuse(flags, given, REFUSALS)


def load_vae(args: argparse.Namespace):
    """A saved VAE (local only), or a config JSON for an untrained baseline seeded by --seed."""
    from vae_trainer.models.vae_loading import build_vae

    if args.vae.endswith(".json"):
        paddle.seed(args.seed)
        return build_vae(vae_config_file=args.vae)
    return build_vae(args.vae_config_file, pretrained_model_name_or_path=args.vae, subfolder=args.subfolder)


def load_teacher(path: str, subfolder: str | None, student):
    """The teacher of a distilled `student` (its latents' channels checked against the student's)."""
    from vae_trainer.models.teacher import load_teacher as load

    teacher = load(path, subfolder)
    channels = family_of(student).geometry(student.config).latent_channels
    if teacher.latent_channels != channels:
        raise ValueError(f"--teacher {path}: its latents have {teacher.latent_channels} channels, the student's "
                         f"{channels}: not this student's teacher")
    return teacher


def load_lpips(args: argparse.Namespace):
    """The LPIPS layer, or None (with a message) when skipped or no weights are available."""
    weights = args.lpips_weights or (DEFAULT_LPIPS_WEIGHTS if os.path.exists(DEFAULT_LPIPS_WEIGHTS) else None)
    if args.skip_lpips or weights is None:
        print("LPIPS skipped" + ("" if args.skip_lpips else f": no {DEFAULT_LPIPS_WEIGHTS}"))
        return None
    from vae_trainer.models.lpips import LPIPS

    return LPIPS(weights_path=weights)


def load_inception(args: argparse.Namespace):
    if args.inception_weights is None:
        print("rFID skipped: pass --inception_weights (see scripts/convert_inception_weights.py)")
        return None
    from vae_trainer.models.inception import load_fid_inception

    return load_fid_inception(args.inception_weights)


def format_table(result: EvalResult, held: Sequence[tuple] = (),
                 scale_keys: Sequence[str] = ("scaling_factor", "shift_factor")) -> str:
    """The metrics and latent statistics; the suggested scaling / shift factor where the VAE's config has one
    (`scale_keys`); `held`: (label, values) rows of what the weights hold beside the measured ones (FLUX.2's bn)."""
    def values(numbers, sign=""):
        return " ".join(f"{v:{sign}.3f}" for v in numbers)

    rows = [(name, f"{value:.4f}") for name, value in sorted(result.metrics.items())]
    rows.append(("images", str(result.num_images)))
    rows += [(key, f"{getattr(result, key):.5f}") for key in ("scaling_factor", "shift_factor") if key in scale_keys]
    rows += [("latent_mean", values(result.latent_mean, "+")), ("latent_std", values(result.latent_std))]
    rows += [(label, values(numbers, "+" if "mean" in label else "")) for label, numbers in held]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


@exit_on_user_error
def main(argv: list[str] | None = None) -> EvalResult:
    args = parse_args(argv)
    paddle.set_device(f"gpu:{paddle.distributed.ParallelEnv().device_id}" if paddle.is_compiled_with_cuda() else "cpu")
    init_distributed()
    tiling = (args.eval_tile_size or DEFAULT_TILE_SIZE) if args.eval_tiled else None
    with start_up():  # a VAE or images that cannot be read, sizes it cannot take: one `error: ...` line
        vae = load_vae(args)
        check_reconstruction_shape(vae.config, args.input_size, args.resolution)
        check_tiling_flags(args, vae.config, "the VAE's config")
        family, geometry = family_of(vae), family_of(vae).geometry(vae.config)
        check_clip_flags(args, family, geometry)
        if args.sample_posterior and geometry.deterministic:
            raise ValueError(f"--sample_posterior: {type(vae).__name__} encodes deterministically, it has no "
                             "posterior to sample; drop it")
        frames = {"num_frames": args.num_frames, "frame_stride": args.frame_stride}
        dataloader = build_eval_dataloader(args.data, args.resolution, args.batch_size, rank(), world_size(),
                                           args.num_images, channels=geometry.channels,
                                           **(frames if args.num_frames > 1 else {}))
        convention = args.vf_input_convention or "imagenet"
        vf_model = load_dinov2(args.vf_model_path, convention) if args.vf_model_path else None
        teacher = load_teacher(args.teacher, args.teacher_subfolder, vae) if args.teacher else None
    result = evaluate_vae(vae, dataloader, lpips=load_lpips(args), inception=load_inception(args),
                          sample_posterior=args.sample_posterior, seed=args.seed, grid_images=args.grid_images,
                          input_size=args.input_size, tiling=tiling, vf_model=vf_model, teacher=teacher)
    if rank() == 0:
        protocol = protocol_of(vae, result, resolution=args.resolution, sample_posterior=args.sample_posterior,
                               seed=args.seed, input_size=args.input_size, tiling=tiling, teacher=args.teacher or "",
                               **frames)
        normalisation = family.normalisation
        table = format_table(result, normalisation.held_rows(vae, result) if normalisation.held else (),
                             normalisation.keys)
        print(f"protocol:\n{protocol.text()}\n\n{table}")
        summary = {**result_record(result, protocol), "settings": vars(args)}
        if normalisation.held:  # FLUX.2's VAE: the latent normalisation it holds, beside the measured one
            summary["latent_normalisation"] = normalisation.record(vae, {})[0]["latent_normalisation"]
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump(summary, f, indent=2)
        Image.fromarray(result.grid).save(os.path.join(args.output_dir, "reconstructions.png"))
        print(f"wrote metrics.json and reconstructions.png to {args.output_dir}")
    return result


if __name__ == "__main__":
    run_and_exit(main)  # ends a multi-process evaluation in a defined order (vae_trainer/distributed.py)
