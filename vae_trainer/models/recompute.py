"""--recompute for any autoencoder (docs/training.md "Memory"): each of its family's `recompute_segments` re-run in
the backward under Paddle's non-reentrant recompute."""

from __future__ import annotations

import logging
from typing import List

import paddle
from paddle.distributed.fleet.utils import recompute

from .families import family_of

# Paddle's recompute warns when no input of a segment needs a gradient: true of its reentrant form, not of the
# non-reentrant one used here, which recomputes a segment whose own parameters train (a clip's first encoder chunk).
logging.getLogger("paddle.distributed.fleet.utils.log_util").addFilter(
    lambda record: "None of the inputs to current recompute block need grad" not in record.getMessage())


class RecomputedForward:
    """A segment's forward under Paddle's non-reentrant `recompute` when a graph is being built (an input or one of
    its parameters needs a gradient); `calls` counts them. A segment called while another one runs (a block inside
    a video family's clip chunk) runs as it is: the outer re-run covers it."""

    running = False  # a recomputed forward is under way (first run or re-run)

    def __init__(self, forward, parameters):
        self.forward = forward
        self.parameters = parameters
        self.calls = 0

    def __call__(self, *args, **kwargs):
        recomputed = not RecomputedForward.running and paddle.is_grad_enabled() and (
            any(isinstance(a, paddle.Tensor) and not a.stop_gradient for a in args)
            or any(not p.stop_gradient for p in self.parameters()))
        if not recomputed:
            return self.forward(*args, **kwargs)  # also evaluation, a frozen encoder: nothing to keep for a backward
        self.calls += 1
        return recompute(self._outermost, *args, use_reentrant=False, **kwargs)

    def _outermost(self, *args, **kwargs):
        RecomputedForward.running = True
        try:
            return self.forward(*args, **kwargs)
        finally:
            RecomputedForward.running = False


def enable_recompute(vae: paddle.nn.Layer) -> List[str]:
    """--recompute: each of the family's `recompute_segments` recomputed in the backward (its forward replaced on the
    instance); returns their names. ppdiffusers' block-level checkpointing stays off (nested, segments would run
    twice)."""
    family = family_of(vae)
    segments = family.recompute_segments(vae)
    if not segments:
        raise ValueError(f"--recompute: {family.class_name} has no recompute segments here; drop --recompute")
    for name, layer in segments:
        if not isinstance(layer.__dict__.get("forward"), RecomputedForward):
            layer.forward = RecomputedForward(layer.forward, layer.parameters)
    return [name for name, _ in segments]
