"""Evaluate an AutoencoderKL on a set of images: PSNR, SSIM, LPIPS, rFID, latent statistics and diagnostics.

This module owns the evaluation protocol (``EvalProtocol``: the one statement of how the numbers are
made, printed by scripts/eval_vae.py and by every evaluation during training, written to
metrics.json and to each line of a training run's ``eval_metrics.jsonl``, quoted in docs/measuring.md),
the evaluation loop, the encoder-only latent measurement (``measure_latents``) and the reconstruction
image grid; the metric math is in ``vae_trainer.metrics``, the latent diagnostics' in latent_diagnostics.py.
Latent statistics are those of posterior samples, computed exactly in expectation from the posterior
means and variances. It takes any iterable of batches (tensors, or dicts with ``"pixel_values"`` as
``build_eval_dataloader`` yields), all NCHW float32 in [-1, 1].

Large images: the evaluation batch follows the training batch or the resolution unless given
(``eval_batch_size``), and --eval_tiled runs ppdiffusers' tiled encode/decode for the evaluation only
(``Tiling``, ``tiled``), stated in the protocol.

Data parallel: each rank evaluates its own shard and the accumulators sum over ranks, so every rank
returns the same metrics. Every rank must call ``evaluate_vae`` (the final reduction is a
collective) with the same optional models (``lpips``/``inception`` both set or both None on all
ranks). The reconstruction grid is taken from the calling rank's first images.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle

from vae_trainer import watchdog
from vae_trainer.checkpoint import EVAL_METRICS_NAME, eval_line_step
from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.data.images import RESAMPLING
from vae_trainer.distributed import all_ranks_agree, rank, world_size
from vae_trainer.ema import ema_weights
from vae_trainer.flag_checks import DEFAULT_TILE_SIZE, check_eval_batch_size, check_tile_size, downsampling_factor
from vae_trainer.latent_diagnostics import DEFINITIONS as DIAGNOSTIC_DEFINITIONS
from vae_trainer.latent_diagnostics import DIAGNOSTICS, equivariance_pairs, spectrum_energies
from vae_trainer.alignment import DEFINITION as CKA_DEFINITION
from vae_trainer.alignment import CKAAccumulator, to_token_grid
from vae_trainer.metrics import (
    HIGHER_IS_BETTER,
    SSIM_K1,
    SSIM_K2,
    SSIM_SIGMA,
    SSIM_WINDOW_SIZE,
    FeatureStatistics,
    LatentStatistics,
    MetricAccumulator,
    all_reduce_sum,
    frechet_distance,
    psnr,
    ssim,
    to_unit_range,
)
from vae_trainer.models.flux2 import is_flux2, patchify
from vae_trainer.models.vae import encoder_input
from vae_trainer.precision import half_precision_autocast

logger = logging.getLogger(__name__)


METRICS = ("psnr", "ssim", "lpips", "rfid", *DIAGNOSTICS, "vf_alignment_cka")  # in the order they are stated


# ------------------------------------------------------------------------------ the evaluation batch
# The evaluation batch follows the resolution unless --per_device_eval_batch_size (scripts: --batch_size)
# says otherwise. An evaluation step runs the VAE without gradients: nothing is kept for a backward pass, so
# its activation memory at batch B is a fraction of a training step's at batch B (which also holds the
# LPIPS backward and the discriminator). During training the default is therefore the training batch
# (--per_device_train_batch_size), which the user already sized to fit at this --resolution: evaluation and
# the export's latent measurement then fit wherever training fits, at any size. Standalone (eval_vae.py,
# export_vae.py: no training batch to go by) the default keeps the pixels of a batch at those of 8 images of
# 256 px (rounded down), 1 to 8 images: 8 up to 256 px, 4 up to 362 px, 2 from 419 to 512 px, 1 above 512 px
# (600 px: 1; a 513 px image already holds more than half of those pixels). The numbers never depend on
# the batch (metrics are per-image averages, latent statistics sums; tested with batches 1 and 4).
STANDALONE_EVAL_PIXELS = 8 * 256 * 256
MAX_STANDALONE_EVAL_BATCH = 8


def eval_batch_size(resolution: int, given: int | None = None, train_batch_size: int | None = None,
                    flag: str = "--per_device_eval_batch_size") -> int:
    """The per-device evaluation batch: `given` (the user's `flag`, named in the error for a batch < 1) if set,
    else the training batch when there is one, else as many `resolution`-px images as hold the pixels of 8 at
    256 px (1 to 8)."""
    if given is not None:
        check_eval_batch_size(given, flag)
        return int(given)
    if train_batch_size is not None:
        return int(train_batch_size)
    return max(1, min(MAX_STANDALONE_EVAL_BATCH, STANDALONE_EVAL_PIXELS // (resolution * resolution)))


# ---------------------------------------------------------------------------------------- tiling
# --eval_tiled: ppdiffusers' AutoencoderKL.tiled_encode / tiled_decode (enable_tiling()), for 1024 px and
# larger. ppdiffusers tiles an image only when it is larger than `tile_sample_min_size` (by default the
# config's sample_size, the same for the latent side divided by the decoder's factor); the tiles overlap by
# `tile_overlap_factor` (0.25) and the overlaps are blended linearly. We set the tile size (--eval_tile_size,
# default 512 px: the SD VAE's sample_size, and a fixed memory bound whatever the VAE's config says) for the
# evaluation only and put every setting back afterwards, so training never runs tiled. The tile-size rules
# (and DEFAULT_TILE_SIZE) are flag_checks.py's, which refuses bad tiling flags at parse time.
TILE_OVERLAP = 0.25  # ppdiffusers' tile_overlap_factor


@dataclass(frozen=True)
class Tiling:
    """Tiled encode/decode with `tile_size`-pixel tiles (and tile_size / factor latent tiles)."""

    tile_size: int = DEFAULT_TILE_SIZE
    overlap: float = TILE_OVERLAP

    def used_at(self, resolution: int) -> bool:
        """ppdiffusers tiles only images larger than one tile."""
        return resolution > self.tile_size

    def describe(self, resolution: int) -> str:
        if not self.used_at(resolution):
            return (f"requested (--eval_tiled) but not used: a {resolution} px image fits in one {self.tile_size} px "
                    "tile, so encoder and decoder saw whole images")
        return (f"tiled (--eval_tiled): encoder and decoder run on {self.tile_size}x{self.tile_size}-pixel tiles (the "
                f"matching latent tiles for the decoder) overlapping by {self.overlap:.0%}, overlaps blended linearly "
                "(ppdiffusers tiled_encode / tiled_decode); differs from untiled reconstructions near tile seams")

    def source(self, resolution: int) -> str:
        """A few words for the sentence saying where latent statistics come from."""
        return f", tiled ({self.tile_size} px tiles)" if self.used_at(resolution) else ""


def tiling_of(eval_tiled: bool, eval_tile_size: int | None) -> Tiling | None:
    """The Tiling of --eval_tiled / --eval_tile_size (None: untiled)."""
    return Tiling(eval_tile_size or DEFAULT_TILE_SIZE) if eval_tiled else None


def check_tiling(config: Mapping | None, tiling: Tiling | None, input_size: list[int] | None = None,
                 where: str = "the VAE's config") -> None:
    """Refuse tiling settings ppdiffusers' tiled encode/decode would get wrong (`flag_checks.check_tile_size`,
    which the parse-time check `flag_checks.check_tiling_flags` also applies), at each evaluation."""
    if tiling is not None:
        check_tile_size(tiling.tile_size, config, input_size, where)


class _PassThrough(paddle.nn.Layer):
    """Stands in for a missing quant_conv / post_quant_conv (FLUX: use_quant_conv false) during tiling:
    ppdiffusers' tiled_encode / tiled_decode call them unconditionally, and decode() reads `.weight.dtype`."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.weight = SimpleNamespace(dtype=dtype)  # not a parameter: nothing is added to the state dict

    def forward(self, x):
        return x


