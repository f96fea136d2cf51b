"""The latent scale written into an exported VAE: the --scaling_factor policy and `vae/latent_stats.json`.

A diffusion model is trained on `(z - shift_factor) * scaling_factor` (SD: shift 0). Those numbers belong
to the latent space, so:
- fine-tuning a pretrained VAE (or continuing from a checkpoint, --init_from_ckpt) whose encoder is loaded
  KEEPS its `scaling_factor` / `shift_factor` (SD 0.18215, SDXL 0.13025, FLUX 0.3611 / 0.1159): a UNet/DiT
  trained on the old latents keeps receiving what it expects;
- training from scratch (or with the encoder re-initialised) MEASURES them: `scaling_factor = 1 / std`,
  `shift_factor = mean` (written only for VAEs whose config has a shift_factor), over all channels of the
  posterior samples of --latent_stats_num_images images, computed exactly in expectation from the
  posterior means and variances (see `metrics.LatentStatistics`);
- `--scaling_factor keep|measure|<number>` overrides (a number sets scaling_factor, shift_factor is kept).

No unrequested work at export: the statistics come from the last in-training evaluation when it measured
the exported weights on the same images; otherwise, only when the factor is measured, from an
encoder-only pass (`evaluation.measure_latents`: no decoder, LPIPS or rFID). When the factor is kept or
given and no evaluation ran, nothing is measured. `latent_stats.json` beside each exported VAE (vae/ and,
with an EMA, vae_raw/) always says which factors were written, where they come from, which weights, and
the measured statistics when there are some. With --posterior_std the statistics are those of the
constant-std posterior that the export gives (evaluation.py).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Optional, Tuple, Union

logger = logging.getLogger("vae_trainer")

LATENT_STATS_NAME = "latent_stats.json"
Mode = Union[str, float]  # "keep", "measure" or a number


def _touches_encoder(prefix: str) -> bool:
    """Does an --ignore_keys prefix leave some encoder or quant_conv weight freshly initialised?"""
    return any(prefix.startswith(name) or name.startswith(prefix) for name in ("encoder.", "quant_conv."))


def scaling_factor_mode(model_args) -> Mode:
    """--scaling_factor as "keep", "measure" or a float; the default when it is not given: `default_mode`."""
    mode = parse_scaling_factor(model_args.scaling_factor)
    return default_mode(model_args) if mode is None else mode


def parse_scaling_factor(value: Optional[str]) -> Optional[Mode]:
    """A --scaling_factor value as "keep", "measure" or a number > 0; None for "not given" (None, "", "auto")."""
    if value in (None, "", "auto"):
        return None
    if value in ("keep", "measure"):
        return value
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--scaling_factor must be keep, measure or a number, got {value!r}") from None
    if not number > 0:
        raise ValueError(f"--scaling_factor must be > 0, got {value}")
    return number


def default_mode(model_args) -> Mode:
    """Keep when the encoder's weights are loaded (--pretrained_model_name_or_path or --init_from_ckpt, not
    re-initialised by --ignore_keys): its latents are those a diffusion model was trained on, and the VAE's
    config holds their scale (models/vae_loading.py carries it over). Measure otherwise, and for an
    --init_from_ckpt checkpoint whose run measured its factor (at its export; the checkpoint does not hold it)."""
    from .checkpoint import checkpoint_export_config

    if any(_touches_encoder(p) for p in model_args.ignore_keys or ()):
        return "measure"
    if getattr(model_args, "init_from_ckpt", None):
        exported = checkpoint_export_config(model_args.init_from_ckpt)
        return "measure" if exported is not None and exported.get("scaling_factor") == "measure" else "keep"
    return "keep" if model_args.pretrained_model_name_or_path else "measure"


def decide(mode: Mode, vae_config, stats=None, stats_source: Optional[str] = None, weights: Optional[str] = None,
           unmeasured: str = "scripts/eval_vae.py measures the statistics of any VAE folder",
           ) -> Tuple[Dict[str, float], Dict[str, Any]]:
    """(config updates for the exported VAE, the latent_stats.json record) from the mode and, if any, the
    measured `stats` (an `evaluation.LatentStats`) of the exported `weights` ("the EMA weights", ...).
    "measure" needs `stats`. `unmeasured` completes the record's note when nothing was measured: why, and
    how to measure."""
    uses_shift = vae_config.get("shift_factor") is not None
    if mode == "measure":
        if stats is None:
            raise ValueError("measuring the scaling factor needs latent statistics")
        updates = {"scaling_factor": stats.scaling_factor}
        if uses_shift:
            updates["shift_factor"] = stats.shift_factor
        source = f"measured on {stats_source}"
    elif mode == "keep":
        updates, source = {}, "kept from the VAE's config"
    else:
        updates, source = {"scaling_factor": float(mode)}, "given by --scaling_factor"
    record: Dict[str, Any] = {
        "scaling_factor": updates.get("scaling_factor", vae_config.get("scaling_factor")),
        "shift_factor": updates.get("shift_factor", vae_config.get("shift_factor")),
        "source": source,
        "weights": weights,
        "measured": None,
    }
    if stats is not None:
        record["measured"] = {
            "from": stats_source, "num_images": stats.num_images,
            "statistic": "posterior samples, exact expectation from the posterior means and variances",
            "latent_mean": stats.latent_mean, "latent_std": stats.latent_std,
            "suggested_scaling_factor": stats.scaling_factor, "suggested_shift_factor": stats.shift_factor,
        }
        logger.info("latent statistics over %d images (%s): per-channel mean %s, std %s; suggested scaling_factor "
                    "%.5g, shift_factor %.5g", stats.num_images, stats_source,
                    [round(v, 4) for v in stats.latent_mean], [round(v, 4) for v in stats.latent_std],
                    stats.scaling_factor, stats.shift_factor)
    else:
        record["note"] = f"not measured: the scaling factor is {source}; {unmeasured}"
    logger.info("exported scaling_factor %s, shift_factor %s (%s%s)", record["scaling_factor"], record["shift_factor"],
                source, f"; {weights}" if weights else "")
    return updates, record


def latent_scales_at_export(mode: Mode, vae, ema, evaluator, step: int,
                            encoder_frozen: bool = False) -> Dict[str, Tuple[Dict[str, float], Dict[str, Any]]]:
    """{"vae": (config updates, latent_stats.json record)}, and "vae_raw" for the raw weights when there is an
    EMA. The statistics are those that cost nothing (the last evaluation of the same weights) or, when the
    factor is measured, an encoder-only pass. The raw weights are a latent space of their own when the
    encoder trained, so a measured factor is measured on them separately (one more encoder-only pass); with
    --freeze_encoder their encoder is the EMA's, bit for bit, and shares its statistics.
    Call on every rank (the passes are collectives)."""
    how_to_measure = "scripts/eval_vae.py --vae on this folder measures its statistics"
    stats, source = None, None
    if mode == "measure" or evaluator.evaluated_at(step, ema):
        stats, source = evaluator.latent_stats(vae, ema, step)
    weights = "the EMA weights (--use_ema)" if ema is not None else "the trained weights"
    scales = {"vae": decide(mode, vae.config, stats, source, weights,
                            f"no evaluation of these weights ran at the last step (step {step}); {how_to_measure}")}
    if ema is None:
        return scales
    raw_weights = "the raw weights (vae/ holds the EMA weights)"
    if encoder_frozen:
        if source is not None:
            source = f"{source}, with the EMA weights, whose encoder is the raw one (--freeze_encoder)"
    elif mode == "measure" or evaluator.evaluated_at(step, None):
        stats, source = evaluator.latent_stats(vae, None, step)
    else:
        stats, source = None, None
    scales["vae_raw"] = decide(mode, vae.config, stats, source, raw_weights,
                               f"evaluations measure the EMA weights (vae/), and a factor that is not measured needs no "
                               f"pass over the raw ones; {how_to_measure}")
    return scales


def write_latent_stats(vae_dir: str, record: Dict[str, Any]) -> None:
    with open(os.path.join(vae_dir, LATENT_STATS_NAME), "w") as handle:
        json.dump(record, handle, indent=2)
