"""The EMA of the VAE weights (--use_ema): built with float32 averages (ppdiffusers' EMAModel), swapped into
the VAE for evaluation, image logging and export, and loaded from a checkpoint. The step updates it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import paddle
from ppdiffusers.training_utils import EMAModel

EMA_NAME = "ema.pdparams"  # the EMA's file in a checkpoint-N


def build_ema(vae: paddle.nn.Layer, decay: float) -> EMAModel:
    """An EMA of `vae`'s weights; build it before O2 casts them, so its averages start exact and stay float32."""
    ema = EMAModel(vae.parameters(), decay=decay)
    ema.to(dtype=paddle.float32)
    return ema


def load_ema(vae: paddle.nn.Layer, file: str) -> EMAModel:
    """The EMA saved in a checkpoint (`ema.pdparams`), over `vae`'s parameters."""
    ema = EMAModel(vae.parameters())
    ema.load_state_dict(paddle.load(file))
    return ema


@contextlib.contextmanager
def ema_weights(ema, vae: paddle.nn.Layer) -> Iterator[None]:
    """The VAE holds its EMA weights inside (nothing changes when `ema` is None)."""
    if ema is None:
        yield
        return
    ema.store(vae.parameters())
    ema.copy_to(vae.parameters())
    try:
        yield
    finally:
        ema.restore(vae.parameters())