_TILING_ATTRIBUTES = ("use_tiling", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor")


@contextmanager
def tiled(vae: paddle.nn.Layer, tiling: Tiling | None) -> Iterator[None]:
    """Within: `vae` encodes and decodes images larger than `tiling.tile_size` tile by tile. Every tiling
    setting of the VAE (and its missing quant convs) is put back on leaving, even on an error. No-op for None."""
    if tiling is None:
        yield
        return
    saved = {name: getattr(vae, name) for name in _TILING_ATTRIBUTES}
    stand_ins = [name for name in ("quant_conv", "post_quant_conv") if getattr(vae, name, None) is None]
    try:
        for name, owner in zip(("quant_conv", "post_quant_conv"), ("encoder", "decoder")):
            if name in stand_ins:
                setattr(vae, name, _PassThrough(getattr(vae, owner).conv_in.weight.dtype))
        vae.enable_tiling()
        vae.tile_sample_min_size = tiling.tile_size
        vae.tile_latent_min_size = tiling.tile_size // downsampling_factor(vae.config)
        vae.tile_overlap_factor = tiling.overlap
        yield
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)
        for name in stand_ins:
            delattr(vae, name)  # out of the sublayers, then back to the plain None attribute it was
            setattr(vae, name, None)


@dataclass(frozen=True)
class EvalProtocol:
    """How every evaluation number is made. `describe()` is the single statement of it.

    The images come from `data.dataset.build_eval_dataloader` (full-size decode, resize, centre crop), the
    latents and metrics from `evaluate_vae`; the values below are read from the constants those use.
    `metrics` are those the evaluation measured (LPIPS and rFID need their weights): only they are stated.
    """

    resolution: int
    sample_posterior: bool = False
    seed: int = 0
    input_size: tuple[int, int] | list[int] | None = None  # --input_size: what the encoder sees
    metrics: tuple[str, ...] = METRICS
    tiling: Tiling | None = None  # --eval_tiled: stated (used or not) only when requested
    patchified: bool = False  # FLUX.2's VAE: the statistics of its patchified modes were measured too

    def describe(self) -> dict[str, str]:
        size = self.resolution
        measured = [name for name in METRICS if name in self.metrics]
        on_signed_range = [{"lpips": "LPIPS", "rfid": "rFID"}[name] for name in measured if name in ("lpips", "rfid")]
        value_range = ("reconstructions clamped to [-1, 1]; PSNR and SSIM on images mapped to [0, 1] "
                       "((x + 1) / 2, data range 1)")
        if on_signed_range:
            value_range += f"; {' and '.join(on_signed_range)} on [-1, 1]"
        return {
            "images": f"decoded at full size (no JPEG draft mode) to 8-bit sRGB, shorter side resized to {size} px "
                      f"({RESAMPLING.name.lower()}), centre crop {size}x{size}, no flip",
            **({"encoder input": f"the image bilinearly resized to {self.input_size[0]}x{self.input_size[1]} "
                                 "(--input_size); metrics compare the decoder's output with the full image"}
               if self.input_size else {}),
            "latents": (f"a posterior sample (noise seeded by {self.seed} + rank)" if self.sample_posterior
                        else "the posterior mode (mean)"),
            **({"tiling": self.tiling.describe(size)} if self.tiling is not None else {}),
            "latent statistics": "per channel, of posterior samples (exact expectation from the posterior means "
                                 "and variances), before any scaling factor",
            **({"patchified latent statistics": "FLUX.2's VAE: per channel of the 2x2-patchified posterior mode "
                                                "(Flux2Pipeline's channel order), population mean and variance over "
                                                "all images and positions, what its bn statistics hold"}
               if self.patchified else {}),
            "value range": value_range,
            **{name: _METRIC_DEFINITIONS[name] for name in measured},
        }

    def text(self) -> str:
        """One line per item, as printed and as quoted in the README."""
        return "\n".join(f"{name}: {value}" for name, value in self.describe().items())


