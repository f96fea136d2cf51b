"""A family's latent normalisation (`Family.normalisation`): what its diffusion pipelines do to the latents before
their model sees them, one value of a few kinds. A kind owns how the normalisation is read (the config keys a
source's values are kept from, latent_scale.settle), measured (from an evaluation's statistics, `measured`),
exported (config entries and weights), described (latent_stats.json, the evaluation protocol) and applied as a
pipeline does (`pipeline`: mean and std, for a distilled student's latent space).

    Scale          (z - shift_factor) * scaling_factor, or SDXL's rule with latents_mean / latents_std  (KL, DC-AE)
                   or one of a fixed origin, never measured nor changed: a student's, in its teacher's space (tiny)
    PerChannel     (z - latents_mean) / latents_std per channel, the lists in the config, z the mode     (Wan, Qwen)
    PerPosition    that per channel and position, applied inside encode, times scaling_factor            (RAE)
    HeldInWeights  statistics held in buffers of the weights                                    (FLUX.2's bn)

Measured statistics are an evaluation's (`evaluation.EvalResult`): per channel of posterior samples, and of the
kind's `view` of a posterior where it has one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import paddle

from .autoencoder_kl_ltx2 import space_time_to_channels

Layer, Tensor = paddle.nn.Layer, paddle.Tensor
Items = Tuple[Tuple[str, str], ...]


class Normalisation:
    """What every kind answers; the defaults are a Scale's."""

    keys: Tuple[str, ...] = ()  # the config entries that hold it, kept from a source at loading
    name = "scaling factor"  # in messages and latent_stats.json
    held = ""  # what the weights hold of it ("bn statistics"), else ""
    on_training_data = False  # measured on --file_list (RAE's stat.pt), not on held-out images
    numbers = True  # a number (--scaling_factor N) can set it
    origin = ""  # where it comes from whatever its sources state (a student's: fixed), else from them (settle)
    # (name, text) its evaluation protocols state, and what they add where the statistics of `view` were measured
    stated: Items = ()
    view_item: Optional[Tuple[str, str]] = None

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """What its statistics are per channel of (NC... float32), if not posterior samples."""
        return None

    def listed(self, result) -> Dict[str, Any]:
        """Its view's statistics as an evaluation record lists them (none: not listed)."""
        return {}

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        """The export's updates (config entries, and weights by state-dict name, which the export writes in place of
        the network's own) from measured statistics."""
        updates = {"scaling_factor": stats.scaling_factor}
        if vae.config.get("shift_factor") is not None:
            updates["shift_factor"] = stats.shift_factor
        return updates

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
        """The exported normalisation, as latent_stats.json states it and as the export's log line does."""
        record = {key: updates.get(key, vae.config.get(key)) for key in ("scaling_factor", "shift_factor")}
        return record, f"scaling_factor {record['scaling_factor']}, shift_factor {record['shift_factor']}"

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        """What latent_stats.json says was measured, beyond where and how many."""
        statistic = ("the latents (the encoder is deterministic)" if deterministic
                     else "posterior samples, exact expectation from the posterior means and variances")
        return {"statistic": statistic, "latent_mean": stats.latent_mean, "latent_std": stats.latent_std,
                "suggested_scaling_factor": stats.scaling_factor, "suggested_shift_factor": stats.shift_factor}

    def protocol(self, measured_view: bool) -> Items:
        """(name, text) an evaluation's protocol adds; `measured_view`: the statistics of `view` were measured."""
        return self.stated + ((self.view_item,) if measured_view and self.view_item else ())

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """(mean, std), float32 [C, p, p]: a diffusion pipeline's latents are (z - mean) / std, z the posterior mode,
        the pattern tiled over latent positions with period p (teacher.to_pipeline); here p = 1 (NCHW image latents: a
        clip's NCTHW ones need a frame axis, [:, None]), from the config's lists, or its scaling factor and shift."""
        config, factor = vae.config, vae.config.get("scaling_factor", 1)  # a PerChannel's config has none: 1
        if config.get("latents_mean") is not None and config.get("latents_std") is not None:
            mean, std = np.asarray(config.latents_mean), np.asarray(config.latents_std) / factor
        else:
            mean = np.full(config.latent_channels, config.get("shift_factor") or 0.0)
            std = np.full(config.latent_channels, 1 / factor)
        return tuple(np.asarray(values, np.float32).reshape(len(values), 1, 1) for values in (mean, std))

    def refusal(self, vae: Layer, mode, encoder_frozen: bool) -> Optional[str]:
        """Why --scaling_factor `mode` ("keep", "measure" or a number) cannot export this network, or None
        (`encoder_frozen`: the latent space does not train)."""
        class_name = type(vae).__name__
        if not self.numbers and mode not in ("keep", "measure"):
            # LTX-2's config has a scaling_factor too, applied after its buffers: kept as the config states it
            factor = ("its scaling_factor is its config's, kept" if "scaling_factor" in self.keys
                      else "has no scaling_factor")
            return (f"--scaling_factor {mode}: {class_name} {factor}; its pipelines normalise the latents "
                    f"with its {self.held or self.name}. Use --scaling_factor keep (the source's statistics) or "
                    "measure (from the trained encoder).")
        if not self.numbers and mode == "measure" and encoder_frozen:
            return (f"--scaling_factor measure with a frozen encoder: a decoder-only fine-tune of {class_name} keeps "
                    f"the source's {self.held or self.name} (the latent normalisation its DiT was trained with). Drop "
                    "--scaling_factor measure (measure is also the default for a fresh VAE or with --ignore_keys of "
                    "the encoder: give --scaling_factor keep, or train the encoder).")
        return None


