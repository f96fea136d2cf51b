"""Where the VAE to train comes from: a fresh one from a config, or the pretrained VAEs people have.

Owns `build_vae`, the one constructor both drivers and the scripts use:
- a fresh VAE from a JSON of AutoencoderKL kwargs (e.g. `configs/sd_vae.json`, a checkpoint's
  `vae_config.json`; `vae_from_config_file`);
- a pretrained one from a LOCAL source recognised by its files (`find_pretrained`): a ppdiffusers folder,
  a PyTorch diffusers folder (converted by ppdiffusers' `from_diffusers=True`), or an original LDM / SD /
  SDXL / FLUX single-file checkpoint (converted by ppdiffusers' LDM conversion helpers, with the config
  inferred from the tensor shapes or given as a config file). Nothing is downloaded.
- `ignore_keys` leaves weights with those prefixes at their fresh initialisation; `init_from_ckpt` then
  loads weights only from one of our checkpoints or a VAE weight file (`load_vae_weights`).
Saving is `vae_saving.py`; the layers training touches are `vae.py`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import paddle
from ppdiffusers import AutoencoderKL
from ppdiffusers.models.modeling_pytorch_paddle_utils import convert_pytorch_state_dict_to_paddle
from ppdiffusers.models.modeling_utils import load_state_dict
from ppdiffusers.pipelines.stable_diffusion.convert_from_ckpt import (convert_diffusers_vae_unet_to_ppdiffusers,
                                                                     convert_ldm_vae_checkpoint)
from ppdiffusers.utils import constants as names
from ppdiffusers.utils import smart_load

from .. import latent_scale
from ..checkpoint import (EXPORT_CONFIG_NAME, TRAINER_STATE_NAME, VAE_CONFIG_NAME, checkpoint_vae_config,
                          list_checkpoints, read_model_state)
from .flux2 import CLASS_NAME as FLUX2_CLASS_NAME
from .flux2 import AutoencoderKLFlux2, flux2_from_config, is_flux2, is_flux2_config, with_source_entries

logger = logging.getLogger("vae_trainer")

# How each layout is recognised; the first file found decides (a folder holding both formats, as our own
# export does, is read in Paddle's layout).
PADDLE_WEIGHT_FILES = (names.PADDLE_SAFETENSORS_WEIGHTS_NAME, names.PADDLE_SAFETENSORS_WEIGHTS_NAME_INDEX_NAME,
                       names.PADDLE_WEIGHTS_NAME, names.PADDLE_WEIGHTS_NAME_INDEX_NAME)
TORCH_WEIGHT_FILES = (names.TORCH_SAFETENSORS_WEIGHTS_NAME, names.TORCH_SAFETENSORS_WEIGHTS_NAME_INDEX_NAME,
                      names.TORCH_WEIGHTS_NAME, names.TORCH_WEIGHTS_NAME_INDEX_NAME)
# ppdiffusers' from_pretrained falls back to the fp16 / fp32 variant of each name when the plain file is
# missing (e.g. `diffusion_pytorch_model.fp16.safetensors`, all an fp16-only pipeline download holds), so a
# folder with only a variant loads too (the weights are cast to the model's float32).
WEIGHT_VARIANTS = ("fp16", "fp32")
# Files only a checkpoint-N of our training runs has; its model_state.pdparams is not a VAE's.
TRAINING_RUN_FILES = {TRAINER_STATE_NAME, VAE_CONFIG_NAME, EXPORT_CONFIG_NAME}
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
CONFIG_NAME = AutoencoderKL.config_name  # config.json

# The published single-file VAEs carry no config. Their latent scale is latent_scale.py's to assume
# (`assumed_for_single_file`: SD's; SDXL's VAE has the same tensors but 0.13025); 16-channel VAEs without
# quant_conv (FLUX; SD3 has the same shapes with other factors) need a config file.
SD_NORM_GROUPS = 32  # not in the tensors either


@dataclass
class PretrainedSource:
    """Where pretrained VAE weights are and in which layout: "ppdiffusers", "diffusers" or "single_file"."""

    layout: str
    path: str  # the folder, or the single file

    @property
    def from_diffusers(self) -> bool:
        return self.layout == "diffusers"


def find_pretrained(path: str, subfolder: Optional[str] = None) -> PretrainedSource:
    """Recognise a local pretrained VAE by its files; one clear error when nothing loadable is there."""
    location = os.path.join(path, subfolder) if subfolder else path
    if os.path.isfile(location):
        if location.endswith(SINGLE_FILE_SUFFIXES):
            return PretrainedSource("single_file", location)
        raise ValueError(f"{location}: a single-file VAE checkpoint must end with one of {SINGLE_FILE_SUFFIXES}")
    if not os.path.isdir(location):
        # Checked here because ppdiffusers would take a missing folder for a hub id and try to download it.
        raise FileNotFoundError(
            f"No pretrained VAE at {location}: --pretrained_model_name_or_path must be a local folder or a "
            "single-file checkpoint (with --subfolder, e.g. 'vae', when the VAE sits inside a pipeline "
            "folder); nothing is downloaded.")
    present = set(os.listdir(location))
    if present & TRAINING_RUN_FILES:
        raise FileNotFoundError(
            f"{location} is a checkpoint of a training run ({', '.join(sorted(present & TRAINING_RUN_FILES))}), not a "
            f"VAE folder: start from its weights with --init_from_ckpt {location} (continue that run with "
            "--resume_from_checkpoint), or fine-tune the VAE that run exported, OUTPUT_DIR/vae.")
    for layout, files in (("ppdiffusers", PADDLE_WEIGHT_FILES), ("diffusers", TORCH_WEIGHT_FILES)):
        found = sorted(present & set(with_variants(files)))
        if found:
            if CONFIG_NAME not in present:
                raise FileNotFoundError(f"{location} holds {found[0]} but no {CONFIG_NAME}")
            return PretrainedSource(layout, location)
    hint = ""
    if not subfolder and os.path.isdir(os.path.join(location, "vae")):
        hint = " It has a 'vae' folder: add --subfolder vae."
    raise FileNotFoundError(
        f"No loadable VAE in {location}: looked for {CONFIG_NAME} with one of "
        f"{', '.join(PADDLE_WEIGHT_FILES + TORCH_WEIGHT_FILES)} (or their {'/'.join(WEIGHT_VARIANTS)} variants, "
        f"e.g. {with_variants(TORCH_WEIGHT_FILES[:1])[1]}). A single-file checkpoint "
        f"({'/'.join(SINGLE_FILE_SUFFIXES)}) is given as the path of the file itself.{hint}")


def with_variants(files: Sequence[str]) -> Tuple[str, ...]:
    """`files` and their WEIGHT_VARIANTS names (ppdiffusers' spelling: name.fp16.ext)."""
    stems = [name.rsplit(".", 1) for name in files]
    return tuple(files) + tuple(f"{stem}.{variant}.{ext}" for variant in WEIGHT_VARIANTS for stem, ext in stems)


def build_vae(
    vae_config_file: Optional[str] = None,
    pretrained_model_name_or_path: Optional[str] = None,
    subfolder: Optional[str] = None,
    ignore_keys: Sequence[str] = (),
    init_from_ckpt: Optional[str] = None,
) -> AutoencoderKL:
    """The VAE to train.

    - `vae_config_file` alone: a fresh VAE (initialised from Paddle's global RNG: seed first).
    - `pretrained_model_name_or_path` (+ `subfolder`): the pretrained VAE, with its own config, or with
      the architecture of `vae_config_file` when both are given (e.g. a different decoder; its weights
      then need `ignore_keys`). A single file without `vae_config_file` gets a config inferred from its
      tensor shapes, and SD's scaling factor (latent_scale.assumed_for_single_file, with a warning).
    - `ignore_keys`: weight-name prefixes (e.g. "decoder.") not loaded; those weights keep their fresh,
      seeded initialisation.
    - `init_from_ckpt`: weights only (after the above), see `load_vae_weights`; alone, the architecture is the
      checkpoint's `vae_config.json`.
    The VAE's `scaling_factor` / `shift_factor` (and `latents_mean` / `latents_std`) are those of the latent
    space its encoder weights come from, whatever `vae_config_file` states (the rule: latent_scale.py `settle`).
    """
    if vae_config_file is None and pretrained_model_name_or_path is None and init_from_ckpt is None:
        raise ValueError("Give a VAE source: vae_config_file (a JSON of AutoencoderKL kwargs, e.g. "
                         "configs/vae_tiny.json) and/or pretrained_model_name_or_path (a local folder or file)")
    ignore_keys = tuple(ignore_keys or ())
    source = None
    if pretrained_model_name_or_path is None:
        vae = vae_from_config_file(vae_config_file or _checkpoint_architecture(init_from_ckpt))
    else:
        source = find_pretrained(pretrained_model_name_or_path, subfolder)
        vae = _load_pretrained(source, vae_config_file, ignore_keys)
    if init_from_ckpt:
        load_vae_weights(vae, init_from_ckpt, ignore_keys)
    latent_scale.settle(vae, _latent_scale_statements(source, vae_config_file, init_from_ckpt),
                        weights_loaded=bool(source or init_from_ckpt),
                        encoder_reinitialised=latent_scale.reinitialises_encoder(ignore_keys))
    check_ignore_keys(vae, ignore_keys)
    return vae


def _latent_scale_statements(source: Optional[PretrainedSource], config_file: Optional[str],
                             init_from_ckpt: Optional[str]) -> List[latent_scale.Statement]:
    """Who states the latent scale, the source of the encoder's weights first (latent_scale.settle's order)."""
    statements = [latent_scale.of_weights(init_from_ckpt)] if init_from_ckpt else []
    if source is not None:
        statements.append(latent_scale.of_single_file(source.path) if source.layout == "single_file"
                          else latent_scale.of_pretrained(source.path))
    if config_file:
        statements.append(latent_scale.of_config_file(config_file))
    elif source is not None and source.layout == "single_file":
        statements.append(latent_scale.assumed_for_single_file(source.path))
    elif source is None and not statements[0].entries:  # the architecture a checkpoint holds, for its factor
        statements.append(latent_scale.of_config_file(checkpoint_vae_config(init_from_ckpt),
                                                      f"the vae_config.json of {init_from_ckpt}"))
    return statements


def check_ignore_keys(vae: AutoencoderKL, ignore_keys: Iterable[str]) -> None:
    """An --ignore_keys prefix that names no weight (a typo such as `decoders.`) would leave the run loading
    everything, with no sign of it: refuse it."""
    names = list(vae.state_dict())
    unmatched = [prefix for prefix in ignore_keys if not any(name.startswith(prefix) for name in names)]
    if unmatched:
        tops = sorted({name.split(".")[0] + "." for name in names})
        raise ValueError(f"--ignore_keys {' '.join(unmatched)}: no weight of this VAE starts with that; its weight "
                         f"names start with {', '.join(tops)} (e.g. --ignore_keys decoder.)")


def _checkpoint_architecture(init_from_ckpt: str) -> str:
    config = checkpoint_vae_config(init_from_ckpt)
    if config is None:
        hint = _not_a_checkpoint_hint(init_from_ckpt)
        raise FileNotFoundError(f"--init_from_ckpt {init_from_ckpt} is not a checkpoint-N.{hint}" if hint else
                                f"--init_from_ckpt {init_from_ckpt} holds no vae_config.json (not a checkpoint of "
                                "this version): give the architecture with --vae_config_file")
    return config


def _not_a_checkpoint_hint(path: str) -> str:
    """What a folder given to --init_from_ckpt is instead of a checkpoint-N, when it is something we know."""
    if not os.path.isdir(path):
        return ""
    checkpoints = list_checkpoints(path)
    if checkpoints:
        return (f" It is a run's output folder: give one of its checkpoints, e.g. --init_from_ckpt "
                f"{checkpoints[-1][1]}.")
    try:
        find_pretrained(path)
    except (FileNotFoundError, ValueError):
        return ""
    return f" It is a VAE folder: fine-tune it with --pretrained_model_name_or_path {path}."


def vae_from_config_file(config_file: str) -> AutoencoderKL:
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"VAE config file {config_file} does not exist")
    return vae_from_config(AutoencoderKL.load_config(config_file))


