"""The base of the frozen networks (LPIPS, its VGG16 backbone, DINOv2): weights set once, no gradient. None holds
dropout or batch statistics, so the train / eval flag changes nothing."""

from __future__ import annotations

from collections.abc import Mapping

from paddle import nn


class FrozenLayer(nn.Layer):
    """A network whose parameters never train (the optimizers take only parameters that need a gradient)."""

    def load_frozen(self, state: Mapping, source: str) -> None:
        """Set every parameter from `state` (extra entries ignored), then freeze; a ValueError names `source` and the
        missing or mis-shaped parameters."""
        missing, _ = self.set_state_dict(state)
        if missing:
            raise ValueError(f"{source} lacks (or mis-shapes) parameters {missing[:4]} of a {type(self).__name__}")
        for param in self.parameters():
            param.stop_gradient = True
