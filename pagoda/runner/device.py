"""Where the engine runs: EngineConfig's "auto" device made concrete, config dtype names as
torch dtypes (the configs are torch-free and name dtypes as strings), small host-to-device
copies that never wait for the device, and the name of the kernels a step runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagoda.config import EngineConfig


def resolve_device(config: EngineConfig) -> EngineConfig:
    """`config` with device "auto" replaced by "cuda" when CUDA is available, else "cpu"."""
    if config.device != "auto":
        return config
    return config.with_device("cuda" if torch.cuda.is_available() else "cpu")


def kernels_name(backend: str, device_type: str) -> str:
    """The engine log's name for a step's kernels: the backend, and on CPU whether pagoda's C++
    kernels run under it (the torch backend calls them for matmuls, attention and row ops)."""
    if device_type != "cpu":
        return backend
    from pagoda.kernels.cpu import ISA_NAMES, kernels

    ops = kernels()
    if ops is None:
        return f"{backend}, pagoda's C++ CPU kernels off"
    return f"{backend}, pagoda's C++ CPU kernels ({ISA_NAMES[ops.isa()]})"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a config names ("float32", "bfloat16", "int8", "float8_e4m3fn", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (nested for more dimensions, as torch.tensor takes it) as a tensor on
    `device` without waiting for the device: on CUDA the copy goes through pinned memory with
    non_blocking (torch.tensor(..., device="cuda") copies synchronously, so it would wait for
    every step queued before it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def numpy_to_device(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`, without waiting for the device (see to_device)."""
    host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
