"""Saving the VAE so that ppdiffusers and PyTorch diffusers both load it as it is (`save_vae`): one folder with
ppdiffusers' weights, PyTorch diffusers' (converted by ppdiffusers' `to_diffusers=True`, which transposes the Linear
weights) and one config.json; ppdiffusers' alone for a network diffusers cannot describe (its family says when).
"""

from __future__ import annotations

import json
import logging
import os

import paddle

from .families import family_of
from .vae_loading import COUNTER_SUFFIX, TORCH_WEIGHT_FILES, with_variants

logger = logging.getLogger("vae_trainer")
# AutoencoderKL config entries only ppdiffusers has: null (or block_out_channels) in a VAE diffusers can load,
# where diffusers would warn on every load that they "are not expected".
PPDIFFUSERS_ONLY_ENTRIES = ("down_block_out_channels", "up_block_out_channels")


def save_vae(vae: paddle.nn.Layer, out_dir: str, posterior_std: float = 0.0, **updates) -> None:
    """Write `out_dir` for both libraries with the latent-scale `updates` (latent_scale.decide's: config entries
    such as scaling_factor, or what the family writes into weights) and --posterior_std applied."""
    family = family_of(vae)
    vae.register_to_config(**{k: v for k, v in updates.items() if k in family.normalisation.keys or k in vae.config})
    problem = family.diffusers_problem(vae)
    state = vae.state_dict()
    values = {**family.posterior_std_values(vae, posterior_std), **{k: v for k, v in updates.items() if k in state}}
    # While saving (`save_pretrained` writes `vae.state_dict()`), the state dict holds the weights the export writes in
    # place of its own (the family's), of another shape too (RAE's unset latent statistics, shape (1,), measured per
    # channel and position); its own weights are left as they are.
    exported = {**state, **{name: paddle.to_tensor(value).astype(state[name].dtype) for name, value in values.items()}}
    vae.state_dict = lambda *args, **kwargs: exported  # on the instance, for these saves only
    try:
        vae.save_pretrained(out_dir, safe_serialization=True)
        if problem is None:  # second: its config.json (diffusers' spelling of the version key) is the one both read
            vae.save_pretrained(out_dir, safe_serialization=True, to_diffusers=True)
            _counters_zero_dimensional(os.path.join(out_dir, TORCH_WEIGHT_FILES[0]))
            path = os.path.join(out_dir, vae.config_name)
            with open(path) as handle:
                config = json.load(handle)
            for key in PPDIFFUSERS_ONLY_ENTRIES:
                if key in config and config[key] in (None, config.get("block_out_channels")):
                    config.pop(key)
            with open(path, "w") as handle:
                json.dump(config, handle, indent=2, sort_keys=True)
                handle.write("\n")
            return
    finally:
        del vae.state_dict
    for name in with_variants(TORCH_WEIGHT_FILES):  # an earlier export's: diffusers would load it, silently
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
            logger.warning("%s: removed %s of an earlier export (it is not this VAE)", out_dir, name)
    logger.warning("%s: written for ppdiffusers only. %s.", out_dir, problem)


def _counters_zero_dimensional(path: str) -> None:
    """BatchNorm's num_batches_tracked 0-d in the PyTorch file, as diffusers' own files hold it (ppdiffusers writes
    our [1] buffer as [1]). The same 8 bytes: only the safetensors header changes, rewritten in place and padded
    with spaces (as the format allows), so the tensors are not rewritten. (A sharded export, over 10 GB, is left.)"""
    if not os.path.isfile(path):
        return
    with open(path, "r+b") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        counters = [k for k, v in header.items() if k.endswith(COUNTER_SUFFIX) and v["shape"] == [1]]
        if not counters:
            return
        text = json.dumps({k: {**v, "shape": []} if k in counters else v for k, v in header.items()},
                          separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:  # only if the writer's JSON was looser than ours: diffusers still loads [1]
            logger.warning("%s: BatchNorm counters left [1] (the header would grow)", path)
            return
        handle.seek(8)
        handle.write(text.ljust(size))

