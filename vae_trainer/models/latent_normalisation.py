"""A family's latent normalisation (`Family.normalisation`): what its diffusion pipelines do to the latents before
their model sees them, one value of a few kinds. A kind owns how the normalisation is read (the config keys a
source's values are kept from, latent_scale.settle), measured (from an evaluation's statistics, `measured`),
exported (config entries and weights), described (latent_stats.json, the evaluation protocol) and applied as a
pipeline does (`pipeline`: mean and std, for a distilled student's latent space).

    Scale          (z - shift_factor) * scaling_factor, or SDXL's rule with latents_mean / latents_std  (KL, DC-AE)
    Fixed          a Scale never measured nor changed: a distilled student lives in its teacher's space   (tiny)
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

Layer, Tensor = paddle.nn.Layer, paddle.Tensor
Items = Tuple[Tuple[str, str], ...]


class Normalisation:
    """What every kind answers; the defaults are a Scale's."""

    keys: Tuple[str, ...] = ()  # the config entries that hold it, kept from a source at loading
    name = "scaling factor"  # in messages and latent_stats.json
    held = ""  # what the weights hold of it ("bn statistics"), else ""
    on_training_data = False  # measured on --file_list (RAE's stat.pt), not on held-out images

    @property
    def numbers(self) -> bool:
        """Can a number (--scaling_factor N) set it?"""
        return "scaling_factor" in self.keys

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """What its statistics are per channel of (NC... float32), if not posterior samples."""
        return None

    def listed(self, result) -> Dict[str, Any]:
        """Its view's statistics as an evaluation record lists them (none: not listed)."""
        return {}

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        """The export's updates (config entries, or weights by state-dict name) from measured statistics."""
        updates = {"scaling_factor": stats.scaling_factor}
        if vae.config.get("shift_factor") is not None:
            updates["shift_factor"] = stats.shift_factor
        return updates

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        """The exported normalisation, as latent_stats.json states it."""
        return {key: updates.get(key, vae.config.get(key)) for key in ("scaling_factor", "shift_factor")}

    def text(self, record: Mapping[str, Any]) -> str:
        """`record` in the export's log line."""
        return f"scaling_factor {record['scaling_factor']}, shift_factor {record['shift_factor']}"

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        """What latent_stats.json says was measured, beyond where and how many."""
        statistic = ("the latents (the encoder is deterministic)" if deterministic
                     else "posterior samples, exact expectation from the posterior means and variances")
        return {"statistic": statistic, **moments(stats), "suggested_scaling_factor": stats.scaling_factor,
                "suggested_shift_factor": stats.shift_factor}

    def protocol(self, measured_view: bool) -> Items:
        """(name, text) an evaluation's protocol adds; `measured_view`: the statistics of `view` were measured."""
        return ()

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """(mean, std), float32 [C, p, p]: a diffusion pipeline's latents are (z - mean) / std, z the posterior mode,
        the pattern tiled over latent positions with period p (teacher.to_pipeline)."""
        config, channels = vae.config, vae.config.latent_channels
        if config.get("latents_mean") is not None and config.get("latents_std") is not None:
            mean, std = np.asarray(config.latents_mean), np.asarray(config.latents_std) / config.scaling_factor
        else:
            mean = np.full(channels, config.get("shift_factor") or 0.0)
            std = np.full(channels, 1 / config.scaling_factor)
        return mean.astype(np.float32).reshape(channels, 1, 1), std.astype(np.float32).reshape(channels, 1, 1)

    def weights(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Weights the export writes in place of the network's own (by state-dict name)."""
        return {}

    def refusal(self, vae: Layer, mode, encoder_frozen: bool) -> Optional[str]:
        """Why --scaling_factor `mode` ("keep", "measure" or a number) cannot export this network, or None
        (`encoder_frozen`: the latent space does not train)."""
        class_name = type(vae).__name__
        if not self.numbers and mode not in ("keep", "measure"):
            return (f"--scaling_factor {mode}: {class_name} has no scaling_factor; its pipelines normalise the latents "
                    f"with its {self.held or self.name}. Use --scaling_factor keep (the source's statistics) or "
                    "measure (from the trained encoder).")
        if not self.numbers and mode == "measure" and encoder_frozen:
            return (f"--scaling_factor measure with a frozen encoder: a decoder-only fine-tune of {class_name} keeps "
                    f"the source's {self.held or self.name} (the latent normalisation its DiT was trained with). Drop "
                    "--scaling_factor measure (measure is also the default for a fresh VAE or with --ignore_keys of "
                    "the encoder: give --scaling_factor keep, or train the encoder).")
        return None

    def held_rows(self, vae: Layer, result) -> List[Tuple[str, Sequence[float]]]:
        """(label, values) of what the weights hold beside what was measured, for scripts/eval_vae.py's table."""
        return []


def moments(stats) -> Dict[str, Any]:
    """The per-channel statistics of posterior samples that every record lists."""
    return {"latent_mean": stats.latent_mean, "latent_std": stats.latent_std}


class Scale(Normalisation):
    """(z - shift_factor) * scaling_factor (the SD, FLUX.1 and SANA pipelines), or with latents_mean / latents_std in
    the config (z - latents_mean) * scaling_factor / latents_std (StableDiffusionXLPipeline's rule). Measured: the
    scaling factor over all channels, and the shift where the config has one."""

    def __init__(self, keys: Tuple[str, ...] = ("scaling_factor",)):
        self.keys = keys


class Fixed(Scale):
    """A scale never measured nor changed at export: a distilled student's latents are its teacher's pipeline
    latents (scaling_factor 1), whatever its sources state."""

    origin = "fixed: a student lives in its teacher's normalised latent space"


class PerChannel(Normalisation):
    """(z - latents_mean) / latents_std per channel, z the posterior mode, the lists in the config (diffusers' Wan /
    Qwen-Image pipelines); measured per channel of the posterior modes."""

    keys = ("latents_mean", "latents_std")
    name = "latent normalisation (latents_mean / latents_std)"
    formula = ("(z - latents_mean) / latents_std per channel, z the posterior mode (diffusers' Wan / Qwen-Image "
               "pipelines)")

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        return posterior.mode().astype("float32")  # what the pipelines normalise (sample_mode="argmax")

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError("measuring latents_mean / latents_std needs the posterior modes' statistics")
        return {"latents_mean": list(stats.view_mean), "latents_std": [float(np.sqrt(v)) for v in stats.view_var]}

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        values = {key: list(updates.get(key, vae.config[key])) for key in self.keys}
        return {"class": type(vae).__name__, "latent_normalisation": {**values, "normalisation": self.formula}}

    def text(self, record: Mapping[str, Any]) -> str:
        return f"latents_mean / latents_std of {len(record['latent_normalisation']['latents_mean'])} channels"

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        return {"statistic": "per channel of the posterior mode, population mean and std over all images and "
                             "positions (what latents_mean / latents_std hold)",
                "mode_mean": stats.view_mean, "mode_std": [float(np.sqrt(v)) for v in stats.view_var or []],
                **moments(stats)}

    def protocol(self, measured_view: bool) -> Items:
        if not measured_view:
            return ()
        return (("latent normalisation statistics", "per channel of the posterior mode (what the Wan / Qwen-Image "
                 "pipelines normalise by latents_mean / latents_std), population mean and std over all images and "
                 "positions"),)

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """For NCHW image latents (a clip's NCTHW latents need a frame axis: [:, None])."""
        shape = [len(vae.config[self.keys[0]]), 1, 1]
        return tuple(np.asarray(vae.config[key], np.float32).reshape(shape) for key in self.keys)


class PerPosition(PerChannel):
    """RAE's: encode itself normalises its tokens, (tokens - latents_mean) / (latents_std + 1e-5) * scaling_factor,
    with statistics per channel and position (the authors' stat.pt: one mean and variance per element of the (C, h, w)
    latent, over ImageNet's training images), stored as diffusers converts stat.pt, latents_std = sqrt(var + 1e-5),
    in the config and as buffers. A posterior's `raw` holds the tokens before it. The scaling factor stays the
    config's; a decoder trained from scratch gets its statistics measured on the training data at export."""

    keys = ("scaling_factor", "latents_mean", "latents_std")
    on_training_data = True
    eps = 1e-5
    formula = "(tokens - latents_mean) / (latents_std + 1e-5) * scaling_factor, inside encode (diffusers')"
    statistic = ("per channel and position of the encoder's tokens (eval mode: no noise) before the latent "
                 "normalisation, population mean and variance over all images, as RAE's stat.pt; latents_std = "
                 f"sqrt(variance + {eps}), as diffusers converts stat.pt")

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        """The tokens, each channel at each position a "channel" of its own."""
        tokens = posterior.raw.astype("float32")
        return tokens.reshape([tokens.shape[0], -1, 1, 1])

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError(f"measuring {type(vae).__name__}'s latent normalisation needs its token statistics")
        shape = token_shape(vae.config)
        mean = np.asarray(stats.view_mean, np.float64).reshape(shape)
        variance = np.asarray(stats.view_var, np.float64).reshape(shape)
        # float32 values in the config, so that config.json and the weights hold the same numbers
        return {"latents_mean": mean.astype(np.float32).tolist(),
                "latents_std": np.sqrt(variance + self.eps).astype(np.float32).tolist()}

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        config = {**vae.config, **updates}
        stated = config.get("latents_mean") is not None
        return {"scaling_factor": config.get("scaling_factor"), "latent_normalisation": {
            "latents_mean / latents_std": f"in config.json, shape {list(np.shape(config['latents_mean']))}"
                                          if stated else "unset: encode normalises nothing but the scaling_factor",
            "normalisation": self.formula}}

    def text(self, record: Mapping[str, Any]) -> str:
        return (f"scaling_factor {record['scaling_factor']}, latents_mean / latents_std "
                f"{record['latent_normalisation']['latents_mean / latents_std']}")

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        return {"statistic": self.statistic, **moments(stats)}

    def protocol(self, measured_view: bool) -> Items:
        items = (("latent statistics", f"per channel, of the latents encode returns: {self.formula}"),)
        return items + ((("token statistics", self.statistic),) if measured_view else ())

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        raise ValueError(f"{type(vae).__name__}: its encode already normalises (latents_mean / latents_std per channel "
                         "and position, times scaling_factor), and its decoder returns one fixed size from patch-14 "
                         "tokens: no tiny autoencoder (a power-of-two factor, output size set by the latent) can "
                         "stand in")

    def weights(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Measured statistics also as the buffers diffusers' constructor makes of them; the other buffers go out as
        loaded (a folder's encoder_mean / encoder_std, which its config need not state)."""
        return {f"_{key}": np.asarray(updates[key], np.float32) for key in self.keys[1:] if key in updates}

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


def patchify(latents: Tensor, patch_size: Sequence[int] = (2, 2)) -> Tensor:
    """(B, C, H, W) -> (B, C*ph*pw, H/ph, W/pw) in the channel order of diffusers' Flux2Pipeline._patchify_latents."""
    ph, pw = patch_size
    batch, channels, height, width = latents.shape
    patches = latents.reshape([batch, channels, height // ph, ph, width // pw, pw]).transpose([0, 1, 3, 5, 2, 4])
    return patches.reshape([batch, channels * ph * pw, height // ph, width // pw])


class HeldInWeights(Normalisation):
    """Per-channel statistics in buffers of the weights: FLUX.2's `bn`, a BatchNorm over the 2x2-patchified posterior
    modes that its forward never calls; Flux2Pipeline takes (patchify(z) - running_mean) / sqrt(running_var +
    batch_norm_eps). Measured: per patchified channel, the modes' population mean and variance (the counter: the
    images); kept from the source, or measured, at export."""

    name = "latent normalisation"
    held = "bn statistics"
    buffers = {"running_mean": "bn._mean", "running_var": "bn._variance",  # PyTorch's names: Paddle's buffers
               "num_batches_tracked": "bn.num_batches_tracked"}
    formula = ("(patchify(z) - running_mean) / sqrt(running_var + batch_norm_eps), z the posterior mode, patchify 2x2 "
               "(Flux2Pipeline)")

    def view(self, vae: Layer, posterior) -> Optional[Tensor]:
        return patchify(posterior.mode().astype("float32"), vae.config.patch_size)

    def listed(self, result) -> Dict[str, Any]:
        return {"patchified_mode_mean": result.view_mean, "patchified_mode_var": result.view_var}

    def held_values(self, vae: Layer, updates: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """running_mean, running_var (lists) and num_batches_tracked: the export's `updates`, else the weights'."""
        state, updates = vae.state_dict(), updates or {}
        values = {name: np.asarray(updates[key]) if key in updates else state[key].astype("float32").numpy()
                  for name, key in self.buffers.items()}
        return {"running_mean": values["running_mean"].astype(np.float32).tolist(),
                "running_var": values["running_var"].astype(np.float32).tolist(),
                "num_batches_tracked": int(values["num_batches_tracked"].reshape(-1)[0])}

    def measured(self, vae: Layer, stats) -> Dict[str, Any]:
        if stats.view_mean is None:
            raise ValueError("measuring FLUX.2's latent normalisation needs the patchified latents' statistics")
        # num_batches_tracked counts the images (PyTorch's counter; no pipeline reads it)
        measured = (stats.view_mean, stats.view_var, [stats.num_images])
        return {key: np.asarray(value, np.int64 if key.endswith("tracked") else np.float32)
                for key, value in zip(self.buffers.values(), measured)}

    def record(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, Any]:
        return {"class": type(vae).__name__, "latent_normalisation": {
            **self.held_values(vae, updates), "batch_norm_eps": vae.config.batch_norm_eps,
            "normalisation": self.formula}}

    def text(self, record: Mapping[str, Any]) -> str:
        normalisation = record["latent_normalisation"]
        return (f"latent normalisation (bn statistics of {len(normalisation['running_mean'])} patchified channels, "
                f"eps {normalisation['batch_norm_eps']})")

    def measured_record(self, stats, deterministic: bool) -> Dict[str, Any]:
        return {"statistic": "per patchified channel (2x2 patches of the posterior mode, Flux2Pipeline's order): "
                             "population mean and variance over all images and positions",
                **self.listed(stats), **moments(stats)}

    def protocol(self, measured_view: bool) -> Items:
        if not measured_view:
            return ()
        return (("patchified latent statistics", "FLUX.2's VAE: per channel of the 2x2-patchified posterior mode "
                 "(Flux2Pipeline's channel order), population mean and variance over all images and positions, what "
                 "its bn statistics hold"),)

    def pipeline(self, vae: Layer) -> Tuple[np.ndarray, np.ndarray]:
        """Flux2Pipeline's normalisation un-patchified: patchified channel c * ph * pw + i * pw + j is channel c at
        (i, j) of each patch; no scaling_factor applies."""
        ph, pw = vae.config.patch_size
        shape = [vae.config.latent_channels, ph, pw]
        held = self.held_values(vae)
        mean = np.asarray(held["running_mean"], np.float32).reshape(shape)
        std = np.sqrt(np.asarray(held["running_var"], np.float32) + vae.config.batch_norm_eps).reshape(shape)
        return mean, std.astype(np.float32)

    def weights(self, vae: Layer, updates: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        return {key: value for key, value in updates.items() if key in self.buffers.values()}

    def held_rows(self, vae: Layer, result) -> List[Tuple[str, Sequence[float]]]:
        held = self.held_values(vae)
        return [("bn running_mean (the VAE's)", held["running_mean"]),
                ("patchified mode mean (measured)", result.view_mean),
                ("bn running_var (the VAE's)", held["running_var"]),
                ("patchified mode var (measured)", result.view_var)]


def token_shape(config: Mapping[str, Any]) -> List[int]:
    """(C, h, w) of RAE's tokens: its latent's shape."""
    grid = int(config["encoder_input_size"]) // int(config["encoder_patch_size"])
    return [int(config["encoder_hidden_size"]), grid, grid]