def vae_class(config: dict) -> type:
    """The class a config describes: FLUX.2's AutoencoderKLFlux2 (by its _class_name or its own keys,
    models/flux2.py), else ppdiffusers' AutoencoderKL."""
    return AutoencoderKLFlux2 if is_flux2_config(config) else AutoencoderKL


def vae_from_config(config: dict) -> AutoencoderKL:
    """A fresh VAE (initialised from Paddle's global RNG) whose saved config rebuilds it."""
    if is_flux2_config(config):
        return flux2_from_config(config)
    return AutoencoderKL.from_config(with_encoder_widths(config))


def with_encoder_widths(config: dict) -> dict:
    """`config` with the encoder's widths stated as `down_block_out_channels` when the decoder has its own.

    ppdiffusers' AutoencoderKL builds the encoder from `block_out_channels` when `down_block_out_channels`
    is null, then overwrites `block_out_channels` in its config with the DECODER's widths (`up_block_out_channels`,
    autoencoder_kl.py). A saved super-resolving VAE (the reference trainer's config/vae.json) would then
    rebuild its encoder with the decoder's widths and fail to load. Stating both widths makes the saved
    config rebuild the same VAE.
    """
    config = dict(config)
    if config.get("up_block_out_channels") is not None and config.get("down_block_out_channels") is None:
        default = inspect.signature(AutoencoderKL.__init__).parameters["block_out_channels"].default
        config["down_block_out_channels"] = list(config.get("block_out_channels", default))
    return config


