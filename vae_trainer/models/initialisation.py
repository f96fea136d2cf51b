"""Initialisation shared by the networks built here: `init_like_pytorch` gives a fresh Paddle network the weights'
spread of its PyTorch original, so that a fresh model starts where diffusers' would (the DC-AE port, a fresh
distillation student)."""

from __future__ import annotations

import math

import paddle
from paddle import nn


def init_like_pytorch(model: nn.Layer) -> None:
    """Conv and Linear weights and biases drawn as PyTorch's defaults draw them, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (kaiming_uniform with a=sqrt(5)), from Paddle's global RNG: a fresh model starts where diffusers' would,
    not from Paddle's Kaiming-normal convs (about 2.4x wider) and Xavier Linears. Norms keep ones and zeros."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, (nn.Conv2D, nn.Linear)):
            # Paddle's Linear weight is (in, out); a Conv2D's is (out, in / groups, kh, kw).
            fan_in = layer.weight.shape[0] if isinstance(layer, nn.Linear) else math.prod(layer.weight.shape[1:])
            bound = 1.0 / math.sqrt(fan_in)
            with paddle.no_grad():
                for param in (layer.weight, layer.bias):  # in this order: the same draws from the RNG
                    if param is not None:
                        param.set_value(paddle.uniform(param.shape, dtype=param.dtype, min=-bound, max=bound))