_METRIC_DEFINITIONS = {
    "psnr": "10 log10(1 / MSE) per image over all pixels and channels, averaged over images",
    "ssim": f"Gaussian window {SSIM_WINDOW_SIZE}x{SSIM_WINDOW_SIZE}, sigma {SSIM_SIGMA}, K1 {SSIM_K1}, "
            f"K2 {SSIM_K2}, population covariances, valid region only, averaged over channels and images "
            "(scikit-image structural_similarity with gaussian_weights=True, use_sample_covariance=False, "
            "data_range=1)",
    "lpips": "LPIPS v0.1 (VGG16), averaged over images",
    "rfid": "Frechet distance between pytorch-fid InceptionV3 pool features of the inputs and of the "
            "reconstructions",
    **DIAGNOSTIC_DEFINITIONS,
    "vf_alignment_cka": CKA_DEFINITION,
}


@dataclass
class LatentStats:
    """Per-channel statistics of posterior samples and the suggested factors (``LatentStatistics``); for
    FLUX.2's VAE also the population mean and variance of its 2x2-patchified posterior modes per patchified
    channel, what its bn statistics hold (latent_scale.py ``decide_normalisation``)."""

    latent_mean: list[float]
    latent_std: list[float]
    scaling_factor: float
    shift_factor: float
    num_images: int
    patchified_mode_mean: list[float] | None = None
    patchified_mode_var: list[float] | None = None

    @classmethod
    def from_statistics(cls, statistics: LatentStatistics, count: int,
                        patches: LatentStatistics | None = None) -> "LatentStats":
        """Reduce over ranks (a collective); ``count`` is this rank's number of images."""
        mean, std = statistics.compute()
        scaling_factor, shift_factor = statistics.suggested_factors()
        total = int(all_reduce_sum(np.array([count], dtype=np.float64))[0])
        patch_mean = patch_var = None
        if patches is not None:
            patch_mean, patch_std = patches.compute()
            patch_mean, patch_var = patch_mean.tolist(), (patch_std**2).tolist()
        return cls(mean.tolist(), std.tolist(), scaling_factor, shift_factor, total, patch_mean, patch_var)