def _load_pretrained(source: PretrainedSource, config_file: Optional[str], ignore_keys: Tuple[str, ...]) -> AutoencoderKL:
    if source.layout == "single_file":
        ldm_state = _read_single_file(source.path)
        vae = (vae_from_config_file(config_file) if config_file
               else vae_from_config(infer_single_file_config(ldm_state, source.path)))
        assign_weights(vae, _convert_single_file(vae, ldm_state), ignore_keys, source.path)
        return vae
    if config_file is not None:  # another architecture: build it, then take what fits from the pretrained one
        vae = vae_from_config_file(config_file)
        assign_weights(vae, _from_pretrained(source, ()).state_dict(), ignore_keys, source.path)
        return vae
    return _from_pretrained(source, ignore_keys)


def _from_pretrained(source: PretrainedSource, ignore_keys: Tuple[str, ...]) -> AutoencoderKL:
    """ppdiffusers' own loader (PyTorch folders converted with from_diffusers=True); ignored weights keep
    their fresh initialisation (low_cpu_mem_usage=False initialises every weight before loading)."""
    cls = vae_class(AutoencoderKL.load_config(source.path))
    if cls is AutoencoderKL:
        _check_encoder_widths(source.path)
    with _counter_not_reported_missing():
        vae, info = cls.from_pretrained(
            source.path, from_diffusers=source.from_diffusers, ignore_keys=list(ignore_keys),
            low_cpu_mem_usage=False, output_loading_info=True, local_files_only=True)
    missing = info["missing_keys"]
    if is_flux2(vae):
        with_source_entries(vae, AutoencoderKL.load_config(source.path))
        if source.from_diffusers:
            missing = _load_torch_counters(vae, source.path, missing, ignore_keys)
    _check_missing(source.path, missing, ignore_keys)
    _check_unexpected(source.path, info["unexpected_keys"])
    vae.train()  # from_pretrained returns eval mode; the trainer sets modes itself, as for a fresh model
    return vae


