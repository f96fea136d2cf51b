"""What a run hands to its users at its end (`save_final_models`): OUTPUT_DIR/vae (the EMA weights with --use_ema)
and with --use_ema vae_raw (the raw ones), each for both libraries with its latent_stats.json, and discriminator/;
and what every checkpoint holds so that scripts/export_vae.py writes the same folder from it (`checkpoint_configs`)."""

import json
import os
from typing import Any, Dict, Optional, Tuple

from .checkpoint import DISCRIMINATOR_CONFIG_NAME, EXPORT_CONFIG_NAME, VAE_CONFIG_NAME
from .data.filelists import PIPE_PREFIX
from .disk import written_atomically
from .distributed import all_ranks_agree, rank
from .ema import ema_weights
from .models.latent_scale import EXPORT_ORIGIN_KEY, latent_scales_at_export, origin_of
from .models.discriminator import save_discriminator
from .models.vae_saving import save_vae

LATENT_STATS_NAME = "latent_stats.json"


def checkpoint_configs(networks, evaluator=None) -> Dict[str, dict]:
    """The JSON files of every checkpoint: the VAE's and the discriminator's configs, and what the export needs."""
    model = networks.model
    export = {"posterior_std": model.posterior_std, "scaling_factor": networks.scaling_factor_mode,
              EXPORT_ORIGIN_KEY: origin_of(model.vae), "input_size": model.input_size,
              "resolution": networks.resolution}
    if evaluator is not None:
        data, num_images, seed = evaluator.latent_stats_data
        # Absolute (the checkpoint may be exported from elsewhere); a `pipe:COMMAND` as given.
        stored = data if not data or data.startswith(PIPE_PREFIX) else os.path.abspath(data)
        export.update(latent_stats_data=stored or None, latent_stats_num_images=num_images,
                      latent_stats_sample_seed=seed, latent_stats_frames=evaluator.clip_frames)
    return {VAE_CONFIG_NAME: {k: v for k, v in dict(model.vae.config).items()  # the class too: it names the family
                              if not k.startswith("_") or k == "_class_name"},
            DISCRIMINATOR_CONFIG_NAME: networks.discriminator_config, EXPORT_CONFIG_NAME: export}


def export_vae_folder(vae, out_dir: str, ema=None, posterior_std: float = 0.0,
                      config_updates: Optional[Dict[str, Any]] = None,
                      latent_record: Optional[Dict[str, Any]] = None) -> None:
    """One dual-format VAE folder from `vae` (with the EMA's weights when `ema` is given) and its latent_stats.json."""
    with ema_weights(ema, vae):
        save_vae(vae, out_dir, posterior_std=posterior_std, **(config_updates or {}))
    if latent_record is not None:
        with open(os.path.join(out_dir, LATENT_STATS_NAME), "w") as handle:
            json.dump(latent_record, handle, indent=2)


def save_final_models(output_dir: str, networks, ema, evaluator, step: int) -> Tuple[str, str]:
    """OUTPUT_DIR/vae (+ vae_raw with an EMA) and OUTPUT_DIR/discriminator; call on every rank."""
    model = networks.model
    scales = latent_scales_at_export(networks.scaling_factor_mode, model.vae, ema, evaluator, step,
                                     encoder_frozen=model.encoder_frozen)
    vae_dir, disc_dir = os.path.join(output_dir, "vae"), os.path.join(output_dir, "discriminator")
    with all_ranks_agree("exporting the final models"):  # a failure on rank 0 ends every rank with its message
        if rank() == 0:  # each folder written beside its place, then moved in (disk.py): never half an export
            for folder, weights in (("vae_raw", None), ("vae", ema)):
                if folder in scales:
                    with written_atomically(os.path.join(output_dir, folder)) as partial:
                        export_vae_folder(model.vae, partial, weights, model.posterior_std, *scales[folder])
            with written_atomically(disc_dir) as partial:
                save_discriminator(model.discriminator, networks.discriminator_config, partial)
    return vae_dir, disc_dir
