"""The latent scale: the one home of the rule that decides a VAE's `scaling_factor`, `shift_factor`,
`latents_mean` and `latents_std`, from loading to export, and of `vae/latent_stats.json`.

Owns, in the order a run meets them:
- at loading (`settle`, called by models/vae_loading.py `build_vae`): which source's latent scale the VAE
  carries. The latent space is the one the encoder's weights come from, so the scale stated by the
  source of those weights (a pretrained VAE's config.json; for --init_from_ckpt, its run's) is KEPT
  whatever --vae_config_file says; a config file that states another value gets a warning naming both
  values and `--scaling_factor`, the flag that chooses the exported one. Entries the weights' source does
  not state come from the config file, else ppdiffusers' default (0.18215); a single file without config
  states none, and Stable Diffusion's is assumed for it here (`assumed_for_single_file`, one warning). With
  the encoder re-initialised by --ignore_keys the warnings say that the factor is measured at export. The
  VAE remembers where its factor came from (`origin_of`), so that every log line and latent_stats.json say
  it truthfully;
- at export (`decide`, `latent_scales_at_export`; for scripts/export_vae.py, `mode_of_checkpoint`): what the
  exported config.json holds.

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
FLUX.2's VAE (models/flux2.py AutoencoderKLFlux2, also ERNIE-Image's) has no scaling_factor: its latent scale
is the latent normalisation its `bn` holds, the running mean and variance of the 2x2-patchified posterior
modes. The same rule applies to it: "keep" (the default for loaded encoder weights, and always with
--freeze_encoder) exports the source's statistics; "measure" (the default from scratch) sets them from the
patchified posterior modes of --latent_stats_num_images images (population mean and variance per
patchified channel); a number has no meaning for it and is refused (`mode_for`).
Other modules ask: models/vae_loading.py hands its sources to `settle`, evaluation.py measures the statistics,
models/vae_saving.py writes the updates `decide` returns; none of them chooses a factor itself.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from .checkpoint import checkpoint_export_config, checkpoint_vae_config
from .models.flux2 import CLASS_NAME as FLUX2_CLASS_NAME
from .models.flux2 import BatchNormStatistics, bn_statistics, is_flux2, is_flux2_config

if TYPE_CHECKING:
    from ppdiffusers import AutoencoderKL

logger = logging.getLogger("vae_trainer")

LATENT_STATS_NAME = "latent_stats.json"
Mode = Union[str, float]  # "keep", "measure" or a number
LATENT_SCALE_KEYS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std")
# ppdiffusers' AutoencoderKL default, Stable Diffusion 1.x/2.x's factor (SDXL: 0.13025, FLUX: 0.3611).
DEFAULT_SCALING_FACTOR = 0.18215
SDXL_SCALING_FACTOR = 0.13025  # SDXL's VAE: the same tensors as SD's, another factor (configs/sdxl_vae.json)
_ORIGIN = "latent_scale_origin"  # the attribute of a built VAE saying where its factor came from
_UNKNOWN_ORIGIN = "kept from the VAE's config"
EXPORT_ORIGIN_KEY = "latent_scale_origin"  # the same, in a checkpoint's export_config.json


# ---- loading: which source's latent scale the VAE carries

@dataclass(frozen=True)
class Statement:
    """The latent-scale entries one source states (`entries`), named for messages (`name`), what the
    exported factor's log line says when this source's scaling_factor is kept (`origin`), and, for an entry
    that is assumed rather than stated (`assumed_for_single_file`), the warning `settle` logs when it is kept."""

    entries: Mapping[str, Any]
    name: str
    origin: str
    assumption: str = ""


def stated_entries(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The latent-scale entries a config states (a null entry is a statement: "no shift")."""
    return {key: config[key] for key in LATENT_SCALE_KEYS if key in config}


def _read_config(path: str) -> Dict[str, Any]:
    """A config JSON, or the config.json of a folder."""
    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as handle:
        return json.load(handle)


def of_pretrained(folder: str) -> Statement:
    """What a pretrained VAE folder (ppdiffusers or PyTorch diffusers) states."""
    return Statement(stated_entries(_read_config(folder)), f"the pretrained VAE {folder}",
                     f"kept from the pretrained VAE {folder}")