# BatchNorm's step counter: ppdiffusers' PyTorch -> Paddle conversion drops it (Paddle's BatchNorm has none);
# models/flux2.py keeps it as a buffer so that diffusers finds it in our exports.
COUNTER_SUFFIX = ".num_batches_tracked"


def torch_counters(state: Dict[str, object]) -> Dict[str, np.ndarray]:
    """The BatchNorm counters of a PyTorch state dict, as Paddle's [1]-shaped int64, before conversion drops them."""
    return {key: np.asarray(value, dtype=np.int64).reshape([1]) for key, value in state.items()
            if key.endswith(COUNTER_SUFFIX)}


def _load_torch_counters(vae: AutoencoderKL, folder: str, missing: List[str], ignore_keys: Iterable[str]) -> List[str]:
    """Load the counters ppdiffusers' loader dropped from the PyTorch weight file of `folder`; the keys still missing."""
    wanted = [key for key in missing if key.endswith(COUNTER_SUFFIX) and not _ignored(key, ignore_keys)]
    if not wanted:
        return missing
    present = set(os.listdir(folder))
    files = [name for name in with_variants(TORCH_WEIGHT_FILES) if name in present and not name.endswith(".json")]
    state: Dict[str, object] = {}
    if files:
        load_state_dict(os.path.join(folder, files[0]), state)
    counters = torch_counters({key: _numpy(value) for key, value in state.items()})
    own = vae.state_dict()
    for key in wanted:
        if key in counters:
            own[key].set_value(paddle.to_tensor(counters[key]))
    return [key for key in missing if key not in counters]


