"""Evaluate an autoencoder (through its family, models/family.py) on held-out NCHW [-1, 1] images or NCTHW clips
(docs/measuring.md): the protocol stated with each result, the one pass over the images (every rank runs it on its
share), eval tiling, and in-training evaluation."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle

from vae_trainer import watchdog
from vae_trainer.checkpoint import EVAL_METRICS_NAME, eval_line_step
from vae_trainer.data.dataset import build_eval_dataloader
from vae_trainer.data.filelists import CLIP_TAR, VIDEO_SUFFIXES, read_sources
from vae_trainer.data.images import RESAMPLING
from vae_trainer.data.sharding import RecordSample
from vae_trainer.distributed import all_ranks_agree, rank, world_size
from vae_trainer.disk import replace_file
from vae_trainer.ema import ema_weights
from vae_trainer.flag_checks import DEFAULT_TILE_SIZE, check_tile_size
from vae_trainer.metrics import (ALPHA_MSE_FLOOR, HIGHER_IS_BETTER, SSIM_K1, SSIM_K2, SSIM_SIGMA, SSIM_WINDOW_SIZE,
                                 MetricAccumulator, add_features, add_latents, feature_statistics, fold_frames,
                                 frechet_distance, latent_statistics, psnr, ssim, to_unit_range)
from vae_trainer.models.families import family_of, image_channels
from vae_trainer.models.families.kl import KL
from vae_trainer.models.trainable import encoder_input
from vae_trainer.objectives import alignment, distillation, equivariance
from vae_trainer.objectives import clips as clips_part
from vae_trainer.objectives.alignment import add_cka_tokens, linear_cka, to_token_grid
from vae_trainer.objectives.reconstruction import over_grey
from vae_trainer.precision import half_precision_autocast

logger = logging.getLogger(__name__)

# How each metric is made, in the order the protocol states them.
METRIC_DEFINITIONS = {
    "psnr": "10 log10(1 / MSE) per image over all pixels and channels, averaged over images",
    "ssim": f"Gaussian window {SSIM_WINDOW_SIZE}x{SSIM_WINDOW_SIZE}, sigma {SSIM_SIGMA}, K1 {SSIM_K1}, K2 {SSIM_K2}, "
            "population covariances, valid region only, averaged over channels and images (scikit-image "
            "structural_similarity with gaussian_weights=True, use_sample_covariance=False, data_range=1)",
    "alpha_psnr": f"10 log10(1 / max(MSE, {ALPHA_MSE_FLOOR:g})) per image over the alpha channel alone (a ceiling of "
                  f"{-10 * np.log10(ALPHA_MSE_FLOOR):g} dB: exact alpha, e.g. an opaque image decoded opaque, would "
                  "be +inf), averaged over images",
    "lpips": "LPIPS v0.1 (VGG16), averaged over images",
    "rfid": "Frechet distance between pytorch-fid InceptionV3 pool features of the inputs and of the reconstructions",
    **clips_part.DEFINITIONS,
    **equivariance.DEFINITIONS,
    "vf_alignment_cka": alignment.DEFINITION,
    **distillation.DEFINITIONS,
}

CHECKER_SQUARE, CHECKER_LEVELS = 8, (1.0, 0.6)  # the grids' checkerboard: 8 px squares, white and light grey on [-1, 1]

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("eval_steps",), lambda f: f.eval_steps is not None and f.eval_steps < 1,
     "it must be >= 1 (leave it out to not evaluate)"),
    (("eval_steps",), lambda f: f.eval_steps and not f.eval_file_list,
     "it needs --eval_file_list: the held-out images to evaluate on"),
    (("eval_file_list",), lambda f: f.eval_file_list and not f.eval_steps,
     "it is never evaluated without --eval_steps: add --eval_steps N (every N steps and at the end; --eval_steps "
     "equal to --max_steps evaluates once, at the end)"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model and not f.evaluates,
     "it needs evaluations: add --eval_file_list and --eval_steps"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model == "rfid" and not f.inception_weights,
     "rFID is measured only with --inception_weights: add them"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model == "lpips" and f.lpips_missing,
     "LPIPS needs its weights (--lpips_weights; default weights/lpips_vgg16.pdparams, from make setup): give them"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model == "vf_alignment_cka" and not f.vf_model_path,
     "the alignment is measured only with --vf_model_path: add it"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model == "alpha_psnr" and f.geometry.channels != 4
     and not f.expand_to_rgba,
     "alpha_psnr is measured for VAEs of RGBA images (4 channels), and this one takes RGB: pick another metric"),
    (("metric_for_best_model",), lambda f: f.metric_for_best_model == "flicker" and f.num_frames == 1,
     "flicker is measured on clips: add --num_frames N (> 1), or pick another metric"),
    (("inception_weights",), lambda f: not f.evaluates, "rFID is measured in evaluations: add --eval_file_list and "
     "--eval_steps, or drop it (scripts/eval_vae.py --inception_weights measures a saved VAE)"),
    (("eval_tiled", "eval_tile_size"), lambda f: not f.evaluates and not f.measures_scale,
     "it tiles evaluations and the measurement of the scaling factor, and this run has neither: add "
     "--eval_file_list and --eval_steps (or --scaling_factor measure), or drop it"),
)


def eval_batch_size(resolution: int, given: int | None = None, train_batch_size: int | None = None,
                    flag: str = "--per_device_eval_batch_size") -> int:
    """The per-device evaluation batch: `given` (`flag`), else the training batch, else 8 images' pixels at 256 px."""
    if given is not None:
        if given < 1:  # (the parsers call this too, so a batch below 1 is refused before anything is built)
            raise ValueError(f"{flag} must be >= 1, got {given}")
        return int(given)
    if train_batch_size is not None:
        return int(train_batch_size)
    return max(1, min(8, 8 * 256 * 256 // (resolution * resolution)))


def tiles_note(tiling: int | None, resolution: int) -> str:
    """The words added to the sentence saying where latent statistics come from."""
    return f", tiled ({tiling} px tiles)" if tiling is not None and resolution > tiling else ""


@dataclass(frozen=True)
class EvalProtocol:
    """How the numbers of an evaluation are made, stating only the `metrics` it measured."""

    resolution: int
    sample_posterior: bool = False
    seed: int = 0
    input_size: tuple[int, int] | list[int] | None = None  # --input_size: what the encoder sees
    metrics: tuple[str, ...] = tuple(METRIC_DEFINITIONS)
    tiling: int | None = None  # --eval_tiled's tile size: stated (used or not) only when requested
    family_items: tuple[tuple[str, str], ...] = ()  # its latent normalisation's own (name, text) items
    deterministic: bool = False  # the encoder gives a latent, not a posterior (DC-AE)
    tiling_method: str = KL.tiling  # the family's, stated with the tile size
    num_frames: int = 1  # > 1: clips (--num_frames), every --frame_stride-th frame
    frame_stride: int = 1
    teacher: str = ""  # distillation: the teacher's folder, whose latents the student decodes
    channels: int = 3  # 4: RGBA images (alpha kept)

    def describe(self) -> dict[str, str]:
        size, items = self.resolution, {}
        items["images"] = (f"decoded at full size (no JPEG draft mode) to 8-bit sRGB, shorter side resized to "
                           f"{size} px ({RESAMPLING.name.lower()}), centre crop {size}x{size}, no flip")
        if self.num_frames > 1:
            n, k = self.num_frames, self.frame_stride
            items["clips"] = (f"each video's first window: frames 0, {k}, ..., {(n - 1) * k} (--num_frames {n}, "
                              f"--frame_stride {k}), cropped as images; images skipped; psnr, ssim, lpips: means over "
                              "every frame of every clip; no equivariance diagnostics, no rFID/rFVD")
        if self.channels == 4:
            items["channels"] = ("RGBA, straight alpha: an image's alpha kept, one without alpha read as opaque "
                                 "(alpha 1); psnr and ssim over all four channels; lpips (and rFID) of the RGB "
                                 "composited over mid-grey (a * rgb on [-1, 1], a the alpha on [0, 1])")
        if self.input_size:
            items["encoder input"] = (f"the image bilinearly resized to {self.input_size[0]}x{self.input_size[1]} "
                                      "(--input_size); metrics compare the decoder's output with the full image")
        items["latents"] = (f"the teacher's ({self.teacher}) posterior mode, normalised as its pipelines do "
                            "((z - mean) / std), decoded by the student" if self.teacher else
                            "the encoder's latent (deterministic: no posterior)" if self.deterministic else
                            f"a posterior sample (noise seeded by {self.seed} + rank)" if self.sample_posterior
                            else "the posterior mode (mean)")
        if self.tiling is not None and size <= self.tiling:  # only images larger than one tile are tiled
            items["tiling"] = (f"requested (--eval_tiled) but not used: a {size} px image fits in one {self.tiling} px "
                               "tile, so encoder and decoder saw whole images")
        elif self.tiling is not None:
            items["tiling"] = (f"tiled (--eval_tiled): encoder and decoder run on {self.tiling}x{self.tiling}-pixel "
                               f"tiles (the matching latent tiles for the decoder) {self.tiling_method}; differs from "
                               "untiled reconstructions near tile seams")
        items["latent statistics"] = ("per channel, of the latents" if self.deterministic else "per channel, of "
                                      "posterior samples (exact expectation from the posterior means and variances)"
                                      ) + ", before any scaling factor"
        items.update(self.family_items)
        measured = [name for name in METRIC_DEFINITIONS if name in self.metrics]
        items["value range"] = ("reconstructions clamped to [-1, 1]; PSNR and SSIM on images mapped to [0, 1] "
                                "((x + 1) / 2, data range 1)")
        signed = [{"lpips": "LPIPS", "rfid": "rFID"}[name] for name in measured if name in ("lpips", "rfid")]
        if signed:
            items["value range"] += f"; {' and '.join(signed)} on [-1, 1]"
        return {**items, **{name: METRIC_DEFINITIONS[name] for name in measured}}

    def text(self) -> str:
        """One line per item, as printed and as quoted in docs/measuring.md."""
        return "\n".join(f"{name}: {value}" for name, value in self.describe().items())


@dataclass
class EvalResult:
    """What a pass measured: per-channel statistics of posterior samples, the suggested factors, and those of its
    latent normalisation's view where it has one (FLUX.2's patchified posterior modes, Wan's modes, RAE's tokens);
    when reconstructing, the metrics and a uint8 HxWx3 grid."""

    latent_mean: list[float]
    latent_std: list[float]
    scaling_factor: float
    shift_factor: float
    num_images: int
    view_mean: list[float] | None = None  # per channel of the normalisation's view
    view_var: list[float] | None = None
    listed: dict = field(default_factory=dict)  # what records list of the view's statistics, by name
    metrics: dict[str, float] = field(default_factory=dict)
    grid: np.ndarray | None = None


def make_grid(inputs: paddle.Tensor | np.ndarray, recons: paddle.Tensor | np.ndarray,
              max_images: int = 8) -> np.ndarray:
    """uint8 HxWx3 grid: the first `max_images` (at least one) NCHW [-1, 1] inputs over their reconstructions (RGBA
    ones on a checkerboard); of NCTHW clips, frame strips: each clip's frames in a row, its reconstruction's below."""
    if inputs.ndim == 5:
        pairs = zip(inputs[:max(1, max_images)], recons[:max(1, max_images)])
        return np.concatenate([make_grid(clip.transpose([1, 0, 2, 3]), recon.transpose([1, 0, 2, 3]), clip.shape[1])
                               for clip, recon in pairs])
    rows, (board_rows, board_columns) = [], np.indices(inputs.shape[2:4]) // CHECKER_SQUARE
    # RGBA over a light checkerboard of CHECKER_SQUARE px squares, as image editors show transparency
    board = np.where((board_rows + board_columns) % 2 == 0, CHECKER_LEVELS[0], CHECKER_LEVELS[1])[None, :, :, None]
    for images in (inputs[:max(1, max_images)], recons[:max(1, max_images)]):
        images = np.clip(np.asarray(images.astype("float32")), -1.0, 1.0).transpose(0, 2, 3, 1)  # (bfloat16 too)
        if images.shape[-1] == 4:
            opacity = (images[..., 3:] + 1.0) / 2.0
            images = images[..., :3] * opacity + board * (1.0 - opacity)
        rows.append(np.concatenate(list(np.round((images + 1.0) * 127.5).astype(np.uint8)), axis=1))
    return np.concatenate(rows, axis=0)


class _Pass:
    """One pass of `vae` over images and its sums (`add`; `run` reduces them over ranks, once): latent statistics,
    and the metrics and the grid when reconstructing. `rng` draws posterior samples to decode (None: the mode)."""

    def __init__(self, vae, input_size=None, posterior_std: float = 0.0, lpips=None, inception=None,
                 grid_images: int = 0, vf_model=None, rng: np.random.Generator | None = None, teacher=None) -> None:
        self.vae, self.family, self.input_size, self.rng, self.teacher = vae, family_of(vae), input_size, rng, teacher
        self.geometry = self.family.geometry(vae.config)
        self.posterior_std = 0.0 if self.geometry.deterministic else posterior_std  # training's noise, not exported
        self.lpips, self.inception, self.vf_model, self.grid_images = lpips, inception, vf_model, grid_images
        self.metrics = MetricAccumulator()  # every sum: the metrics, "images", the latents' ("samples"; "view": the
        # normalisation's view, FLUX.2's patchified latents, if any), "spectrum", the CKA's, the Inception features'
        self.grid: list[tuple[np.ndarray, np.ndarray]] = []

    def run(self, batches: Iterable[Any], tiling: int | None, reconstruct: bool) -> EvalResult:
        """`add` each batch (tensors or dicts holding "pixel_values"; as many images as the loader gives), in eval mode
        without gradients, decoded if asked. A rank that fails or gets no image raises on every rank, naming it."""
        what = "evaluating" if reconstruct else "measuring latent statistics"
        if tiling is not None:  # tiles the tiled passes would get wrong are refused
            check_tile_size(tiling, self.vae.config, self.input_size, "the VAE's config")
        watchdog.doing(what)
        was_training = self.vae.training
        self.vae.eval()
        try:
            tiles = self.family.tiled(self.vae, tiling) if tiling is not None else nullcontext()
            with all_ranks_agree(what), paddle.no_grad(), tiles:
                try:
                    for batch in batches:
                        pixels = batch["pixel_values"] if isinstance(batch, dict) else batch
                        self.add(pixels.astype("float32"), reconstruct)
                        watchdog.beat(f"a batch ({what})")
                finally:  # a failing rank still joins the loader's gather (data.dataset.build_eval_dataloader)
                    getattr(batches, "close", lambda: None)()
                if "images" not in self.metrics.totals:
                    raise ValueError("got no images; use at least as many images as there are ranks")
        finally:
            self.vae.train(was_training)
        sums = self.metrics.reduce()  # the pass's one reduction over ranks
        mean, std, *factors = latent_statistics(sums, "samples")
        result = EvalResult(mean.tolist(), std.tolist(), *factors, int(sums["images"]))
        if "view.count" in sums:
            view_mean, view_std, *_ = latent_statistics(sums, "view")
            result.view_mean, result.view_var = view_mean.tolist(), (view_std**2).tolist()
            result.listed = self.family.normalisation.listed(result)
        if not reconstruct:
            return result
        result.metrics = self.metrics.means(sums)
        result.metrics["latent_high_frequency_share"] = equivariance.high_frequency_share(sums["spectrum"])
        if self.vf_model is not None:
            result.metrics["vf_alignment_cka"] = linear_cka(sums)
        if self.inception is not None:
            result.metrics["rfid"] = frechet_distance(*feature_statistics(sums, "real"),
                                                      *feature_statistics(sums, "reconstructed"))
        result.grid = make_grid(*(np.concatenate(images) for images in zip(*self.grid)), self.grid_images)
        return result

    def add(self, pixels: paddle.Tensor, reconstruct: bool) -> None:
        """The posterior of `pixels` (resized to --input_size; with --posterior_std its std is that constant) into the
        latent statistics; `reconstruct`: also decode, and add every metric of the reconstructions, clamped to [-1, 1]
        (clips: also flicker)."""
        clips = pixels.ndim == 5
        with half_precision_autocast(self.vae):  # O2: float32 images into half-precision weights
            posterior = self.family.encode(self.vae, encoder_input(pixels, self.input_size))
            if self.posterior_std > 0:
                posterior.std = paddle.full_like(posterior.mean, self.posterior_std)
                posterior.var = paddle.full_like(posterior.mean, self.posterior_std**2)
        self.metrics.add("images", posterior.mean.shape[0])
        add_latents(self.metrics, "samples", posterior.mean, posterior.var)  # (float64 sums, from half precision too)
        view = self.family.normalisation.view(self.vae, posterior)
        if view is not None:
            add_latents(self.metrics, "view", view)
        if not reconstruct:
            return
        with half_precision_autocast(self.vae):  # as the encoder's
            latent = mode = posterior.mode()
            if self.rng is not None and posterior.std is not None:
                noise = paddle.to_tensor(self.rng.standard_normal(posterior.mean.shape).astype(np.float32))
                latent = posterior.mean + posterior.std * noise.astype(posterior.mean.dtype)
            taught = self.teacher.latents(pixels) if self.teacher is not None else None  # distillation
            if taught is None:
                recons = self.family.decode(self.vae, latent)
            else:  # the student decodes the teacher's latents, timed
                latent = taught.astype(mode.dtype)
                recons = distillation.timed(self.metrics, "decode_ms", lambda: self.family.decode(self.vae, latent))
            # the scale diagnostic decodes halved latents, which a decoder may not take (LTX-2's reflect padding at
            # 2x2), nor one of a fixed output size
            pairs = {} if clips or taught is not None else equivariance.equivariance_pairs(
                lambda z: self.family.decode(self.vae, z), pixels, mode, scale=self.geometry.output_size is None
                and min(mode.shape[2:]) // 2 >= self.geometry.min_latent_side)
        recons = recons.astype("float32").clip(-1.0, 1.0)
        missing = self.grid_images - sum(len(inputs) for inputs, _ in self.grid)
        if missing > 0:
            self.grid.append((pixels[:missing].numpy(), recons[:missing].numpy()))
        if clips:
            self.metrics.update("flicker", clips_part.flicker(to_unit_range(pixels), to_unit_range(recons)))
            pixels, recons, mode = fold_frames(pixels), fold_frames(recons), fold_frames(mode)
        unit_pixels, unit_recons = to_unit_range(pixels), to_unit_range(recons)
        frame_psnr = psnr(unit_pixels, unit_recons)
        self.metrics.update("psnr", frame_psnr)
        if clips:  # grouped by the frames one latent frame codes after the first
            clips_part.add_position_psnrs(self.metrics, frame_psnr, posterior.mean.shape[0], self.geometry.frames)
        self.metrics.update("ssim", ssim(unit_pixels, unit_recons))
        if unit_pixels.shape[1] == 4:
            self.metrics.update("alpha_psnr", psnr(unit_pixels[:, 3:], unit_recons[:, 3:], ALPHA_MSE_FLOOR))
        for name, (decoded, target) in pairs.items():  # {name: (decode(tau(z)), tau(x))}
            self.metrics.update(name, psnr(to_unit_range(target), to_unit_range(decoded.astype("float32").clip(-1, 1))))
        self.metrics.add("spectrum", equivariance.spectrum_energies(mode))
        if self.vf_model is not None:
            features, grid = self.vf_model.patch_tokens(over_grey(pixels))
            add_cka_tokens(self.metrics, to_token_grid(mode, grid), features)
        if self.lpips is not None:
            self.metrics.update("lpips", self.lpips(over_grey(pixels), over_grey(recons)).reshape([-1]))
        if self.inception is not None:
            add_features(self.metrics, "real", self.inception(over_grey(pixels)))
            add_features(self.metrics, "reconstructed", self.inception(over_grey(recons)))
        if taught is not None:
            distillation.add_teacher_metrics(self.metrics, self.lpips, self.teacher, pixels, recons,
                                             mode.astype("float32"), taught)


def evaluate_vae(vae: paddle.nn.Layer, batches: Iterable[Any], lpips: paddle.nn.Layer | None = None,
                 inception: paddle.nn.Layer | None = None, sample_posterior: bool = False, seed: int = 0,
                 grid_images: int = 8, input_size: list[int] | None = None, posterior_std: float = 0.0,
                 tiling: int | None = None, vf_model: paddle.nn.Layer | None = None, teacher=None) -> EvalResult:
    """Reconstruct the images of `batches` (this rank's) and measure them as `EvalProtocol` states.
    `sample_posterior` decodes a sample (noise seeded by `seed` + rank, not the global generator); a
    `teacher` (models/teacher.py): the student `vae` decodes the teacher's latents, measured against both. `lpips`
    and `inception` as their loaders give them: frozen, no batch statistics (models/lpips.freeze,
    load_fid_inception)."""
    rng = np.random.default_rng(seed + rank()) if sample_posterior else None
    evaluation = _Pass(vae, input_size, posterior_std, lpips, inception, grid_images, vf_model, rng, teacher)
    return evaluation.run(batches, tiling, reconstruct=True)


def measure_latents(vae: paddle.nn.Layer, batches: Iterable[Any], input_size: list[int] | None = None,
                    posterior_std: float = 0.0, tiling: int | None = None) -> EvalResult:
    """Latent statistics of `batches` from the encoder alone (what a scaling factor needs); collective."""
    return _Pass(vae, input_size, posterior_std).run(batches, tiling, reconstruct=False)


def measure_latents_of(vae: paddle.nn.Layer, ema, data: str, resolution: int, batch_size: int | None, num_images: int,
                       input_size: list[int] | None = None, posterior_std: float = 0.0, tiling: int | None = None,
                       sample_seed: int | None = None, **frames: int) -> tuple[EvalResult, str]:
    """Latent statistics of `vae` (the EMA's weights if given) over the first `num_images` images (`frames`: clips) of
    `data` (`sample_seed`: of a random sample), and where they come from (latent_stats.json)."""
    sample = RecordSample(read_sources(data, videos=bool(frames)), sample_seed) if sample_seed is not None else None
    loader = build_eval_dataloader(data, resolution, eval_batch_size(resolution, batch_size), rank(), world_size(),
                                   num_images, sample, channels=image_channels(vae), **frames)
    with ema_weights(ema, vae):
        stats = measure_latents(vae, loader, input_size, posterior_std, tiling)
    images = (f"a random sample (seed {sample_seed}) of {stats.num_images} of the {sample.total} images" if sample
              else f"{stats.num_images} images")
    return stats, f"an encoder-only pass over {images} of {data}{tiles_note(tiling, resolution)}"


def protocol_of(vae: paddle.nn.Layer, result: EvalResult, **settings: Any) -> EvalProtocol:
    """The protocol of `result`, measured on `vae` with `settings` (EvalProtocol's fields)."""
    family = family_of(vae)
    return EvalProtocol(metrics=tuple(result.metrics),
                        family_items=family.normalisation.protocol(result.view_mean is not None),
                        deterministic=family.geometry(vae.config).deterministic, tiling_method=family.tiling,
                        channels=image_channels(vae), **settings)


def result_record(result: EvalResult, protocol: EvalProtocol) -> dict:
    """An evaluation's numbers with their protocol: eval_vae.py's metrics.json, a line of eval_metrics.jsonl."""
    return {"metrics": result.metrics, "protocol": protocol.describe(), **{name: getattr(result, name) for name in (
        "latent_mean", "latent_std", "scaling_factor", "shift_factor", "num_images")}, **result.listed}


class TrainingEvaluator:
    """Evaluation during training, the same in both drivers: logs, appends to eval_metrics.jsonl, tracks
    --metric_for_best_model, and keeps its last result for the export's latent statistics."""

    def __init__(self, data_args, args, networks, lpips=None, inception=None):
        self.data_args, self.args, self.networks = data_args, args, networks  # build.Networks: evaluated as trained
        self.input_size, self.posterior_std = networks.model.input_size, networks.model.posterior_std
        self.lpips, self.inception = lpips, inception
        self.metric = args.metric_for_best_model  # one of HIGHER_IS_BETTER (the flag's choices) or None
        self.batch_size = eval_batch_size(data_args.resolution, getattr(args, "per_device_eval_batch_size", None),
                                          getattr(args, "per_device_train_batch_size", None))
        self.tiling = (data_args.eval_tile_size or DEFAULT_TILE_SIZE) if data_args.eval_tiled else None  # px
        frames = {name: getattr(data_args, name, 1) for name in ("num_frames", "frame_stride")}
        self.clip_frames = frames if frames["num_frames"] > 1 else {}  # the loaders' and the protocol's clip arguments
        self.enabled = bool(data_args.eval_file_list) and bool(args.eval_steps)  # (--eval_steps < 1: refused)
        self.last: tuple[int, EvalResult, bool] | None = None  # (step, result, of the EMA weights?)
        self.logged_protocol: str | None = None  # logged once per run (and again if it changes)
        if self.enabled and inception is None:  # once per run (eval_vae.py prints its own)
            logger.info("rFID skipped: no Inception model given (--inception_weights, converted FID weights)")
        ranks = world_size()  # at start-up, not after training: every rank evaluates and measures its share
        if self.enabled and data_args.eval_num_images < ranks:
            raise ValueError(f"--eval_num_images {data_args.eval_num_images} is smaller than the number of ranks "
                             f"({ranks}): every rank evaluates its share")
        lists = {"--file_list": data_args.file_list, "--eval_file_list": self.enabled and data_args.eval_file_list}
        for flag, data in lists.items() if self.clip_frames else ():  # read as clips
            if data and not any(  # a video file, or a shard (which may hold some)
                    part.kind == CLIP_TAR or part.path.lower().endswith(VIDEO_SUFFIXES)
                    for source in read_sources(data, False, True) for part in source.parts):
                raise ValueError(f"{flag} {data} names no video file, and --num_frames {frames['num_frames']} "
                                 "reads clips (evaluations and latent statistics skip images): give videos")
        wanted = data_args.latent_stats_num_images
        if wanted is not None and wanted < max(1, ranks):
            raise ValueError(f"--latent_stats_num_images {wanted} must be at least 1 and at least the number of ranks "
                             f"({ranks}): every rank measures its share of the images")

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.args.eval_steps == 0 or step == self.args.max_steps)

    @property
    def latent_stats_data(self) -> tuple[str, int, int | None]:
        """(images, how many, the seed of their random sample) for the export's latent statistics: the first ones of
        --eval_file_list, else a random sample of --file_list (training data may be sorted: by source, by name)."""
        data, normalisation = self.data_args, self.networks.model.family.normalisation
        training = normalisation.on_training_data or not data.eval_file_list  # RAE's stat.pt: of the training data
        path = data.file_list if training else data.eval_file_list
        return path, data.latent_stats_num_images or data.eval_num_images, self.args.seed if training else None

    def evaluate(self, vae, ema=None) -> EvalResult:
        """Evaluate `vae` (with the EMA weights if given) on --eval_file_list."""
        loader = build_eval_dataloader(self.data_args.eval_file_list, self.data_args.resolution, self.batch_size,
                                       rank(), world_size(), self.data_args.eval_num_images,
                                       channels=image_channels(vae), **self.clip_frames)
        with ema_weights(ema, vae):
            return evaluate_vae(vae, loader, lpips=self.lpips, inception=self.inception, input_size=self.input_size,
                                grid_images=self.args.num_logged_images, posterior_std=self.posterior_std,
                                tiling=self.tiling, vf_model=self.networks.vf_model, teacher=self.networks.teacher)

    def latent_stats(self, vae, ema, step: int, measure: bool = True) -> tuple[EvalResult | None, str | None]:
        """Latent statistics of the weights of `step` (the EMA's if given) and their source: that step's evaluation if
        it measured these weights on the export's images, else a new pass (`measure`), else (None, None)."""
        path, num_images, seed = self.latent_stats_data
        if (self.last is not None and self.last[0] == step and self.last[2] == (ema is not None)
                and (path, num_images, seed) == (self.data_args.eval_file_list, self.data_args.eval_num_images, None)):
            return self.last[1], f"the evaluation at step {step}{tiles_note(self.tiling, self.data_args.resolution)}"
        if not measure:
            return None, None
        return measure_latents_of(vae, ema, path, self.data_args.resolution, self.batch_size, num_images,
                                  self.input_size, self.posterior_std, self.tiling, seed, **self.clip_frames)

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
        teacher = self.networks.teacher
        protocol = protocol_of(vae, result, resolution=self.data_args.resolution, input_size=self.input_size,
                               tiling=self.tiling, teacher=teacher.source if teacher else "", **self.clip_frames)
        text = protocol.text()
        stated = "" if text == self.logged_protocol else f"\nprotocol (once per run, in {EVAL_METRICS_NAME}):\n{text}"
        self.logged_protocol = text
        logger.info("eval at step %d on %d %s%s: %s%s", step, result.num_images,
                    "clips" if self.clip_frames else "images", " (EMA weights)" if ema is not None else "",
                    ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()), stated)
        better = False
        if self.metric is not None and self.metric in result.metrics:
            value, best = result.metrics[self.metric], trainer_state.best_metric
            better = best is None or (value > best if HIGHER_IS_BETTER[self.metric] else value < best)
            if better:
                trainer_state.best_metric = value
        record = {"step": step, "weights": "ema" if ema is not None else "raw", **result_record(result, protocol)}
        if self.metric is not None:
            record.update(metric_for_best_model=self.metric, is_best=better)
        with all_ranks_agree(f"writing {EVAL_METRICS_NAME}"):  # rank 0 writes; a failure ends every rank
            self._append_record(record)
        return better

    def _append_record(self, record: dict) -> None:
        """Rank 0 adds a line to eval_metrics.jsonl, dropping those of steps >= this one (before a resume) and
        unreadable ones (a killed run's half line)."""
        if rank() != 0:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)  # the loop writes nothing there before its first save
        path = os.path.join(self.args.output_dir, EVAL_METRICS_NAME)
        kept = []
        if os.path.isfile(path):
            with open(path) as handle:
                kept = [line.rstrip("\n") + "\n" for line in handle
                        if eval_line_step(line) is not None and eval_line_step(line) < record["step"]]
        replace_file(path, "".join(kept + [json.dumps(record) + "\n"]))  # durable: best model, history
