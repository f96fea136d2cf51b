"""The base of the frozen networks (LPIPS, its VGG16 backbone, DINOv2): weights set once, no gradient, eval mode."""

from __future__ import annotations

from collections.abc import Mapping

from paddle import nn


class FrozenLayer(nn.Layer):
    """A network whose parameters never train and which stays in eval mode (`train()` is ignored)."""

    def load_frozen(self, state: Mapping, source: str) -> None:
        """Set every parameter from `state` (extra entries ignored), then freeze; a ValueError names `source` and the
        missing or mis-shaped parameters."""
        missing, _ = self.set_state_dict(state)
        if missing:
            raise ValueError(f"{source} lacks (or mis-shapes) parameters {missing[:4]} of a {type(self).__name__}")
        for param in self.parameters():
            param.stop_gradient = True
        self.train()

    def train(self, mode: bool = True) -> FrozenLayer:
        # The flags only: Layer.eval() would also switch paddle's global tracer, for every other network too.
        for layer in [self, *self.sublayers()]:
            layer.training = False
        return self
