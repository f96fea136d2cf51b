"""The exponential moving average of the VAE weights (--use_ema): built, swapped in, read back.

Owns: `build_ema` (ppdiffusers' EMAModel with float32 averages), `ema_weights` (the VAE temporarily
holds the averaged weights, for evaluation, image logging and export) and `load_ema` (a checkpoint's
`ema.pdparams`, for scripts/export_vae.py). The training step updates it (step.py).
"""

from __future__ import annotations

import paddle
from ppdiffusers.training_utils import EMAModel

EMA_NAME = "ema.pdparams"  # the EMA's file in a checkpoint-N


def build_ema(vae: paddle.nn.Layer, decay: float):
    """An EMA of `vae`'s weights. Build it while the weights are float32 (before O2 casts them): its
    averages start from the exact weights and stay float32 (many small updates need that precision)."""
    ema = EMAModel(vae.parameters(), decay=decay)
    ema.to(dtype=paddle.float32)
    return ema


def load_ema(vae: paddle.nn.Layer, file: str):
    """The EMA saved in a checkpoint (`ema.pdparams`), over `vae`'s parameters."""
    ema = EMAModel(vae.parameters())
    ema.load_state_dict(paddle.load(file))
    return ema


class ema_weights:
    """Context manager: the VAE temporarily holds its EMA weights (nothing changes when `ema` is None)."""

    def __init__(self, ema, vae: paddle.nn.Layer):
        self.ema, self.vae = ema, vae

    def __enter__(self):
        if self.ema is not None:
            self.ema.store(self.vae.parameters())
            self.ema.copy_to(self.vae.parameters())

    def __exit__(self, *exc):
        if self.ema is not None:
            self.ema.restore(self.vae.parameters())