def of_config_file(path: str, name: Optional[str] = None) -> Statement:
    """What a config file states (--vae_config_file, or the architecture a checkpoint holds)."""
    name = name or f"--vae_config_file {path}"
    return Statement(stated_entries(_read_config(path)), name, f"from {name}")


def of_single_file(path: str) -> Statement:
    """An original LDM single file: tensors only, no latent scale."""
    return Statement({}, f"the single file {path}", "")


def assumed_for_single_file(path: str) -> Statement:
    """A single file without config holds no factor: Stable Diffusion's is assumed (models/vae_loading.py
    infers only the architecture, and refuses files other than 4 latent channels without a config). The one
    warning about it, logged by `settle` when it is kept, names both ways to state another VAE's factor."""
    return Statement({"scaling_factor": DEFAULT_SCALING_FACTOR}, f"the single file {path}",
                     f"Stable Diffusion's {DEFAULT_SCALING_FACTOR}, assumed for the single file {path}, which holds "
                     "no factor",
                     f"{path} holds no scaling_factor: Stable Diffusion's {DEFAULT_SCALING_FACTOR} is assumed. For "
                     f"another VAE state its factor, e.g. for SDXL's: --scaling_factor {SDXL_SCALING_FACTOR} (the "
                     "exported factor), or its config, --vae_config_file configs/sdxl_vae.json")


def of_weights(path: str) -> Statement:
    """What is known of the latent scale of --init_from_ckpt weights (nothing: no entries):
    - a checkpoint of ours: its run's --scaling_factor (export_config.json): "keep" -> the factors in its
      vae_config.json, a number -> that number; "measure" -> unknown (measured only at the run's export,
      from its EMA weights; the checkpoint does not hold it);
    - a weight file inside a VAE folder: the config.json beside it."""
    name = f"the --init_from_ckpt weights {path}"
    exported = checkpoint_export_config(path)
    if exported is not None:
        mode, config_file = exported.get("scaling_factor"), checkpoint_vae_config(path)
        if mode == "measure" or config_file is None:
            return Statement({}, name, "")
        entries = stated_entries(_read_config(config_file))
        if mode != "keep":
            entries["scaling_factor"] = float(mode)
        return Statement(entries, name, f"kept from the checkpoint {path} (its run's factor)")
    beside = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    if os.path.isfile(beside):
        return Statement(stated_entries(_read_config(beside)), name, f"kept from {beside}, beside {path}")
    return Statement({}, name, "")


def settle(vae: AutoencoderKL, statements: Sequence[Statement], weights_loaded: bool = True,
           encoder_reinitialised: bool = False) -> str:
    """Give `vae` the latent scale of `statements`, ordered from the source of its encoder's weights (first)
    to the config file (last): each entry comes from the first statement stating it, and a later statement
    stating another value is warned about. Returns, and remembers on `vae` (`origin_of`), where its
    scaling_factor came from. `weights_loaded`: a missing factor is warned about only for loaded weights
    (a fresh VAE measures its own). `encoder_reinitialised`: --ignore_keys leaves the encoder (or quant_conv)
    freshly initialised (`reinitialises_encoder`), so the exported factor is measured at export (`default_mode`)
    and the warnings say so."""
    if is_flux2(vae):
        origin = _settle_normalisation(statements, weights_loaded, encoder_reinitialised)
        setattr(vae, _ORIGIN, origin)
        return origin
    chosen: Dict[str, Tuple[Any, Statement]] = {}
    for statement in statements:
        for key, value in statement.entries.items():
            if key not in chosen:
                chosen[key] = (value, statement)
            elif chosen[key][0] != value:
                _warn_conflict(key, chosen[key], (value, statement), encoder_reinitialised)
    if chosen:
        vae.register_to_config(**{key: value for key, (value, _) in chosen.items()})
    if "scaling_factor" in chosen:
        kept = chosen["scaling_factor"][1]
        origin = kept.origin
        if kept.assumption and not encoder_reinitialised:
            logger.warning("%s", kept.assumption)
    else:
        unstated = _none_states([statement.name for statement in statements])
        origin = f"ppdiffusers' default {DEFAULT_SCALING_FACTOR}: {unstated}"
        if weights_loaded and not encoder_reinitialised:
            logger.warning("%s: ppdiffusers' default %s (Stable Diffusion's) is written; for another VAE give "
                           "--scaling_factor (SDXL %s)", unstated, DEFAULT_SCALING_FACTOR, SDXL_SCALING_FACTOR)
    setattr(vae, _ORIGIN, origin)
    return origin