class _DropCounterWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return f"newly initialized: ['bn{COUNTER_SUFFIX}']" not in record.getMessage()


@contextlib.contextmanager
def _counter_not_reported_missing() -> Iterator[None]:
    """ppdiffusers' loader says FLUX.2's bn counter is "newly initialized" (its PyTorch conversion drops it);
    `_load_torch_counters` loads it right after, so that one line would be false. Other lines pass."""
    library_logger, dropped = logging.getLogger("ppdiffusers.models.modeling_utils"), _DropCounterWarning()
    library_logger.addFilter(dropped)
    try:
        yield
    finally:
        library_logger.removeFilter(dropped)


def _numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)


def _check_unexpected(source: str, unexpected: List[str]) -> None:
    """A weight of the source that this VAE has no place for is not dropped silently."""
    if not unexpected:
        return
    if any(key.startswith("bn.") for key in unexpected):
        raise ValueError(
            f"{source} holds {', '.join(k for k in unexpected if k.startswith('bn.'))}: the latent normalisation "
            f"(BatchNorm statistics) of a FLUX.2 VAE ({FLUX2_CLASS_NAME}), which this VAE (AutoencoderKL) has no place "
            f"for. Give a config of class {FLUX2_CLASS_NAME} (\"_class_name\": \"{FLUX2_CLASS_NAME}\", e.g. "
            "configs/flux2_vae.json), or none: the source's own config is used.")
    raise ValueError(f"{source} holds {len(unexpected)} weights this VAE has no place for, e.g. {unexpected[:5]}: a "
                     "different architecture? Give the matching --vae_config_file.")


def _check_encoder_widths(folder: str) -> None:
    """Refuse a config.json that lost its encoder's widths (see `with_encoder_widths`): saved by ppdiffusers
    from a VAE whose decoder had other widths, e.g. by the reference trainer. The weights would not fit."""
    config = AutoencoderKL.load_config(folder)
    widths, down_blocks = config.get("block_out_channels") or [], config.get("down_block_types") or []
    if config.get("down_block_out_channels") is None and len(widths) != len(down_blocks):
        raise ValueError(
            f"{os.path.join(folder, CONFIG_NAME)}: {len(down_blocks)} down blocks but block_out_channels {widths} "
            "(the decoder's widths, written over the encoder's by ppdiffusers when saving a VAE with "
            "up_block_out_channels). Add \"down_block_out_channels\": [the encoder's widths, e.g. those of the "
            "--vae_config_file it was trained from] to that config.json.")