class _LatentAccumulator:
    """The latent statistics of one pass: of posterior samples, and for FLUX.2's VAE of its patchified modes."""

    def __init__(self, vae) -> None:
        self.samples = LatentStatistics()
        self.patch_size = vae.config.patch_size if is_flux2(vae) else None
        self.patches = LatentStatistics() if self.patch_size else None
        self.count = 0

    def add(self, posterior, images: int) -> None:
        self.count += images
        self.samples.update(posterior.mean.astype("float32"), posterior.var.astype("float32"))
        if self.patches is not None:
            self.patches.update(patchify(posterior.mode().astype("float32"), self.patch_size))

    def result(self) -> LatentStats:
        return LatentStats.from_statistics(self.samples, self.count, self.patches)


@dataclass
class EvalResult(LatentStats):
    """What ``evaluate_vae`` measured; ``grid`` is uint8 HxWx3, inputs above reconstructions."""

    metrics: dict[str, float] = field(default_factory=dict)
    grid: np.ndarray | None = None


def _to_uint8_images(images: paddle.Tensor | np.ndarray) -> np.ndarray:
    """[-1, 1] NCHW -> uint8 NHWC, rounding to the nearest level."""
    if isinstance(images, paddle.Tensor):
        images = images.astype("float32").numpy()
    scaled = (np.clip(images, -1.0, 1.0) + 1.0) * 127.5
    return np.round(scaled).astype(np.uint8).transpose(0, 2, 3, 1)


def make_grid(
    inputs: paddle.Tensor | np.ndarray, recons: paddle.Tensor | np.ndarray, max_images: int = 8
) -> np.ndarray:
    """Two-row uint8 image grid (HxWx3): the first ``max_images`` inputs over their reconstructions.

    Both are NCHW in [-1, 1] (values outside are clipped). Usable for files and for VisualDL.
    At least one image is shown.
    """
    max_images = max(1, max_images)
    top = _to_uint8_images(inputs[:max_images])
    bottom = _to_uint8_images(recons[:max_images])
    rows = [np.concatenate(list(row), axis=1) for row in (top, bottom)]
    return np.concatenate(rows, axis=0)


def _pixel_values(batch: Any) -> paddle.Tensor:
    if isinstance(batch, dict):
        batch = batch["pixel_values"]
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    if not isinstance(batch, paddle.Tensor):
        batch = paddle.to_tensor(np.asarray(batch))
    return batch.astype("float32")


def _capped_batches(batches: Iterable[Any], num_images: int | None) -> Iterator[paddle.Tensor]:
    """Pixel tensors from ``batches``, the last one trimmed so at most ``num_images`` come out."""
    remaining = num_images
    for batch in batches:
        if remaining is not None and remaining <= 0:
            return
        pixels = _pixel_values(batch)
        if remaining is not None:
            pixels = pixels[:remaining]
            remaining -= pixels.shape[0]
        yield pixels


def _posterior(vae, pixels: paddle.Tensor, input_size: list[int] | None, posterior_std: float = 0.0):
    """The posterior of ``pixels``, the encoder seeing them bilinearly resized to ``input_size`` if given
    (a super-resolving decoder, as trained with --input_size).

    With ``posterior_std`` > 0 (a VAE trained with --posterior_std) its std is that constant, as in training
    and in the exported VAE (``vae_saving.constant_posterior_std``): the encoder's own log-variance outputs
    are untrained. The latent statistics, the scaling factor and posterior samples all follow from it.
    """
    posterior = vae.encode(encoder_input(pixels, input_size)).latent_dist
    if posterior_std > 0:
        posterior.std = paddle.full_like(posterior.mean, posterior_std)
        posterior.var = paddle.full_like(posterior.mean, posterior_std**2)
        posterior.logvar = paddle.full_like(posterior.mean, 2.0 * math.log(posterior_std))
    return posterior


def _latent(posterior, rng: np.random.Generator | None) -> paddle.Tensor:
    """Posterior mode, or a sample when ``rng`` is given.

    Sampling draws its noise from ``rng`` rather than Paddle's global generator, so an evaluation
    is reproducible and does not shift the random stream of a training run that calls it.
    """
    if rng is None:
        return posterior.mode()
    noise = rng.standard_normal(posterior.mean.shape).astype(np.float32)
    return posterior.mean + posterior.std * paddle.to_tensor(noise).astype(posterior.mean.dtype)