class Scale(Normalisation):
    """(z - shift_factor) * scaling_factor (the SD, FLUX.1 and SANA pipelines), or with latents_mean / latents_std in
    the config (z - latents_mean) * scaling_factor / latents_std (StableDiffusionXLPipeline's rule). Measured: the
    scaling factor over all channels, and the shift where the config has one. With an `origin`, a scale never
    measured nor changed at export: a distilled student's latents are its teacher's pipeline latents (scaling_factor
    1), whatever its sources state."""

    def __init__(self, keys: Tuple[str, ...] = ("scaling_factor",), origin: str = ""):
        self.keys, self.origin = keys, origin


class PerChannel(Normalisation):
    """(z - latents_mean) / latents_std per channel, z the posterior mode, the lists in the config (diffusers' Wan /
    Qwen-Image pipelines); measured per channel of the posterior modes."""

    keys = ("latents_mean", "latents_std")
    name = "latent normalisation (latents_mean / latents_std)"
    numbers = False
    view_item = ("latent normalisation statistics", "per channel of the posterior mode (what the Wan / Qwen-Image "
                 "pipelines normalise by latents_mean / latents_std), population mean and std over all images and "
                 "positions")
    formula = ("(z - latents_mean) / latents_std per channel, z the posterior mode (diffusers' Wan / Qwen-Image "
               "pipelines)")
    patch_key = ""  # the config key of the patches the pipelines make of the mode first (FLUX.2's), else ""
    records_modes = True  # latent_stats.json lists the modes' mean and std (the derived kinds: what `listed` gives)
    statistic = ("per channel of the posterior mode, population mean and std over all images and positions (what "
                 "latents_mean / latents_std hold)")

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """The mode, what the pipelines normalise (sample_mode="argmax"); patchified as Flux2Pipeline._patchify_latents
        does (LTX-2's space-to-channels, no time stride) where they patchify it."""
        mode = posterior.mode().astype("float32")
        if self.patch_key:
            return space_time_to_channels(mode.unsqueeze(2), (1, *vae.config[self.patch_key])).squeeze(2)
        return mode

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError("measuring latents_mean / latents_std needs the posterior modes' statistics")
        return {"latents_mean": list(stats.view_mean), "latents_std": [float(np.sqrt(v)) for v in stats.view_var]}

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
        values = {key: list(updates.get(key, vae.config[key])) for key in self.keys}
        return ({"class": type(vae).__name__, "latent_normalisation": {**values, "normalisation": self.formula}},
                f"latents_mean / latents_std of {len(values['latents_mean'])} channels")

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        modes = {"mode_mean": stats.view_mean, "mode_std": [float(np.sqrt(v)) for v in stats.view_var or []]}
        return {"statistic": self.statistic, **(modes if self.records_modes else self.listed(stats)),
                "latent_mean": stats.latent_mean, "latent_std": stats.latent_std}