def _ignored(key: str, ignore_keys: Iterable[str]) -> bool:
    return any(key.startswith(prefix) for prefix in ignore_keys)


def _check_missing(source: str, missing: List[str], ignore_keys: Iterable[str]) -> None:
    missing = [k for k in missing if not _ignored(k, ignore_keys)]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} weights of this VAE, e.g. {missing[:5]}: a different "
                         "architecture? Give the matching --vae_config_file, or --ignore_keys PREFIX to leave "
                         "those weights freshly initialised.")


def assign_weights(vae: AutoencoderKL, state: Dict[str, object], ignore_keys: Iterable[str], source: str) -> None:
    """Load a Paddle-layout state dict into `vae`: every weight not ignored must be there with its shape."""
    expected = vae.state_dict()
    state = {k: v for k, v in state.items() if not _ignored(k, ignore_keys)}
    mismatched = [f"{k}: {list(v.shape)} in the file, {list(expected[k].shape)} here"
                  for k, v in state.items() if k in expected and list(v.shape) != list(expected[k].shape)]
    if mismatched:
        raise ValueError(f"{source}: {len(mismatched)} weights have other shapes than this VAE's, e.g. "
                         f"{mismatched[:3]}. Give the matching --vae_config_file, or --ignore_keys PREFIX.")
    _check_missing(source, [k for k in expected if k not in state], ignore_keys)
    _check_unexpected(source, sorted(set(state) - set(expected)))
    # Ignored weights are given their own (fresh) values: a partial dict would make Paddle warn once per weight.
    vae.set_state_dict({k: _as_dtype(state[k], expected[k].dtype) if k in state else expected[k] for k in expected})


def _as_dtype(value, dtype):
    tensor = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(np.asarray(value))
    return tensor.astype(dtype) if tensor.dtype != dtype else tensor


# ---- original LDM / SD / SDXL / FLUX single files

def _read_single_file(path: str) -> Dict[str, np.ndarray]:
    try:
        state = smart_load(path, return_numpy=True)
    except Exception as error:  # e.g. a .ckpt pickling training objects that torch's weights_only load refuses
        raise ValueError(f"cannot read {path} ({error}); a .safetensors export of the VAE always loads") from error
    state = state.get("state_dict", state)
    if any(k.startswith("first_stage_model.") for k in state):  # a whole SD checkpoint: its VAE part
        state = {k[len("first_stage_model."):]: v for k, v in state.items() if k.startswith("first_stage_model.")}
    if any(k.startswith("encoder.down_blocks.") for k in state):  # diffusers' names, not LDM's
        raise ValueError(f"{path} is the weight file of a diffusers / ppdiffusers VAE folder, not an original LDM "
                         f"single file: give the folder, --pretrained_model_name_or_path {os.path.dirname(path) or '.'}")
    if "encoder.conv_in.weight" not in state or "decoder.conv_out.weight" not in state:
        raise ValueError(f"{path} is not an original LDM/SD VAE checkpoint (no encoder.conv_in / decoder.conv_out "
                         "weights); a diffusers VAE is a folder with config.json")
    return state