def _settle_normalisation(statements: Sequence[Statement], weights_loaded: bool, encoder_reinitialised: bool) -> str:
    """FLUX.2's VAE: its latent scale is its bn statistics, which come with the encoder's weights (the first
    statement's source) or start at mean 0, variance 1; a scaling factor stated anywhere means nothing to it."""
    for statement in statements:
        stated = sorted(key for key, value in statement.entries.items() if value is not None)
        if stated:
            logger.warning("%s states %s, which %s does not have: ignored (its latent scale is the bn statistics, "
                           "kept or measured by --scaling_factor keep|measure)", statement.name, ", ".join(stated),
                           FLUX2_CLASS_NAME)
    if weights_loaded and not encoder_reinitialised and statements:
        return f"the bn statistics kept from {statements[0].name}"
    return "the bn statistics of a fresh VAE (mean 0, variance 1)"


def _none_states(names: Sequence[str]) -> str:
    if len(names) < 2:
        return f"{names[0] if names else 'the VAE'} states no scaling_factor"
    return f"neither {' nor '.join(names)} states a scaling_factor"


def _warn_conflict(key: str, kept: Tuple[Any, Statement], other: Tuple[Any, Statement],
                   encoder_reinitialised: bool = False) -> None:
    """One line naming both values, the one kept (and why), and the flag that chooses the exported factor."""
    measured = key == "scaling_factor" or (key == "shift_factor" and kept[0] is not None)  # what `decide` measures
    if encoder_reinitialised and measured:  # default_mode: the exported factor is measured, not this one
        why = (f"in the VAE's config, but the encoder is re-initialised (--ignore_keys), so the exported {key} is "
               "measured at export")
        choose = (f"--scaling_factor keep exports {kept[0]}, --scaling_factor {other[0]} exports {other[0]}"
                  if key == "scaling_factor" else f"--scaling_factor keep exports {kept[0]}")
    else:
        why = ("in the VAE's config (the encoder is re-initialised by --ignore_keys; only the scaling_factor and "
               "shift_factor are measured at export)" if encoder_reinitialised
               else "the scale of the latent space the encoder's weights come from")
        choose = (f"--scaling_factor {other[0]} exports {other[0]} instead" if key == "scaling_factor"
                  else "only the scaling_factor can be chosen, with --scaling_factor")
    logger.warning("%s states %s %s, %s %s: keeping %s, %s; %s", other[1].name, key, other[0], kept[1].name,
                   kept[0], kept[0], why, choose)


def origin_of(vae: AutoencoderKL) -> str:
    """Where `vae`'s scaling_factor came from (`settle`), for log lines and latent_stats.json."""
    return getattr(vae, _ORIGIN, _UNKNOWN_ORIGIN)


# ---- export: what the exported config.json holds


def _touches_encoder(prefix: str) -> bool:
    """Does an --ignore_keys prefix leave some encoder or quant_conv weight (or FLUX.2's bn statistics)
    freshly initialised?"""
    return any(prefix.startswith(name) or name.startswith(prefix) for name in ("encoder.", "quant_conv.", "bn."))


def reinitialises_encoder(ignore_keys: Optional[Sequence[str]]) -> bool:
    """Do --ignore_keys leave some encoder or quant_conv weight (or FLUX.2's bn statistics) freshly initialised
    (a new latent space, or its scale)?"""
    return any(_touches_encoder(prefix) for prefix in ignore_keys or ())


def scaling_factor_mode(model_args) -> Mode:
    """--scaling_factor as "keep", "measure" or a float; the default when it is not given: `default_mode`."""
    mode = parse_scaling_factor(model_args.scaling_factor)
    return default_mode(model_args) if mode is None else mode