class _Evaluation:
    """Accumulators for one evaluation pass (one instance per call of ``evaluate_vae``)."""

    def __init__(self, vae, lpips, inception, grid_images: int, vf_model=None) -> None:
        self.lpips = lpips
        self.vf_model = vf_model
        self.cka = CKAAccumulator() if vf_model is not None else None
        self.inception = inception
        self.grid_images = grid_images
        self.metrics = MetricAccumulator()
        self.latents = _LatentAccumulator(vae)
        self.real_features = FeatureStatistics() if inception is not None else None
        self.recon_features = FeatureStatistics() if inception is not None else None
        self.grid_inputs: list[np.ndarray] = []
        self.grid_recons: list[np.ndarray] = []
        self.spectrum = np.zeros(2, dtype=np.float64)  # latent energy above half Nyquist, all latent energy
        self.count = 0

    def add(self, pixels: paddle.Tensor, posterior, recons: paddle.Tensor,
            equivariance: dict[str, tuple[paddle.Tensor, paddle.Tensor]]) -> None:
        """One batch of [-1, 1] inputs, their posterior, their clamped [-1, 1] reconstructions and the
        latent diagnostics' {name: (decode(tau(z)), tau(x))} (latent_diagnostics.equivariance_pairs)."""
        self.count += pixels.shape[0]
        self.latents.add(posterior, pixels.shape[0])
        unit_pixels, unit_recons = to_unit_range(pixels), to_unit_range(recons)
        self.metrics.update("psnr", psnr(unit_pixels, unit_recons))
        self.metrics.update("ssim", ssim(unit_pixels, unit_recons))
        for name, (decoded, target) in equivariance.items():
            decoded = decoded.astype("float32").clip(-1.0, 1.0)
            self.metrics.update(name, psnr(to_unit_range(target.astype("float32")), to_unit_range(decoded)))
        self.spectrum += spectrum_energies(posterior.mode())
        if self.vf_model is not None:
            features, grid = self.vf_model.patch_tokens(pixels)
            self.cka.add(to_token_grid(posterior.mode(), grid), features)
        if self.lpips is not None:
            self.metrics.update("lpips", self.lpips(pixels, recons).reshape([-1]))
        if self.inception is not None:
            self.real_features.update(self.inception(pixels))
            self.recon_features.update(self.inception(recons))
        self._keep_for_grid(pixels, recons)

    def _keep_for_grid(self, pixels: paddle.Tensor, recons: paddle.Tensor) -> None:
        missing = self.grid_images - sum(len(images) for images in self.grid_inputs)
        if missing > 0:
            self.grid_inputs.append(pixels[:missing].numpy())
            self.grid_recons.append(recons[:missing].numpy())

    def result(self) -> EvalResult:
        metrics = self.metrics.compute()
        high, total = all_reduce_sum(self.spectrum)
        metrics["latent_high_frequency_share"] = float(high / total) if total > 0 else 0.0
        if self.cka is not None:
            metrics["vf_alignment_cka"] = self.cka.result()
        if self.inception is not None:
            metrics["rfid"] = frechet_distance(*self.real_features.compute(),
                                               *self.recon_features.compute())
        latents = self.latents.result()
        return EvalResult(
            **vars(latents),
            metrics=metrics,
            grid=make_grid(np.concatenate(self.grid_inputs), np.concatenate(self.grid_recons),
                           self.grid_images),
        )


