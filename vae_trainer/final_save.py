"""What a run hands to its users: the exported VAE folders and the discriminator.

At the end of training (both drivers, `save_final_models`), on rank 0 after the latent scale is decided on all ranks:
    OUTPUT_DIR/vae/            the VAE (the EMA weights with --use_ema) loadable as it is by
                               ppdiffusers and by PyTorch diffusers (models/vae_saving.py `save_vae`),
                               with latent_stats.json (latent_scale.py)
    OUTPUT_DIR/vae_raw/        with --use_ema: the raw weights, same format, its own latent_stats.json
                               (a measured factor is measured on the raw weights: their latent space
                               differs from the EMA's unless --freeze_encoder)
    OUTPUT_DIR/discriminator/  config.json + model_state.pdparams, for --discriminator_path
With --posterior_std the exported encoder's log-variance outputs give that constant std. Each folder is
written as FOLDER.tmp and then moved into place, so it is always the previous complete export or the new
one; a full disk stops with a message and leaves the previous export (disk.py).
`scripts/export_vae.py` writes the same folder from any checkpoint-N, with what `checkpoint_configs`
saves in every checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from .checkpoint import DISCRIMINATOR_CONFIG_NAME, EXPORT_CONFIG_NAME, VAE_CONFIG_NAME
from .data.filelists import PIPE_PREFIX
from .disk import written_atomically
from .distributed import all_ranks_agree, rank
from .ema import ema_weights
from .latent_scale import EXPORT_ORIGIN_KEY, latent_scales_at_export, origin_of, write_latent_stats
from .models.discriminator import save_discriminator
from .models.vae_saving import save_vae


def checkpoint_configs(networks, evaluator=None) -> Dict[str, dict]:
    """The JSON files every checkpoint holds so that it can be exported on its own (scripts/export_vae.py),
    with the images its latent statistics are measured on (the evaluator's `latent_stats_data`)."""
    model = networks.model
    export = {"posterior_std": model.posterior_std, "scaling_factor": networks.scaling_factor_mode,
              EXPORT_ORIGIN_KEY: origin_of(model.vae),  # so that export_vae.py says where a kept factor came from
              "input_size": model.input_size, "resolution": networks.resolution}
    if evaluator is not None:
        data, num_images = evaluator.latent_stats_data
        export.update(latent_stats_data=stored_data_path(data), latent_stats_num_images=num_images)
    return {
        VAE_CONFIG_NAME: {k: v for k, v in dict(model.vae.config).items() if not k.startswith("_")},
        DISCRIMINATOR_CONFIG_NAME: networks.discriminator_config,
        EXPORT_CONFIG_NAME: export,
    }


def stored_data_path(data: Optional[str]) -> Optional[str]:
    """A data source as a checkpoint records it: a path made absolute (the checkpoint may be exported from
    another folder); a WebDataset `pipe:COMMAND` kept as given (it is a command: abspath would make it a
    path that does not exist)."""
    if not data or data.startswith(PIPE_PREFIX):
        return data or None
    return os.path.abspath(data)


def export_vae_folder(vae, out_dir: str, ema=None, posterior_std: float = 0.0,
                      config_updates: Optional[Dict[str, Any]] = None,
                      latent_record: Optional[Dict[str, Any]] = None) -> str:
    """One dual-format VAE folder from `vae` (with the EMA's weights when `ema` is given)."""
    with ema_weights(ema, vae):
        save_vae(vae, out_dir, posterior_std=posterior_std, **(config_updates or {}))
    if latent_record is not None:
        write_latent_stats(out_dir, latent_record)
    return out_dir


def save_final_models(output_dir: str, networks, ema, evaluator, step: int) -> Tuple[str, str]:
    """OUTPUT_DIR/vae (+ vae_raw with an EMA) and OUTPUT_DIR/discriminator; call on every rank."""
    model = networks.model
    scales = latent_scales_at_export(networks.scaling_factor_mode, model.vae, ema, evaluator, step,
                                     encoder_frozen=model.freeze_encoder)
    vae_dir, disc_dir = os.path.join(output_dir, "vae"), os.path.join(output_dir, "discriminator")
    with all_ranks_agree("exporting the final models"):  # a failure on rank 0 ends every rank with its message
        if rank() == 0:  # each folder written beside its place, then moved in (disk.py): never half an export
            if ema is not None:
                with written_atomically(os.path.join(output_dir, "vae_raw")) as partial:
                    export_vae_folder(model.vae, partial, None, model.posterior_std, *scales["vae_raw"])
            with written_atomically(vae_dir) as partial:
                export_vae_folder(model.vae, partial, ema, model.posterior_std, *scales["vae"])
            with written_atomically(disc_dir) as partial:
                save_discriminator(model.discriminator, networks.discriminator_config, partial)
    return vae_dir, disc_dir
