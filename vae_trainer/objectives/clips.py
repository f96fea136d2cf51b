"""What the objective does on clips [B, C, T, H, W] (docs/training.md, "On clips"): per-frame terms on the clip's
frames (`frames`), the temporal term (--temporal_loss_weight), LPIPS on K frames of each clip (--lpips_num_frames);
the refusals of the clip flags and of what a video VAE's temporal weights, which images never train, cannot take."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import paddle

from ..refusals import FAMILY, SINGLE_FRAMES

Tensor = paddle.Tensor
MAX_GROUP_FRAMES = 8  # a latent frame codes a group of 4 frames after frame 0, of 8 for LTX-2 (`Geometry.frames`)
_LPIPS_STREAM = 0x4C504653  # "LPFS": the LPIPS frame subsets' draws, apart from any other use of the seed
CLIPS_NO_RFID = ("rFID is defined on images and clips are evaluated (--num_frames > 1); rFVD is not provided (it needs "
                 "I3D weights, which nothing here downloads): drop it")
CLIPS_NO_INPUT_SIZE = "the encoder's input size is for images; clips are encoded at --resolution: drop it"


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("weight_decay",), lambda f: f.video and f.single_frames and f.loads_weights and f.weight_decay > 0,
     "it would shrink the loaded temporal weights of this video VAE that images never train (earlier-frame kernel "
     "taps get a zero gradient, and decay alone would move them), changing its video decoding: drop it (it is the "
     "discriminator's decay too)"),
    (("fp16_opt_level",), lambda f: f.video and f.single_frames and f.loads_weights and f.fp16_opt_level == "O2",
     "O2 keeps the weights in half precision, so the temporal weights of this video VAE that images never train would "
     "come back rounded: use O1 (float32 weights, half-precision compute)"),
    (("num_frames", "frame_stride"), lambda f: min(f.num_frames, f.frame_stride) < 1, "it must be >= 1"),
    (("num_frames",), lambda f: f.num_frames > 1 and not f.video and f.family_known,
     f"{FAMILY} encodes images, not clips (a video VAE does: docs/fine-tuning.md, \"Fine-tuning on clips\"); drop it"),
    (("num_frames",), lambda f: f.num_frames > 1 and f.video and (f.num_frames - 1) % f.video,
     lambda f: f"{FAMILY}'s causal layout codes the first frame alone, then groups of {f.video}: it takes 1 + "
               f"{f.video}k frames ({', '.join(str(1 + f.video * n) for n in range(1, 5))})"),
    (("frame_stride", "temporal_loss_weight", "lpips_num_frames"),
     lambda f: f.single_frames and (f.frame_stride != 1 or f.temporal_loss_weight or f.lpips_num_frames),
     SINGLE_FRAMES + "drop it, or train on clips"),
    (("video_image_ratio",), lambda f: f.num_frames == 1 and f.video_image_ratio, SINGLE_FRAMES + "add --num_frames N"),
    (("disc_type",), lambda f: f.single_frames and f.disc_type == "patchgan3d",
     SINGLE_FRAMES + "a 3-D discriminator of them is a 2-D one: use --disc_type patch, or train on clips"),
    (("video_image_ratio",), lambda f: not 0 <= f.video_image_ratio <= 1, "it is a share in [0, 1]"),
    (("temporal_loss_weight",), lambda f: f.temporal_loss_weight < 0, "it must be >= 0 (0: off)"),
    (("lpips_num_frames",), lambda f: not 0 <= f.lpips_num_frames <= f.num_frames,
     "it is a number of frames per clip: 0 (every frame) to --num_frames"),
    (("lpips_num_frames",), lambda f: f.lpips_num_frames and f.perceptual_weight == 0,
     "--perceptual_weight 0 turns LPIPS off: drop it"),
    (("equivariance_prob", "vf_model_path"), lambda f: f.num_frames > 1 and (f.equivariance_prob or f.vf_model_path),
     "EQ-VAE's transforms and the VF alignment are defined on images, not clips: drop it, or --num_frames"),
    (("inception_weights",), lambda f: f.inception_weights and f.num_frames > 1, CLIPS_NO_RFID),
    (("input_size",), lambda f: f.input_size is not None and f.num_frames > 1, CLIPS_NO_INPUT_SIZE),
)


# How its metrics are made (evaluation.py states them in the protocol).
DEFINITIONS = {
    "flicker": "mean |(x[t+1] - x[t]) - (x_hat[t+1] - x_hat[t])| on [0, 1] over the pixels, channels and neighbouring "
               "frame pairs of every clip (0: the same error in every frame)",
    "psnr_position_0": "mean PSNR of each clip's first frame (the causal VAE codes it alone)",
    **{f"psnr_position_{p}": f"mean PSNR of frames {p}, {p} + k, ...: place {p} in the later groups of k frames that "
       "one latent frame codes (k the VAE's temporal factor: 4, LTX-2's 8)" for p in range(1, MAX_GROUP_FRAMES + 1)},
}


def lpips_subset(seed: int, step: int, micro_batch: int, shape: Sequence[int], k: int) -> Optional[np.ndarray]:
    """The rows of `frames(x)` LPIPS scores for a batch of `shape`: K frames of each clip, drawn from (seed, step,
    micro-batch) alone (both drivers and a resume draw the same), or None: every frame (K = 0, images)."""
    if len(shape) == 4 or not 0 < k < shape[2]:
        return None
    rng, t = np.random.default_rng([_LPIPS_STREAM, seed, step, micro_batch]), shape[2]
    return np.concatenate([clip * t + np.sort(rng.choice(t, k, replace=False)) for clip in range(shape[0])])


def flicker(x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    """Per clip [B]: mean |(x[t+1] - x[t]) - (y[t+1] - y[t])| of clips [B, C, T, H, W] (0: a constant error): the
    metric on [0, 1] clips; its mean over the clips, of [-1, 1] ones, is the temporal term."""
    error = x.astype("float32") - y.astype("float32")
    change = (error[:, :, 1:] - error[:, :, :-1]).abs()
    return change.reshape([change.shape[0], -1]).mean(axis=1)


def add_position_psnrs(metrics, frame_psnr: Tensor, clips: int, group: int) -> None:
    """psnr_position_0..group of the PSNRs [clips * T] of `clips` clips' frames (frame t of clip b at b * T + t) into
    `metrics` (a MetricAccumulator): each frame's place in the causal layout, 0 for frame 0, then 1..group within
    each later group of `group` frames (the VAE's temporal factor)."""
    by_clip = frame_psnr.numpy().reshape([clips, -1])
    places = np.array([0] + [(t - 1) % group + 1 for t in range(1, by_clip.shape[1])])
    for place in sorted(set(places)):
        metrics.update(f"psnr_position_{place}", by_clip[:, places == place])
