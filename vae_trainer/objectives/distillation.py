"""The distillation part of the objective (docs/distillation.md): a tiny student's encoder against its teacher's
normalised latents (--latent_distill_weight, --latent_distill_loss), its decoder on the teacher's latents; the
metrics of the student beside its teacher; the refusals of the distillation flags. The teacher and its latent cache:
models/teacher.py."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import paddle

from ..refusals import FAMILY
from ..metrics import MetricAccumulator, psnr, ssim, to_unit_range

Tensor = paddle.Tensor
# How its metrics are made (evaluation.py states them in the protocol).
DEFINITIONS = {
    **{f"{name}_vs_teacher": f"{name} of the student's decode of the teacher's normalised posterior mode against the "
                             "teacher's decode of that mode, both clamped to [-1, 1]"
       for name in ("psnr", "ssim", "lpips")},
    **{f"teacher_{name}": f"{name} of the teacher's own reconstruction (encode, decode)" for name in ("psnr", "ssim",
                                                                                                      "lpips")},
    "latent_mse": "mean squared error of the student encoder's latents against the teacher's normalised latents, "
                  "per image, averaged over images",
    "decode_ms": "milliseconds per image of the decode (batches of --per_device_eval_batch_size, this device)",
    "teacher_decode_ms": "milliseconds per image of the teacher's decode (from its pipelines' latents), the same way",
}


# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("teacher_subfolder", "cache_teacher_latents", "student_width", "student_depth", "latent_distill_weight",
      "latent_distill_loss"), lambda f: not f.distils,
     "it applies to distilling a tiny autoencoder: add --teacher_model_name_or_path, or drop it"),
    (("vae_config_file", "pretrained_model_name_or_path", "init_from_ckpt"),
     lambda f: f.distils and f.family_known and not f.student, f"a distilled student is a tiny autoencoder "
     f"(docs/distillation.md), and this gives a {FAMILY}: drop it (the student then follows the teacher's geometry)"),
    (("student_width", "student_depth"), lambda f: f.distils and (f.vae_config_file or f.loads_weights),
     "the student's architecture is that of --vae_config_file / its weights': drop it"),
    (("num_frames", "equivariance_prob", "vf_model_path", "input_size", "posterior_std", "learn_logvar"),
     lambda f: f.distils, "a tiny autoencoder is distilled on images against its teacher's latents: drop it"),
    (("scaling_factor",), lambda f: f.distils and f.scaling_factor != "keep",
     "a student lives in its teacher's normalised latent space: its scaling_factor is 1 (keep); drop it"),
    (("recipe",), lambda f: f.recipe == "tiny" and not f.distils,
     "it is the recipe of distilling a tiny autoencoder: add --teacher_model_name_or_path, or use ldm / balanced"),
    (("latent_distill_weight", "latent_distill_loss"), lambda f: f.distils and f.freeze_encoder,
     "it trains the student's encoder, which --freeze_encoder keeps as it is: drop one of them"),
    (("latent_distill_weight",), lambda f: f.latent_distill_weight < 0, "it is a weight: >= 0 (0: decoder only)"),
    (("student_width", "student_depth"), lambda f: min(f.student_width, f.student_depth) < 1, "it must be >= 1"),
)


def timed(metrics: MetricAccumulator, name: str, run: Callable[[], paddle.Tensor]) -> paddle.Tensor:
    """`run()`, its milliseconds per image added to `metrics` as `name` (the device synchronised around it)."""
    sync = paddle.device.synchronize if paddle.get_device().startswith("gpu") else lambda: None  # (CPU: in order)
    sync()
    start = time.perf_counter()
    out = run()
    sync()
    metrics.update(name, np.full([out.shape[0]], 1000.0 * (time.perf_counter() - start) / out.shape[0]))
    return out


def add_teacher_metrics(metrics: MetricAccumulator, lpips, teacher, pixels: Tensor, recons: Tensor, latents: Tensor,
                        taught: Tensor) -> None:
    """The student beside its `teacher` (models/teacher.py), into `metrics`: its encoder's `latents` error against the
    teacher's (`taught`), its decode `recons` against the teacher's decode, the teacher's own reconstruction against
    the images, and the teacher's decode time."""
    metrics.update("latent_mse", (latents - taught).square().mean(axis=list(range(1, latents.ndim))))
    decoded_by_teacher = timed(metrics, "teacher_decode_ms", lambda: teacher.decode(taught))
    decoded_by_teacher = decoded_by_teacher.astype("float32").clip(-1.0, 1.0)
    for name, reference, decoded in (("{}_vs_teacher", decoded_by_teacher, recons),
                                     ("teacher_{}", pixels, decoded_by_teacher)):
        metrics.update(name.format("psnr"), psnr(to_unit_range(reference), to_unit_range(decoded)))
        metrics.update(name.format("ssim"), ssim(to_unit_range(reference), to_unit_range(decoded)))
        if lpips is not None:
            metrics.update(name.format("lpips"), lpips(reference, decoded).reshape([-1]))