def evaluate_vae(
    vae: paddle.nn.Layer,
    batches: Iterable[Any],
    lpips: paddle.nn.Layer | None = None,
    inception: paddle.nn.Layer | None = None,
    num_images: int | None = None,
    sample_posterior: bool = False,
    seed: int = 0,
    grid_images: int = 8,
    input_size: list[int] | None = None,
    posterior_std: float = 0.0,
    tiling: Tiling | None = None,
    vf_model: paddle.nn.Layer | None = None,
) -> EvalResult:
    """Reconstruct every image of ``batches`` with ``vae`` and measure the reconstructions.

    Reconstructions use the posterior mode (or a sample, noise seeded by ``seed`` + rank) and are
    clamped to [-1, 1] before scoring (``EvalProtocol`` states the whole protocol). PSNR and SSIM
    always, on [0, 1] with data range 1; LPIPS when ``lpips`` is given
    (``lpips(x, y) -> [B]``); "rfid" when ``inception`` is given (a ``FIDInceptionV3``, or any layer
    mapping [-1, 1] images to [B, D] features), otherwise skipped with a log message; with 2048-d
    features its final matrix square root takes seconds to a minute on CPU. Latent statistics are
    those of posterior samples (exact expectation from the posterior means and variances; raw, before
    any scaling factor), whatever is decoded. The latent diagnostics (latent_diagnostics.py: two
    equivariance PSNRs, two more decodes per batch, and the latents' high-frequency share) are metrics
    too. ``input_size`` resizes what the encoder sees (--input_size); ``posterior_std`` > 0 is the
    constant std of a VAE trained with --posterior_std. ``vf_model`` (a models/dinov2.py model) adds
    ``vf_alignment_cka`` (alignment.py). ``num_images`` caps the images this process
    evaluates; ``EvalResult.num_images`` is the total over all ranks. ``tiling`` (--eval_tiled) encodes and decodes images larger than its tile
    tile by tile (``tiled``). The VAE's train/eval mode and tiling settings are restored afterwards.
    """
    check_tiling(getattr(vae, "config", None), tiling, input_size)
    if inception is None:
        logger.info("rFID skipped: no Inception model given (needs converted FID weights)")
    rank = paddle.distributed.get_rank() if paddle.distributed.is_initialized() else 0
    rng = np.random.default_rng(seed + rank) if sample_posterior else None
    for metric_network in (lpips, inception):
        if metric_network is not None:
            metric_network.eval()  # fixed feature networks: never batch statistics
    evaluation = _Evaluation(vae, lpips, inception, grid_images, vf_model)
    watchdog.doing("evaluating")
    was_training = vae.training
    vae.eval()
    try:  # a failure or an empty share on one rank raises on all (not: the others wait in result()'s all-reduces)
        with all_ranks_agree("evaluation"), paddle.no_grad(), tiled(vae, tiling):
            for pixels in _capped_batches(batches, num_images):
                with half_precision_autocast(vae):  # O2: float32 images into half-precision weights
                    posterior = _posterior(vae, pixels, input_size, posterior_std)
                    recons = vae.decode(_latent(posterior, rng)).sample
                    equivariance = equivariance_pairs(lambda z: vae.decode(z).sample, pixels, posterior.mode())
                evaluation.add(pixels, posterior, recons.astype("float32").clip(-1.0, 1.0), equivariance)
                watchdog.beat("an evaluation batch")
            _check_not_empty(evaluation.count)
    finally:
        if was_training:
            vae.train()
    return evaluation.result()


def _check_not_empty(count: int) -> None:
    if count == 0:
        raise ValueError("got no images; use at least as many images as there are ranks")


def measure_latents(
    vae: paddle.nn.Layer, batches: Iterable[Any], num_images: int | None = None, input_size: list[int] | None = None,
    posterior_std: float = 0.0, tiling: Tiling | None = None,
) -> LatentStats:
    """Latent statistics of ``batches`` from the encoder alone (no decoder, LPIPS or rFID): what a scaling
    factor needs; tiled with ``tiling``. Collective like ``evaluate_vae``; the VAE's train/eval mode and tiling
    settings are restored."""
    check_tiling(getattr(vae, "config", None), tiling, input_size)
    latents = _LatentAccumulator(vae)
    watchdog.doing("measuring latent statistics")
    was_training = vae.training
    vae.eval()
    try:
        with all_ranks_agree("measuring latent statistics"), paddle.no_grad(), tiled(vae, tiling):
            for pixels in _capped_batches(batches, num_images):
                latents.add(_posterior(vae, pixels, input_size, posterior_std), pixels.shape[0])
                watchdog.beat("a latent-statistics batch")
            _check_not_empty(latents.count)
    finally:
        if was_training:
            vae.train()
    return latents.result()


def measure_latents_of(
    vae: paddle.nn.Layer, ema, data: str, resolution: int, batch_size: int | None, num_images: int,
    input_size: list[int] | None = None, posterior_std: float = 0.0, tiling: Tiling | None = None,
) -> tuple[LatentStats, str]:
    """Latent statistics of `vae` (with the EMA's weights when `ema` is given) over the first `num_images`
    images of `data` (a filelist or a folder; each rank reads its share), from the encoder alone, and the
    sentence saying where they come from (latent_stats.json). `batch_size` None: the standalone rule of
    `eval_batch_size`; `tiling`: --eval_tiled. Collective."""
    batch_size = eval_batch_size(resolution, batch_size)
    loader = build_eval_dataloader(data, resolution, batch_size, rank(), world_size(), num_images)
    with ema_weights(ema, vae):
        stats = measure_latents(vae, loader, num_images, input_size, posterior_std, tiling)
    tiles = tiling.source(resolution) if tiling is not None else ""
    return stats, f"an encoder-only pass over {stats.num_images} images of {data}{tiles}"



