"""The latent scale (`scaling_factor` / `shift_factor`, or what the family normalises by: FLUX.2's bn statistics) at
loading and at export, and `vae/latent_stats.json` (docs/fine-tuning.md, "The latent scale"). Loaded encoder weights
keep their source's scale (`settle`), a fresh encoder has it measured at export, `--scaling_factor keep|measure|N`
wins (`decide`); the family's normalisation (latent_normalisation.py) says which config keys hold it, how a
measurement sets it and how it is described."""

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from paddle.nn import Layer

from ..checkpoint import checkpoint_export_config, checkpoint_vae_config, read_json
from .families import family_of
from .family import constructor_defaults

logger = logging.getLogger("vae_trainer")

Mode = Union[str, float]  # "keep", "measure" or a number
LATENT_SCALE_KEYS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std")
DEFAULT_SCALING_FACTOR = 0.18215  # ppdiffusers' default, Stable Diffusion's (SDXL: 0.13025, FLUX: 0.3611)
# Where a VAE's scale came from: an attribute of the built VAE, and an entry of a checkpoint's export_config.json.
EXPORT_ORIGIN_KEY = "latent_scale_origin"

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("latent_stats_num_images",), lambda f: not f.measures_scale, "it counts the images of a measured scaling "
     "factor, and this run keeps or is given its factor: add --scaling_factor measure, or drop it"),
)


def settle(vae: Layer, config_file: Optional[str] = None, pretrained: Optional[str] = None,
           single_file: bool = False, init_from_ckpt: Optional[str] = None, ignore_keys: Sequence[str] = ()) -> None:
    """Give `vae` the latent scale of its sources, its encoder weights' first, and where it came from (`origin_of`)."""
    family = family_of(vae)
    normalisation = family.normalisation
    if normalisation.origin:  # a distilled student's: the teacher's normalised latents, whatever its sources
        setattr(vae, EXPORT_ORIGIN_KEY, normalisation.origin)
        return
    sources = _sources(config_file, pretrained, single_file, init_from_ckpt)
    loaded, reinitialised = bool(pretrained or init_from_ckpt), reinitialises_encoder(ignore_keys, family)
    chosen: Dict[str, Tuple[str, Any, str]] = {}  # key -> (source name, value, origin)
    for name, entries, kept_origin in sources:
        for key, value in entries.items():
            if key not in normalisation.keys:
                if value is not None:  # e.g. FLUX.2's: its bn statistics
                    logger.warning("%s states %s, which %s does not have: ignored (its %s is kept or measured by "
                                   "--scaling_factor keep|measure)", name, key, family.class_name, normalisation.name)
            elif key not in chosen:
                chosen[key] = (name, value, kept_origin)
            elif chosen[key][1] != value:
                _warn_conflict(key, chosen[key][:2], (name, value), reinitialised)
    names = [name for name, _, _ in sources]
    unstated = (f"neither {' nor '.join(names)} states a scaling_factor" if len(names) > 1
                else f"{names[0] if names else 'the VAE'} states no scaling_factor")
    default = constructor_defaults(family).get("scaling_factor")
    if not normalisation.numbers:  # statistics: in the weights (FLUX.2's bn) or the config (Wan's)
        name = normalisation.held or normalisation.name
        origin = (f"the {name} kept from {names[0]}" if loaded and not reinitialised
                  else f"the {name} of a fresh VAE" + (" (mean 0, variance 1)" if normalisation.held else ""))
    elif "scaling_factor" in chosen:
        origin = chosen["scaling_factor"][2]
    elif default == DEFAULT_SCALING_FACTOR:
        origin = f"Stable Diffusion's {DEFAULT_SCALING_FACTOR} (ppdiffusers' default), assumed: {unstated}"
        if loaded and not reinitialised:
            logger.warning("%s: Stable Diffusion's %s is assumed. For another VAE give its factor, e.g. SDXL's: "
                           "--scaling_factor 0.13025 (the exported factor), or a config stating it, "
                           "--vae_config_file configs/sdxl_vae.json", unstated, DEFAULT_SCALING_FACTOR)
    else:
        origin = f"{family.class_name}'s default {default}, assumed: {unstated}"
        if loaded and not reinitialised:
            logger.warning("%s: %s's default %s is assumed; give the factor with --scaling_factor", unstated,
                           family.class_name, default)
    vae.register_to_config(**{key: value for key, (_, value, _) in chosen.items()})
    setattr(vae, EXPORT_ORIGIN_KEY, origin)