def mode_for(vae: AutoencoderKL, model_args) -> Mode:
    """`scaling_factor_mode`, checked against the VAE built. FLUX.2's VAE has no scaling factor, so a number is
    refused; with --freeze_encoder its bn statistics are kept (measuring them on the user's images would change
    the normalisation a DiT trained on the source's latents expects), so "measure" is refused."""
    mode = scaling_factor_mode(model_args)
    if not is_flux2(vae):
        return mode
    if mode not in ("keep", "measure"):
        raise ValueError(f"--scaling_factor {mode}: {FLUX2_CLASS_NAME} (FLUX.2, ERNIE-Image) has no scaling_factor; its "
                         "pipelines normalise the latents with its bn statistics. Use --scaling_factor keep (the "
                         "source's statistics) or measure (from the trained encoder).")
    if mode == "measure" and getattr(model_args, "freeze_encoder", False):
        raise ValueError(f"--scaling_factor measure with --freeze_encoder: a decoder-only fine-tune of {FLUX2_CLASS_NAME} "
                         "keeps the source's bn statistics (the latent normalisation its DiT was trained with). Drop "
                         "--scaling_factor measure (measure is also the default for a fresh VAE or with --ignore_keys bn.: "
                         "give --scaling_factor keep, or train the encoder).")
    return mode


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


def mode_of_checkpoint(given: Optional[str], export_config: Mapping[str, Any]) -> Mode:
    """The mode of an export from a checkpoint (scripts/export_vae.py): `given` (its --scaling_factor), else
    what the run used (the checkpoint's export_config.json), else "keep" (a checkpoint written before
    export_config.json stated it: the factor its vae_config.json holds)."""
    mode = parse_scaling_factor(given)
    if mode is not None:
        return mode
    return parse_scaling_factor(export_config.get("scaling_factor")) or "keep"


def default_mode(model_args) -> Mode:
    """Keep when the encoder's weights are loaded (--pretrained_model_name_or_path or --init_from_ckpt, not
    re-initialised by --ignore_keys): its latents are those a diffusion model was trained on, and the VAE's
    config holds their scale (`settle` gives it to the VAE). Measure otherwise, and for an
    --init_from_ckpt checkpoint whose run measured its factor (at its export; the checkpoint does not hold it)."""
    if reinitialises_encoder(model_args.ignore_keys):
        return "measure"
    if getattr(model_args, "init_from_ckpt", None):
        exported = checkpoint_export_config(model_args.init_from_ckpt)
        return "measure" if exported is not None and exported.get("scaling_factor") == "measure" else "keep"
    return "keep" if model_args.pretrained_model_name_or_path else "measure"


