"""SiLU with a correct backward in every network the trainer runs, ours and ppdiffusers'.

Paddle 3.3.1's SiLU kernel, behind the public `paddle.nn.functional.silu` (which `paddle.nn.Silu.forward`, ppdiffusers'
`get_activation("silu")` / `"swish"` and our ports all call at run time), has a wrong backward on CPU: -inf at x = -88
and NaN at x <= -89 (its forward is right). A network whose SiLU input is not normalised (DC-AE's ResBlock) reaches
that in ordinary training, and one such value makes every gradient below it NaN. Reproduce:
    x = paddle.to_tensor([-100.0], stop_gradient=False); paddle.nn.functional.silu(x).sum().backward(); x.grad  # nan
`paddle.nn.functional.swish` (beta 1: the same function) has a finite backward there (0, as PyTorch's SiLU) and one
kernel; its forward is within 1.2e-7 relative of the SiLU kernel's (1 ulp at most, and nearer PyTorch's). So the
public name is rebound to it, once, when vae_trainer.models is imported (its __init__). Remove this module when
Paddle's kernel is fixed: tests/test_gradients.py::test_paddles_silu_kernel_is_still_wrong fails then.
"""

from __future__ import annotations

from typing import Optional

import paddle
from paddle.nn.functional import activation as _paddle_activations
from paddle.utils.decorator_utils import param_one_alias

KERNEL_SILU = _paddle_activations.silu  # Paddle's own (the submodule's name is never rebound)


@param_one_alias(["x", "input"])
def silu(x: paddle.Tensor, inplace: bool = False, name: Optional[str] = None) -> paddle.Tensor:
    """`paddle.nn.functional.silu` computed by swish's kernel. In-place and complex SiLU (swish has neither; nothing
    the trainer runs calls them) stay Paddle's."""
    if inplace or x.is_complex():
        return KERNEL_SILU(x, inplace, name)
    return paddle.nn.functional.swish(x, name)


paddle.nn.functional.silu = silu  # rebound (and so `paddle.nn.Silu`) once: vae_trainer.models imports this module
