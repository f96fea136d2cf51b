"""The EMA of the VAE's trainable weights (--use_ema): ppdiffusers' EMAModel with float32 averages, updated by the
step, swapped into the VAE for evaluation, image logging and export, and loaded from a checkpoint."""

import contextlib
from typing import Iterator, List, Optional, Sequence

import paddle
from ppdiffusers.training_utils import EMAModel

EMA_NAME = "ema.pdparams"  # the EMA's file in a checkpoint-N
NAMES_KEY = "parameter_names"  # its state's names of the weights averaged (before: every weight, unnamed)

# Its flags' parse-time refusals: (flags, when refused given the other flags, why; refusals.refuse).
REFUSALS = (
    (("ema_decay",), lambda f: not f.use_ema, "it does nothing without --use_ema true: add that, or drop it"),
)


def _on_own(method):
    return lambda self, parameters: method(self, self.own(parameters))


class TrainableEMA(EMAModel):
    """An EMAModel of the VAE weights named `names` (default: those that train; a frozen one is its own average: no
    shadow for RAE's 86M DINOv2-B), its averages float32: built before O2 casts the weights, they are exact. Its
    methods take all of `vae.parameters()`, as EMAModel's callers pass them."""

    def __init__(self, vae: paddle.nn.Layer, names: Optional[Sequence[str]] = None, decay: float = 0.9999):
        self.every = [name for name, _ in vae.named_parameters()]
        self.names = list(names or [name for name, p in vae.named_parameters() if not p.stop_gradient])
        self.positions = [self.every.index(name) for name in self.names]
        super().__init__(self.own(vae.parameters()), decay=decay)
        self.to(dtype=paddle.float32)

    def own(self, parameters) -> List[paddle.Tensor]:
        parameters = list(parameters)
        return [parameters[i] for i in self.positions]

    step, copy_to, store, restore = map(_on_own, (EMAModel.step, EMAModel.copy_to, EMAModel.store, EMAModel.restore))

    def state_dict(self) -> dict:
        return {**super().state_dict(), NAMES_KEY: self.names}

    def load_state_dict(self, state: dict) -> None:
        """A state of `state_dict`, or an older one averaging every weight (the frozen weights' averages dropped)."""
        names = state.get(NAMES_KEY, self.every)
        if len(names) != len(state["shadow_params"]) or not set(self.names) <= set(names):
            raise ValueError(f"the checkpoint's EMA does not average this VAE's trained weights (it has "
                             f"{len(state['shadow_params'])} averages): a checkpoint of another run?")
        shadows = dict(zip(names, state["shadow_params"]))
        super().load_state_dict({**state, "shadow_params": [shadows[name] for name in self.names]})


def load_ema(vae: paddle.nn.Layer, file: str) -> TrainableEMA:
    """The EMA saved in a checkpoint (`ema.pdparams`), over the weights of `vae` it names."""
    state = paddle.load(file)
    ema = TrainableEMA(vae, state.get(NAMES_KEY) or [name for name, _ in vae.named_parameters()])
    ema.load_state_dict(state)
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