class PerPosition(PerChannel):
    """RAE's: encode itself normalises its tokens, (tokens - latents_mean) / (latents_std + 1e-5) * scaling_factor,
    with statistics per channel and position (the authors' stat.pt: one mean and variance per element of the (C, h, w)
    latent, over ImageNet's training images), stored as diffusers converts stat.pt, latents_std = sqrt(var + 1e-5),
    in the config and as buffers. A posterior's `raw` holds the tokens before it. The scaling factor stays the
    config's; a decoder trained from scratch gets its statistics measured on the training data at export."""

    keys = ("scaling_factor", "latents_mean", "latents_std")
    on_training_data = True
    numbers = True
    records_modes = False
    eps = 1e-5  # stat.pt holds variances; diffusers' conversion stores latents_std = sqrt(var + 1e-5)
    formula = "(tokens - latents_mean) / (latents_std + 1e-5) * scaling_factor, inside encode (diffusers')"
    statistic = ("per channel and position of the encoder's tokens (eval mode: no noise) before the latent "
                 "normalisation, population mean and variance over all images, as RAE's stat.pt; latents_std = "
                 f"sqrt(variance + {eps}), as diffusers converts stat.pt")
    stated = (("latent statistics", f"per channel, of the latents encode returns: {formula}"),)
    view_item = ("token statistics", statistic)

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """The tokens, each channel at each position a "channel" of its own."""
        tokens = posterior.raw.astype("float32")
        return tokens.reshape([tokens.shape[0], -1, 1, 1])

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError(f"measuring {type(vae).__name__}'s latent normalisation needs its token statistics")
        grid = int(vae.config["encoder_input_size"]) // int(vae.config["encoder_patch_size"])
        shape = [int(vae.config["encoder_hidden_size"]), grid, grid]  # (C, h, w) of the tokens: the latent's shape
        mean = np.asarray(stats.view_mean, np.float64).reshape(shape)
        variance = np.asarray(stats.view_var, np.float64).reshape(shape)
        # float32 values in the config, so that config.json and the weights hold the same numbers; also as the
        # buffers diffusers' constructor makes of them (the other buffers go out as loaded: a folder's encoder_mean /
        # encoder_std, which its config need not state)
        mean, std = mean.astype(np.float32), np.sqrt(variance + self.eps).astype(np.float32)
        return {"latents_mean": mean.tolist(), "latents_std": std.tolist(), "_latents_mean": mean, "_latents_std": std}

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
        config = {**vae.config, **updates}
        stated = ("unset: encode normalises nothing but the scaling_factor" if config.get("latents_mean") is None
                  else f"in config.json, shape {list(np.shape(config['latents_mean']))}")
        return ({"scaling_factor": config.get("scaling_factor"), "latent_normalisation": {
            "latents_mean / latents_std": stated, "normalisation": self.formula}},
            f"scaling_factor {config.get('scaling_factor')}, latents_mean / latents_std {stated}")

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        raise ValueError(f"{type(vae).__name__}: its encode already normalises (latents_mean / latents_std per channel "
                         "and position, times scaling_factor), and its decoder returns one fixed size from patch-14 "
                         "tokens: no tiny autoencoder (a power-of-two factor, output size set by the latent) can "
                         "stand in")

    def refusal(self, vae: Layer, mode, encoder_frozen: bool) -> Optional[str]:
        class_name = type(vae).__name__
        if mode == "measure" and vae.config.get("latents_mean") is not None:
            return (f"--scaling_factor measure: this {class_name}'s latents_mean / latents_std are those its diffusion "
                    "model was trained with, and its encoder never trains: a fine-tune keeps them (drop it)")
        if mode not in ("keep", "measure") and vae.config.get("latents_mean") is None:
            return (f"--scaling_factor {mode}: this {class_name} has no latents_mean / latents_std yet (a decoder "
                    "trained from scratch), which --scaling_factor measure (the default here) measures; its "
                    "scaling_factor is the config's (state it in --vae_config_file)")
        return None


