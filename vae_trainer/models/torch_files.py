"""PyTorch weight files read without torch (`read_state_dict`): a torch.save pickle unpickles tensors, dicts and plain
values only (no code runs); a .safetensors file is read by safetensors' Paddle loader, bfloat16 included.
ppdiffusers' torch-free `torch_load` raises on `np.cfloat` under numpy 2.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import numpy as np
import paddle
from safetensors import safe_open


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_) -> np.ndarray:
    strides = [step * storage.itemsize for step in stride]
    view = np.array(np.lib.stride_tricks.as_strided(storage[offset:], size, strides))
    # numpy has no bfloat16: a torch.save storage of it is read as its bits, uint16, and widened to float32 here.
    return (view.astype(np.uint32) << 16).view(np.float32) if view.dtype == np.uint16 else view


_STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": np.uint16,
             "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ByteStorage": np.uint8,
             "BoolStorage": np.bool_}
# The only globals a plain tensor state dict pickles.
_ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): lambda data, *_: data,
            ("collections", "OrderedDict"): collections.OrderedDict,
            **{("torch", name): dtype for name, dtype in _STORAGES.items()}}


def read_state_dict(path: str) -> dict:
    """The arrays of a .safetensors or torch.save file as numpy (nested dicts kept; bfloat16 as float32)."""
    if path.endswith(".safetensors"):  # safetensors' Paddle loader: numpy has no bfloat16, Paddle has (cast exactly)
        with safe_open(path, framework="paddle") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.offset_keys()}  # in the file's order
        return {name: (tensor.astype("float32") if tensor.dtype == paddle.bfloat16 else tensor).numpy()
                for name, tensor in tensors.items()}
    if not zipfile.is_zipfile(path):  # torch.save before 1.6: a plain pickle, which torch itself reads
        import torch  # without torch: ModuleNotFoundError

        def to_numpy(value):
            if isinstance(value, dict):
                return {name: to_numpy(item) for name, item in value.items()}
            if not torch.is_tensor(value):
                return value
            return (value.float() if value.dtype == torch.bfloat16 else value).numpy()

        return to_numpy(torch.load(path, map_location="cpu", weights_only=True))
    with zipfile.ZipFile(path) as archive:
        pickle_name = next(name for name in archive.namelist() if name.endswith("data.pkl"))
        storage_folder = pickle_name[: -len("data.pkl")] + "data/"

        class TensorsOnly(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) not in _ALLOWED:
                    raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor state dict")
                return _ALLOWED[module, name]

            def persistent_load(self, saved_id):
                _, dtype, key, _, numel = saved_id
                return np.frombuffer(archive.read(storage_folder + key), dtype=dtype, count=numel)

        return TensorsOnly(io.BytesIO(archive.read(pickle_name))).load()