def _sources(config_file: Optional[str], pretrained: Optional[str], single_file: bool,
             init_from_ckpt: Optional[str]) -> List[Tuple[str, Dict[str, Any], str]]:
    """(name, the latent-scale entries it states, origin when its factor is kept) of each source."""
    sources = []
    if init_from_ckpt:  # a checkpoint's run's factor (not one measured at export), or the config.json beside a file
        name, entries, origin = f"the --init_from_ckpt weights {init_from_ckpt}", {}, ""
        exported, run_config = checkpoint_export_config(init_from_ckpt), checkpoint_vae_config(init_from_ckpt)
        beside = checkpoint_vae_config(init_from_ckpt, "config.json")
        if exported is not None and exported.get("scaling_factor") != "measure" and run_config is not None:
            entries, origin = _stated(run_config), f"kept from the checkpoint {init_from_ckpt} (its run's factor)"
            if exported.get("scaling_factor") != "keep":
                entries["scaling_factor"] = float(exported.get("scaling_factor"))
        elif exported is None and beside:
            entries, origin = _stated(beside), f"kept from {beside}, beside {init_from_ckpt}"
        sources.append((name, entries, origin))
    if pretrained:  # a single file holds tensors only
        name = f"the single file {pretrained}" if single_file else f"the pretrained VAE {pretrained}"
        sources.append((name, {}, "") if single_file else (name, _stated(pretrained), f"kept from {name}"))
    if config_file or (not pretrained and not sources[0][1]):  # or the checkpoint's architecture, for its factor
        name = f"--vae_config_file {config_file}" if config_file else f"the vae_config.json of {init_from_ckpt}"
        sources.append((name, _stated(config_file or checkpoint_vae_config(init_from_ckpt)), f"from {name}"))
    return sources


def _stated(path: str) -> Dict[str, Any]:
    """The latent-scale entries a config JSON (or a folder's config.json) states; a null one states "no shift"."""
    config = read_json(os.path.join(path, "config.json") if os.path.isdir(path) else path)
    return {key: config[key] for key in LATENT_SCALE_KEYS if key in config}


def _warn_conflict(key: str, kept: Tuple[str, Any], other: Tuple[str, Any], reinitialised: bool) -> None:
    measured = key == "scaling_factor" or (key == "shift_factor" and kept[1] is not None)  # what "measure" writes
    if reinitialised and measured:
        why = f"but the encoder is re-initialised (--ignore_keys), so the exported {key} is measured at export"
    elif reinitialised:
        why = ("the encoder is re-initialised (--ignore_keys); only scaling_factor and shift_factor are measured "
               "at export")
    else:
        why = "the scale of the latent space the encoder's weights come from"
    choose = (f"--scaling_factor {other[1]} exports {other[1]}, --scaling_factor keep exports {kept[1]}"
              if key == "scaling_factor" else "only the scaling_factor can be chosen, with --scaling_factor")
    logger.warning("%s states %s %s, %s %s: keeping %s, %s; %s", other[0], key, other[1], kept[0], kept[1], kept[1],
                   why, choose)


def origin_of(vae: Layer) -> str:
    return getattr(vae, EXPORT_ORIGIN_KEY, "kept from the VAE's config")


def reinitialises_encoder(ignore_keys: Optional[Sequence[str]], family=None) -> bool:
    """Do --ignore_keys leave a weight that defines the latent (the family's, else any family's) freshly initialised?"""
    prefixes = family.encoder_prefixes if family is not None else ("encoder.", "quant_conv.", "bn.")
    return any(prefix.startswith(name) or name.startswith(prefix) for prefix in ignore_keys or () for name in prefixes)


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