class HeldInWeights(PerChannel):
    """Per-channel statistics of the posterior modes, held in buffers of the weights that the forward never applies:
    (z' - mean) / spread, z' the mode (patchified first where the pipeline patchifies it), kept from the source or
    measured at export. FLUX.2's `bn` (`FLUX2_BN`) holds the 2x2-patchified modes' mean and variance (the spread
    sqrt(var + batch_norm_eps); its counter: the images measured); LTX-2's `latents_mean` / `latents_std` buffers
    (`LTX2_BUFFERS`) a mean and std, the pipelines' spread std / scaling_factor."""

    records_modes = False
    name = "latent normalisation"  # numbers False, as a PerChannel's: its statistics are measured or kept, never given

    def __init__(self, held: str, buffers: Mapping[str, str], formula: str, eps_key: str = "", patch_key: str = "",
                 counter: str = "", label: str = "", keys: Tuple[str, ...] = ()):
        self.held, self.formula, self.label = held, formula, label  # held: what the weights hold, for messages
        self.buffers = dict(buffers)  # {mean's name, spread's name: state-dict name}, as latent_stats.json names them
        # eps_key: the spread is a variance, applied as sqrt(var + the config's eps) (a BatchNorm's), else a std
        self.eps_key, self.patch_key, self.counter = eps_key, patch_key, counter
        self.keys = keys  # config keys kept beside them (LTX-2's scaling_factor, applied after)
        self.mean_name, self.spread_name = list(self.buffers)
        where = ("per patchified channel (2x2 patches of the posterior mode, Flux2Pipeline's order)" if patch_key
                 else "per channel of the posterior mode")
        self.statistic = f"{where}: population mean and variance over all images and positions"
        self.view_item = ("patchified latent statistics" if patch_key else "latent normalisation statistics",
                          f"{self.statistic}, what its {held} hold")

    def listed(self, result) -> Dict[str, Any]:
        patched = "patchified_" if self.patch_key else ""
        return {f"{patched}mode_mean": result.view_mean, f"{patched}mode_var": result.view_var}

    def held_values(self, vae: Layer, updates: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """The buffers' values as lists (a counter as a number): the export's `updates`, else the weights'."""
        state, updates = vae.state_dict(), updates or {}
        names = {**self.buffers, **({"num_batches_tracked": self.counter} if self.counter else {})}
        values = {name: np.asarray(updates[key]) if key in updates else state[key].astype("float32").numpy()
                  for name, key in names.items()}
        return {name: int(value.reshape(-1)[0]) if name == "num_batches_tracked" else value.astype(np.float32).tolist()
                for name, value in values.items()}

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError(f"measuring {type(vae).__name__}'s latent normalisation needs its modes' statistics")
        spread = stats.view_var if self.eps_key else np.sqrt(stats.view_var)
        mean_key, spread_key = self.buffers.values()
        updates = {mean_key: np.asarray(stats.view_mean, np.float32), spread_key: np.asarray(spread, np.float32)}
        if self.counter:  # PyTorch's counter (no pipeline reads it): the images measured
            updates[self.counter] = np.asarray([stats.num_images], np.int64)
        return updates

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
        config = {key: vae.config[key] for key in (self.eps_key, *self.keys) if key}
        held = self.held_values(vae, updates)
        eps = f", eps {config[self.eps_key]}" if self.eps_key else ""
        return ({"class": type(vae).__name__,
                 "latent_normalisation": {**held, **config, "normalisation": self.formula}},
                f"latent normalisation ({self.held} of {len(held[self.mean_name])} "
                f"{'patchified ' if self.patch_key else ''}channels{eps})")

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """For NCHW image latents. Patchified, un-patchified: patchified channel c * ph * pw + i * pw + j is channel
        c at (i, j) of each patch."""
        patch, held = vae.config[self.patch_key] if self.patch_key else (1, 1), self.held_values(vae)
        shape = [len(held[self.mean_name]) // (patch[0] * patch[1]), *patch]
        spread = np.asarray(held[self.spread_name], np.float32)
        if self.eps_key:
            spread = np.sqrt(spread + vae.config[self.eps_key])
        elif "scaling_factor" in self.keys:
            spread = spread / vae.config.scaling_factor
        return (np.asarray(held[self.mean_name], np.float32).reshape(shape),
                spread.astype(np.float32).reshape(shape))

    def held_rows(self, vae: Layer, result) -> List[Tuple[str, Sequence[float]]]:
        """(label, values) of what the weights hold beside what was measured, for scripts/eval_vae.py's table."""
        held, (mean_listed, var_listed) = self.held_values(vae), self.listed(result)
        return [(f"{self.label}{self.mean_name} (the VAE's)", held[self.mean_name]),
                (f"{mean_listed.replace('_', ' ')} (measured)", result.view_mean),
                (f"{self.label}{self.spread_name} (the VAE's)", held[self.spread_name]),
                (f"{var_listed.replace('_', ' ')} (measured)", result.view_var)]


FLUX2_BN = HeldInWeights(
    "bn statistics", {"running_mean": "bn._mean", "running_var": "bn._variance"},  # PyTorch's names: Paddle's
    "(patchify(z) - running_mean) / sqrt(running_var + batch_norm_eps), z the posterior mode, patchify 2x2 "
    "(Flux2Pipeline)", eps_key="batch_norm_eps", patch_key="patch_size", counter="bn.num_batches_tracked", label="bn ")
LTX2_BUFFERS = HeldInWeights(
    "latents_mean / latents_std buffers", {"latents_mean": "latents_mean", "latents_std": "latents_std"},
    "(z - latents_mean) * scaling_factor / latents_std per channel, z the posterior mode (the LTX-2 pipelines)",
    keys=("scaling_factor",))
