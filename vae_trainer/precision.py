"""Mixed precision: autocast, fp16 loss scaling (one scaler per network) and O2 decoration.

--fp16 / --bf16 with --fp16_opt_level O1 (autocast, float32 weights) or O2 (half-precision weights with
float32 master weights in the optimizers: `multi_precision`). fp16 uses dynamic loss scaling with
SEPARATE scalers for the VAE and the discriminator, so an overflow in one network's backward does not
skip or rescale the other's update. bf16 needs no scaling. LPIPS normalises in float32 and the KL is
computed in float32 (losses.py), so neither overflows in half precision.

On CPU Paddle does no autocast (`auto_cast` is a no-op there and GradScaler disables itself), and
half-precision conv kernels do not exist, so O2 decoration is skipped: the flags run in float32 with a
warning. Only the GPU does real mixed precision; that path follows Paddle's AMP documentation and has
been exercised only on CPU here.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import paddle

logger = logging.getLogger("vae_trainer")


class LossScaler(paddle.amp.GradScaler):
    """Paddle's GradScaler with its dynamic update made safe under numpy 2.4.

    Paddle 3.3.1's `_update` formats `float(self._scale)` (a 1-element tensor) when it lowers the
    scale, which numpy 2.4 refuses: fp16 training would crash at its first overflow. Same rule here,
    logged with `.item()`.
    """

    def _update(self):
        if not self._enable:
            return
        if self._cache_found_inf:
            self._incr_count, self._decr_count = 0, self._decr_count + 1
            if self._decr_count == self._decr_every_n_nan_or_inf:
                self._scale = self._scale * self._decr_ratio
                self._decr_count = 0
                logger.info("fp16 overflow: loss scale lowered to %g", self._scale.item())
        else:
            self._decr_count, self._incr_count = 0, self._incr_count + 1
            if self._incr_count == self._incr_every_n_steps:
                self._scale = self._scale * self._incr_ratio
                self._incr_count = 0


@dataclass
class Precision:
    dtype: Optional[str] = None  # "float16" | "bfloat16" | None (float32)
    level: str = "O1"
    vae_scaler: Optional[LossScaler] = None
    disc_scaler: Optional[LossScaler] = None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, dtype=self.dtype, level=self.level)

    def vae_loss_scale(self):
        """The VAE's current fp16 loss scale: a device tensor under fp16, else the plain number 1.0
        (so that the common case costs no tensor and no device sync)."""
        return self.vae_scaler._scale if self.vae_scaler is not None and self.vae_scaler.is_enable() else 1.0

    def scale_vae(self, loss: paddle.Tensor) -> paddle.Tensor:
        return self.vae_scaler.scale(loss) if self.vae_scaler is not None else loss

    def scale_disc(self, loss: paddle.Tensor) -> paddle.Tensor:
        return self.disc_scaler.scale(loss) if self.disc_scaler is not None else loss

    def stateful(self) -> dict:
        """Checkpoint entries for the loss scalers (their scale and good-step counters)."""
        out = {}
        if self.vae_scaler is not None:
            out["vae_scaler.pdparams"] = self.vae_scaler
        if self.disc_scaler is not None:
            out["disc_scaler.pdparams"] = self.disc_scaler
        return out


def on_gpu() -> bool:
    return paddle.device.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def setup_precision(args, model: paddle.nn.Layer) -> Precision:
    """Build the Precision for --fp16/--bf16 and decorate the model for O2 (GPU only)."""
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    if not (args.fp16 or args.bf16):
        return Precision()
    dtype = "float16" if args.fp16 else "bfloat16"
    if not on_gpu():
        logger.warning(
            "--%s on %s: Paddle does no autocast on this device, so training runs in float32 "
            "(the mixed-precision code paths still run, as no-ops).", "fp16" if args.fp16 else "bf16", paddle.get_device()
        )
    elif args.fp16_opt_level == "O2":
        paddle.amp.decorate(models=model, level="O2", dtype=dtype)
    scalers = {}
    if args.fp16:
        scalers = {name: LossScaler(init_loss_scaling=args.scale_loss) for name in ("vae_scaler", "disc_scaler")}
    return Precision(dtype=dtype, level=args.fp16_opt_level, **scalers)


def uses_master_weights(args) -> bool:
    """O2 keeps half-precision weights in the model and float32 copies in the optimizer."""
    return bool(args.fp16 or args.bf16) and args.fp16_opt_level == "O2" and on_gpu()