class TrainingEvaluator:
    """Evaluation during training, the same in both drivers.

    Every --eval_steps (and at the end) it evaluates --eval_num_images held-out images from
    --eval_file_list with the EMA weights when --use_ema, logs `eval/*` scalars, per-channel latent
    statistics and a reconstruction grid to VisualDL, records the numbers with their protocol as one line
    of OUTPUT_DIR/eval_metrics.jsonl, and tracks the best value of --metric_for_best_model. Uses no global random state, so training numbers are unaffected.
    It keeps its last result, which the export reuses for the latent statistics (`latent_stats`).
    With --posterior_std the latents have that constant std, as in training and in the export.
    Batch: --per_device_eval_batch_size, default the training batch (`eval_batch_size`); with --eval_tiled the
    evaluation and the export's measurement run tiled (`tiled`), and training never does.
    """

    def __init__(self, data_args, args, lpips=None, inception=None, input_size=None, posterior_std: float = 0.0,
                 vf_model=None):
        self.data_args, self.args = data_args, args
        self.vf_model = vf_model
        self.lpips, self.inception = lpips, inception
        self.input_size = input_size
        self.posterior_std = posterior_std
        self.metric = (args.metric_for_best_model or "").replace("eval_", "") or None
        self.batch_size = eval_batch_size(data_args.resolution, getattr(args, "per_device_eval_batch_size", None),
                                          getattr(args, "per_device_train_batch_size", None))
        self.tiling = tiling_of(getattr(data_args, "eval_tiled", False), getattr(data_args, "eval_tile_size", None))
        check_tiling(None, self.tiling, input_size)  # the tile size against the VAE: parse time, and each evaluation
        # (step, result, evaluated the EMA weights?) of the last evaluation
        self.last: tuple[int, EvalResult, bool] | None = None
        self._check_image_counts()
        if self.metric is not None and self.metric not in HIGHER_IS_BETTER:
            raise ValueError(f"--metric_for_best_model must be one of {sorted(HIGHER_IS_BETTER)}, got {self.metric!r}")

    def _check_image_counts(self) -> None:
        """At start-up, not after training: every rank must get at least one image of each set it measures."""
        ranks = world_size()
        if self.enabled and self.data_args.eval_num_images < ranks:
            raise ValueError(f"--eval_num_images {self.data_args.eval_num_images} is smaller than the number of ranks "
                             f"({ranks}): every rank evaluates its share")
        wanted = self.data_args.latent_stats_num_images
        if wanted is not None and wanted < max(1, ranks):
            raise ValueError(f"--latent_stats_num_images {wanted} must be at least 1 and at least the number of ranks "
                             f"({ranks}): every rank measures its share of the images")

    @property
    def enabled(self) -> bool:
        return bool(self.data_args.eval_file_list) and self.args.eval_steps is not None and self.args.eval_steps > 0

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.args.eval_steps == 0 or step == self.args.max_steps)

    @property
    def latent_stats_data(self) -> tuple[str, int]:
        """(images, how many) the export's latent statistics are measured on: --latent_stats_num_images
        (default --eval_num_images) of --eval_file_list, else of the training --file_list."""
        path = self.data_args.eval_file_list or self.data_args.file_list
        return path, self.data_args.latent_stats_num_images or self.data_args.eval_num_images

    def evaluate(self, vae, ema=None) -> EvalResult:
        """Evaluate `vae` (with EMA weights if given) on --eval_file_list."""
        loader = build_eval_dataloader(self.data_args.eval_file_list, self.data_args.resolution,
                                       self.batch_size, rank(), world_size(), self.data_args.eval_num_images)
        with ema_weights(ema, vae):
            return evaluate_vae(vae, loader, lpips=self.lpips, inception=self.inception,
                                grid_images=self.args.num_logged_images, input_size=self.input_size,
                                posterior_std=self.posterior_std, tiling=self.tiling, vf_model=self.vf_model)

    def protocol_of(self, result: EvalResult) -> EvalProtocol:
        """The protocol of an evaluation's result, stating the metrics it measured."""
        return EvalProtocol(resolution=self.data_args.resolution, input_size=self.input_size,
                            metrics=tuple(result.metrics), tiling=self.tiling,
                            patchified=result.patchified_mode_mean is not None)

    def evaluated_at(self, step: int, ema=None) -> bool:
        """Did an evaluation measure these weights (the EMA's when `ema` is given, else the raw ones) at
        `step`, on the images the export's statistics use?"""
        wanted = self.data_args.latent_stats_num_images
        return (self.last is not None and self.last[0] == step and self.last[2] == (ema is not None)
                and (wanted is None or wanted == self.data_args.eval_num_images))

    def latent_stats(self, vae, ema, step: int) -> tuple[LatentStats, str]:
        """Latent statistics of the weights of `step` (the EMA's if given) and where they come from: the
        evaluation of those weights at that step when there was one (no extra work), else an encoder-only
        pass (`measure_latents_of`) over `latent_stats_data`."""
        if self.evaluated_at(step, ema):
            tiles = self.tiling.source(self.data_args.resolution) if self.tiling is not None else ""
            return self.last[1], f"the evaluation at step {step}{tiles}"
        path, num_images = self.latent_stats_data
        return measure_latents_of(vae, ema, path, self.data_args.resolution, self.batch_size,
                                  num_images, self.input_size, self.posterior_std, self.tiling)

    def run(self, step: int, vae, ema, monitor, trainer_state) -> bool:
        """Evaluate, log, and update the best metric in `trainer_state`; True if this step is the new best."""
        result = self.evaluate(vae, ema)
        self.last = (step, result, ema is not None)
        scalars = {f"eval/{name}": value for name, value in result.metrics.items()}
        scalars.update({f"eval/latent_mean_{c}": m for c, m in enumerate(result.latent_mean)})
        scalars.update({f"eval/latent_std_{c}": s for c, s in enumerate(result.latent_std)})
        scalars["eval/suggested_scaling_factor"] = result.scaling_factor
        monitor.log_scalars(step, scalars)
        monitor.log_grid(step, result.grid, tag="eval/reconstructions")
        trainer_state.log_history.append({"step": step, **scalars})
        protocol = self.protocol_of(result)
        logger.info("eval at step %d on %d images%s: %s\nprotocol:\n%s", step, result.num_images,
                    " (EMA weights)" if ema is not None else "",
                    ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()), protocol.text())
        better = self._is_new_best(result, trainer_state)
        record = {"step": step, "weights": "ema" if ema is not None else "raw", **result_record(result, protocol)}
        if self.metric is not None:
            record.update(metric_for_best_model=self.metric, is_best=better)
        with all_ranks_agree(f"writing {EVAL_METRICS_NAME}"):  # rank 0 writes; a failure ends every rank
            self._append_record(record)
        return better

    def _is_new_best(self, result: EvalResult, trainer_state) -> bool:
        if self.metric is None or self.metric not in result.metrics:
            return False
        value = result.metrics[self.metric]
        best = trainer_state.best_metric
        better = best is None or (value > best if HIGHER_IS_BETTER[self.metric] else value < best)
        if better:
            trainer_state.best_metric = value
        return better

    def _append_record(self, record: dict) -> None:
        """Rank 0 adds one line to OUTPUT_DIR/eval_metrics.jsonl, replacing the lines of steps >= this one (an
        earlier attempt's, after a resume), so the file is this run's history. Written whole, then renamed."""
        if rank() != 0:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)  # (the loop writes nothing there before its first save)
        path = os.path.join(self.args.output_dir, EVAL_METRICS_NAME)
        kept = []
        if os.path.isfile(path):
            with open(path) as handle:
                steps = [(line, eval_line_step(line)) for line in handle]
            # (a line that cannot be read, the half-written tail of a killed run, is dropped)
            kept = [line.rstrip("\n") + "\n" for line, step in steps if step is not None and step < record["step"]]
        with open(path + ".tmp", "w") as handle:
            handle.writelines(kept + [json.dumps(record) + "\n"])
        os.replace(path + ".tmp", path)


def result_record(result: EvalResult, protocol: EvalProtocol) -> dict:
    """What an evaluation measured, with its protocol: scripts/eval_vae.py's metrics.json and each line of a
    training run's eval_metrics.jsonl."""
    return {
        "metrics": result.metrics,
        "protocol": protocol.describe(),
        "num_images": result.num_images,
        "latent_mean": result.latent_mean,
        "latent_std": result.latent_std,
        "scaling_factor": result.scaling_factor,
        "shift_factor": result.shift_factor,
        **({"patchified_mode_mean": result.patchified_mode_mean, "patchified_mode_var": result.patchified_mode_var}
           if result.patchified_mode_mean is not None else {}),
    }