def scaling_factor_mode(model_args, vae: Optional[Layer] = None, encoder_frozen: bool = False) -> Mode:
    """--scaling_factor; not given: keep when the encoder's weights are loaded and not re-initialised, else measure
    (also for an --init_from_ckpt checkpoint whose run measured its factor: the checkpoint does not hold it). With the
    VAE built, checked against it (FLUX.2's has no scaling factor) and whether its encoder trains (`encoder_frozen`:
    --freeze_encoder, or --trainable_modules that leave it out)."""
    mode = parse_scaling_factor(model_args.scaling_factor)
    if mode is None and getattr(model_args, "teacher_model_name_or_path", None):  # a student's scale is fixed: 1
        mode = "keep"
    elif mode is None and reinitialises_encoder(model_args.ignore_keys):
        mode = "measure"
    elif mode is None and getattr(model_args, "init_from_ckpt", None):
        exported = checkpoint_export_config(model_args.init_from_ckpt) or {}
        mode = "measure" if exported.get("scaling_factor") == "measure" else "keep"
    elif mode is None:
        mode = "keep" if model_args.pretrained_model_name_or_path else "measure"
    problem = vae is not None and family_of(vae).normalisation.refusal(vae, mode, encoder_frozen)
    if problem:
        raise ValueError(problem)
    return mode


def mode_of_checkpoint(given: Optional[str], export_config: Dict[str, Any]) -> Mode:
    """scripts/export_vae.py's mode: its --scaling_factor, else the run's (export_config.json), else "keep"."""
    return (parse_scaling_factor(given) or parse_scaling_factor(export_config.get("scaling_factor"))) or "keep"


def decide(mode: Mode, vae: Layer, stats=None, measured_on: Optional[str] = None, weights: Optional[str] = None,
           unmeasured: str = "scripts/eval_vae.py measures the statistics of any VAE folder",
           origin: Optional[str] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(updates for `save_vae`, the latent_stats.json record) of exporting `weights` of `vae` under `mode`."""
    family = family_of(vae)
    normalisation = family.normalisation
    if mode == "measure":
        if stats is None:
            raise ValueError("measuring the latent scale needs the exported weights' latent statistics")
        updates, source = normalisation.measured(vae, stats), f"measured on {measured_on}"
    elif mode == "keep":
        updates, source = {}, origin or origin_of(vae)
    elif not normalisation.numbers:
        raise ValueError(f"--scaling_factor {mode}: {family.class_name} has no scaling_factor (use keep or measure)")
    else:
        updates, source = {"scaling_factor": float(mode)}, "given by --scaling_factor"
    scale, text = normalisation.record(vae, updates)
    record: Dict[str, Any] = {**scale, "latents_mean": None, "latents_std": None, "source": source, "weights": weights,
                              "measured": None}
    if stats is None:
        record["note"] = f"not measured: the {normalisation.name} is {source}; {unmeasured}"
    else:
        deterministic = family.geometry(vae.config).deterministic
        record.update(latents_mean=stats.latent_mean, latents_std=stats.latent_std, measured={
            "from": measured_on, "num_images": stats.num_images, **normalisation.measured_record(stats, deterministic)})
        if normalisation.numbers:
            logger.info("latent statistics over %d images (%s): per-channel mean %s, std %s; suggested scaling_factor "
                        "%.5g, shift_factor %.5g", stats.num_images, measured_on,
                        [round(v, 4) for v in stats.latent_mean], [round(v, 4) for v in stats.latent_std],
                        stats.scaling_factor, stats.shift_factor)
    logger.info("exported %s (%s)", text, f"{source}; {weights}" if weights else source)
    return updates, record


def latent_scales_at_export(mode: Mode, vae: Layer, ema, evaluator, step: int,
                            encoder_frozen: bool = False) -> Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]]:
    """{"vae": `decide`'s pair} for the exported weights (the EMA's if any), and "vae_raw" with an EMA. Statistics
    come from the last evaluation of the same weights, else, for "measure", an encoder-only pass: call on every rank."""
    how = "scripts/eval_vae.py --vae on this folder measures its statistics"
    stats, source = evaluator.latent_stats(vae, ema, step, measure=mode == "measure")
    weights = "the EMA weights (--use_ema)" if ema is not None else "the trained weights"
    scales = {"vae": decide(mode, vae, stats, source, weights,
                            f"no evaluation of these weights ran at the last step (step {step}); {how}")}
    if ema is None:
        return scales
    if encoder_frozen:  # the raw encoder is the EMA's, bit for bit: the same statistics
        source = source and f"{source}, with the EMA weights, whose encoder is the raw one (--freeze_encoder)"
    else:
        stats, source = evaluator.latent_stats(vae, None, step, measure=mode == "measure")
    scales["vae_raw"] = decide(mode, vae, stats, source, "the raw weights (vae/ holds the EMA weights)",
                               "evaluations measure the EMA weights (vae/), and a factor that is not measured needs no "
                               f"pass over the raw ones; {how}")
    return scales