def infer_single_file_config(state: Dict[str, np.ndarray], path: str) -> dict:
    """AutoencoderKL kwargs (the architecture) from an LDM VAE's tensor shapes. GroupNorm's group count is not
    in the tensors: SD's 32 is assumed. Nor is the latent scale, which this config does not state: `build_vae`
    gives the VAE SD's factor through latent_scale.assumed_for_single_file (and its one warning). 16-channel
    VAEs (FLUX, SD3) and non-SD widths need --vae_config_file (configs/flux_vae.json)."""
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down.")})
    widths = [int(state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) for i in levels]
    layers = len({k.split(".")[4] for k in state if k.startswith("encoder.down.0.block.")})
    latent_channels = int(state["decoder.conv_in.weight"].shape[1])
    if latent_channels != 4:
        raise ValueError(f"{path}: a {latent_channels}-channel VAE; its scaling factor is not in the file. Give "
                         "its config with --vae_config_file (e.g. configs/flux_vae.json for FLUX).")
    if any(width % SD_NORM_GROUPS for width in widths):
        raise ValueError(f"{path}: block widths {widths} are not SD's (GroupNorm of {SD_NORM_GROUPS} groups); give "
                         "the VAE's config with --vae_config_file")
    logger.info("%s: architecture inferred from the tensor shapes (block widths %s, %d latent channels; SD's %d "
                "GroupNorm groups)", path, widths, latent_channels, SD_NORM_GROUPS)
    return {
        "in_channels": int(state["encoder.conv_in.weight"].shape[1]),
        "out_channels": int(state["decoder.conv_out.weight"].shape[0]),
        "down_block_types": ["DownEncoderBlock2D"] * len(widths),
        "up_block_types": ["UpDecoderBlock2D"] * len(widths),
        "block_out_channels": widths,
        "layers_per_block": layers,
        "latent_channels": latent_channels,
        "norm_num_groups": SD_NORM_GROUPS,
        "sample_size": 512,
        "use_quant_conv": "quant_conv.weight" in state,
        "use_post_quant_conv": "post_quant_conv.weight" in state,
    }


def _convert_single_file(vae: AutoencoderKL, ldm_state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """LDM names -> diffusers names (ppdiffusers' converter), then torch -> Paddle layout (Linear transposed)."""
    state = dict(ldm_state)
    # The converter expects quant_conv/post_quant_conv, which FLUX-style VAEs do not have: stand-ins, dropped after.
    stand_ins = [k for k in ("quant_conv.weight", "quant_conv.bias", "post_quant_conv.weight", "post_quant_conv.bias")
                 if k not in state]
    state.update({k: np.zeros([1], "float32") for k in stand_ins})
    converted = convert_ldm_vae_checkpoint(state, dict(vae.config))
    for key in stand_ins:
        converted.pop(key, None)
    return convert_diffusers_vae_unet_to_ppdiffusers(vae, converted)


# ---- --init_from_ckpt

def load_vae_weights(vae: AutoencoderKL, path: str, ignore_keys: Iterable[str] = ()) -> None:
    """Weights only (no optimizer, schedule or step) into `vae` from one of:
    - a `checkpoint-N` folder of ours, or its `model_state.pdparams` (the `vae.` weights of it; for an O2 run,
      the float32 master weights of its optimizer.pdopt, `checkpoint.read_model_state`);
    - a VAE weight file: ppdiffusers' `diffusion_paddle_model.safetensors` / `model_state.pdparams`, or
      PyTorch diffusers' `diffusion_pytorch_model.safetensors` / `.bin` (converted to Paddle's layout).
    Every weight not covered by `ignore_keys` must be in the file, with the same shape.
    """
    file = os.path.join(path, names.PADDLE_WEIGHTS_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--init_from_ckpt {path}: no such file (expected a checkpoint-N folder or a weight "
                                f"file).{_not_a_checkpoint_hint(path)}")
    state: Dict[str, object] = {}
    if file.endswith(".pdparams"):
        state = read_model_state(file)  # O2 checkpoints: the float32 master weights
    elif load_state_dict(file, state) == "pt":
        counters = torch_counters({key: _numpy(value) for key, value in state.items()})
        convert_pytorch_state_dict_to_paddle(vae, state)
        state.update(counters)
    if any(k.startswith("vae.") for k in state):  # our checkpoint: the VAE part of VAEWithDiscriminator
        state = {k[len("vae."):]: v for k, v in state.items() if k.startswith("vae.")}
    assign_weights(vae, state, ignore_keys, file)
    logger.info("initialised the VAE weights from %s", file)