def decide(mode: Mode, vae_config, stats=None, stats_source: Optional[str] = None, weights: Optional[str] = None,
           unmeasured: str = "scripts/eval_vae.py measures the statistics of any VAE folder",
           origin: str = _UNKNOWN_ORIGIN,
           normalisation: Optional[BatchNormStatistics] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(updates for the exported VAE, the latent_stats.json record) from the mode and, if any, the
    measured `stats` (an `evaluation.LatentStats`) of the exported `weights` ("the EMA weights", ...).
    "measure" needs `stats`. `unmeasured` completes the record's note when nothing was measured: why, and
    how to measure. `origin`: where the VAE's own factor came from (`origin_of`), said when it is kept.
    The updates are config entries (models/vae_saving.py `save_vae` writes them), or for FLUX.2's VAE
    `bn_statistics` (`decide_normalisation`; `normalisation` is the VAE's own, `kept_normalisation`)."""
    if is_flux2_config(vae_config):
        return decide_normalisation(mode, vae_config, normalisation, stats, stats_source, weights, unmeasured, origin)
    uses_shift = vae_config.get("shift_factor") is not None
    if mode == "measure":
        if stats is None:
            raise ValueError("measuring the scaling factor needs latent statistics")
        updates = {"scaling_factor": stats.scaling_factor}
        if uses_shift:
            updates["shift_factor"] = stats.shift_factor
        source = f"measured on {stats_source}"
    elif mode == "keep":
        updates, source = {}, origin
    else:
        updates, source = {"scaling_factor": float(mode)}, "given by --scaling_factor"
    record: Dict[str, Any] = {
        "scaling_factor": updates.get("scaling_factor", vae_config.get("scaling_factor")),
        "shift_factor": updates.get("shift_factor", vae_config.get("shift_factor")),
        **per_channel_normalisation(stats),
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


def per_channel_normalisation(stats=None) -> Dict[str, Optional[list]]:
    """latent_stats.json's `latents_mean` / `latents_std`: the per-channel mean and std of the exported weights'
    posterior samples, for pipelines that normalise with diffusers' `latents_mean` / `latents_std` config
    (SDXL-style ones compute (z - mean) * scaling_factor / std); None when nothing was measured."""
    return {"latents_mean": stats.latent_mean if stats is not None else None,
            "latents_std": stats.latent_std if stats is not None else None}


def kept_normalisation(vae: AutoencoderKL) -> Optional[BatchNormStatistics]:
    """The bn statistics FLUX.2's VAE holds now (what "keep" exports); None for other VAEs."""
    return bn_statistics(vae) if is_flux2(vae) else None


def decide_normalisation(mode: Mode, vae_config, kept: Optional[BatchNormStatistics], stats=None,
                         stats_source: Optional[str] = None, weights: Optional[str] = None,
                         unmeasured: str = "", origin: str = _UNKNOWN_ORIGIN) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """`decide` for FLUX.2's VAE: its bn statistics kept (`kept`, the VAE's own) or, with "measure", the
    population mean and variance of the measured patchified posterior modes; num_batches_tracked then counts
    the images they were measured on (PyTorch's counter; no pipeline reads it)."""
    if mode == "measure":
        if stats is None or stats.patchified_mode_mean is None:
            raise ValueError("measuring the latent normalisation needs the patchified posterior modes' statistics")
        exported = BatchNormStatistics(stats.patchified_mode_mean, stats.patchified_mode_var, stats.num_images)
        updates, source = {"bn_statistics": exported}, f"measured on {stats_source}"
    elif mode == "keep":
        if kept is None:
            raise ValueError("keeping the latent normalisation needs the VAE's bn statistics")
        exported, updates, source = kept, {}, origin
    else:
        raise ValueError(f"--scaling_factor {mode}: {FLUX2_CLASS_NAME} has no scaling_factor (use keep or measure)")
    eps = vae_config.get("batch_norm_eps")
    record: Dict[str, Any] = {"class": FLUX2_CLASS_NAME, "latent_normalisation": exported.record(eps),
                              **per_channel_normalisation(stats), "source": source, "weights": weights, "measured": None}
    if stats is not None:
        record["measured"] = {
            "from": stats_source, "num_images": stats.num_images,
            "statistic": "per patchified channel (2x2 patches of the posterior mode, Flux2Pipeline's order): population "
                         "mean and variance over all images and positions",
            "patchified_mode_mean": stats.patchified_mode_mean, "patchified_mode_var": stats.patchified_mode_var,
            "latent_mean": stats.latent_mean, "latent_std": stats.latent_std,
        }
    else:
        record["note"] = f"not measured: the latent normalisation is {source}; {unmeasured}"
    logger.info("exported latent normalisation (bn running_mean / running_var of %d patchified channels, mean of the "
                "means %.5g, mean of the variances %.5g, eps %s): %s%s", len(exported.running_mean),
                sum(exported.running_mean) / len(exported.running_mean),
                sum(exported.running_var) / len(exported.running_var), eps, source, f"; {weights}" if weights else "")
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
                            f"no evaluation of these weights ran at the last step (step {step}); {how_to_measure}",
                            origin_of(vae), kept_normalisation(vae))}
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
                               f"pass over the raw ones; {how_to_measure}", origin_of(vae), kept_normalisation(vae))
    return scales


def write_latent_stats(vae_dir: str, record: Dict[str, Any]) -> None:
    with open(os.path.join(vae_dir, LATENT_STATS_NAME), "w") as handle:
        json.dump(record, handle, indent=2)
