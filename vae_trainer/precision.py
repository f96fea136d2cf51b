"""Mixed precision (docs/training.md): autocast, fp16 loss scaling (one scaler per network), O2 decoration
(GPU only: on CPU the flags train in float32), O2 weights back to float32 after training or autocast outside it."""

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import paddle

logger = logging.getLogger("vae_trainer")

HALF_DTYPES = {paddle.float16: "float16", paddle.bfloat16: "bfloat16"}

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("fp16_opt_level",), lambda f: not (f.fp16 or f.bf16), "it does nothing without --fp16 or --bf16: add one, or "
                                                             "drop it"),
    (("scale_loss", "min_loss_scale", "max_consecutive_overflow_steps"), lambda f: not f.fp16,
     "only --fp16 scales the loss (bf16 needs no scaling): add --fp16, or drop it"),
)


class LossScaler(paddle.amp.GradScaler):
    """Paddle's GradScaler, updated from the step's own overflow decision, never below `min_loss_scale`, its scale
    also on the host (`scale_value`). `_update` replaced: Paddle 3.3.1's `float(self._scale)` fails under numpy 2.4.
    Disabled (`enable` False, or on CPU), every call is a no-op and the scale 1."""

    def __init__(self, init_loss_scaling: float = 1.0, min_loss_scale: float = 1.0, enable: bool = True):
        super().__init__(enable=enable, init_loss_scaling=init_loss_scaling)
        self.min_loss_scale = float(min_loss_scale)
        self.scale_value = float(init_loss_scaling) if self._enable else 1.0

    def update_after(self, found_inf: bool) -> None:
        """Adjust the scale after an optimizer step we took (found_inf False) or skipped (True)."""
        self._cache_found_inf = found_inf
        self.update()

    def _update(self) -> None:  # update() calls it only when enabled
        found_inf, value = self._cache_found_inf, self.scale_value
        self._incr_count = 0 if found_inf else self._incr_count + 1
        self._decr_count = self._decr_count + 1 if found_inf else 0
        if self._decr_count == self._decr_every_n_nan_or_inf:
            self._decr_count, value = 0, max(value * self._decr_ratio, self.min_loss_scale)
        elif self._incr_count == self._incr_every_n_steps:
            self._incr_count, value = 0, value * self._incr_ratio
        if value != self.scale_value:  # a fill on the device, only when the scale changes
            if found_inf:
                logger.info("fp16 overflow: loss scale lowered to %g", value)
            self.scale_value, self._scale = value, paddle.full([1], value, "float32")

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if self._enable:
            self.scale_value = float(self._init_loss_scaling)


@dataclass
class Precision:
    """The run's autocast (dtype None: float32); each network's fp16 loss scaler is its own (`LossScaler`)."""

    dtype: Optional[str] = None  # "float16" | "bfloat16" | None (float32)
    level: str = "O1"

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, dtype=self.dtype, level=self.level)


def on_gpu() -> bool:
    return paddle.device.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def setup_precision(args, model: paddle.nn.Layer, keep_float32: Sequence[paddle.nn.Layer] = ()) -> Precision:
    """The Precision for --fp16/--bf16; decorates `model` for O2 on a GPU, except `keep_float32` (frozen layers:
    no optimizer keeps their float32 master copy), the root's own tensors (logvar, LeCAM's EMA) and the buffers of
    layers without weights."""
    if not (args.fp16 or args.bf16):
        return Precision()
    if args.fp16 and not args.min_loss_scale > 0:
        raise ValueError(f"--min_loss_scale must be > 0 (got {args.min_loss_scale}): a zero scale zeroes the gradients")
    dtype = "float16" if args.fp16 else "bfloat16"
    if not on_gpu():
        logger.warning("--%s on %s: Paddle does no autocast on this device, so training runs in float32 (the "
                       "mixed-precision code paths still run, as no-ops).", "fp16" if args.fp16 else "bf16",
                       paddle.get_device())
    elif args.fp16_opt_level == "O2":
        # The flag Paddle's `excluded_layers` sets, on single layers: the root's own scalars stay float32 (an fp16
        # EMA step of decay 0.99 vanishes in rounding), as do the buffers of layers without weights (RAE's
        # statistics: the export writes them as loaded); their sublayers are cast as usual.
        for layer in model.sublayers(include_self=True):
            if layer is model or not layer.parameters(include_sublayers=False):
                layer._cast_to_low_precision = False
        paddle.amp.decorate(models=model, level="O2", dtype=dtype, excluded_layers=list(keep_float32) or None)
    return Precision(dtype, args.fp16_opt_level)


def uses_master_weights(args) -> bool:
    """O2 keeps half-precision weights in the model and float32 copies in the optimizer."""
    return bool(args.fp16 or args.bf16) and args.fp16_opt_level == "O2" and on_gpu()


def half_dtype(layer: paddle.nn.Layer) -> Optional[str]:
    """"float16" or "bfloat16" if `layer` holds half-precision weights (O2), else None."""
    return next((HALF_DTYPES[param.dtype] for param in layer.parameters() if param.dtype in HALF_DTYPES), None)


def half_precision_autocast(layer: paddle.nn.Layer):
    """O2 autocast for a forward of `layer` outside the step if its weights are half precision, else nothing."""
    return Precision(half_dtype(layer), "O2").autocast()


def restore_float32(layer: paddle.nn.Layer, optimizers: Iterable) -> None:
    """After O2 training: `layer` back in float32 with the optimizers' float32 master weights (no-op if float32)."""
    if half_dtype(layer) is None:
        return
    masters = [optimizer.state_dict().get("master_weights", {}) for optimizer in optimizers]
    names = {param.name: key for key, param in layer.named_parameters()}
    layer.to(dtype="float32")  # in place: the same parameter objects, now float32
    state = {names[name]: master for found in masters for name, master in found.items() if name in names}
    layer.set_state_dict(state)
    logger.info("O2: model cast to float32 with the optimizers' master weights (%d tensors)", len(state))
