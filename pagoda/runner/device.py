"""Where the engine runs: EngineConfig's "auto" device made concrete, config dtype names as
torch dtypes (the configs are torch-free and name dtypes as strings), small host-to-device
copies that never wait for the device, the name of the kernels a step runs, and how the host's
allocator keeps a CPU engine's freed memory."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)

MALLOC_SWITCH = "PAGODA_CPU_MALLOC"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_INT_MAX = 2**31 - 1
_malloc_state = {"kept": False}


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


def keep_freed_host_memory() -> bool:
    """A CPU engine's process: glibc hands freed blocks to the next allocation instead of
    giving them back to the kernel (mmap off, trimming off). A step's large tensors are above
    glibc's mmap threshold (32 MB at most): the 1.5B's gate/up output at 2,048 rows is 147 MB,
    so each layer mapped it afresh and the kernel faulted in and zeroed every page on first
    touch, a fifth of a 2,048-token prefill. The process then holds its peak memory between
    steps, as jemalloc and tcmalloc (which vLLM's CPU docs preload) do. PAGODA_CPU_MALLOC=system
    keeps glibc's defaults. Returns whether the setting is in force (also when an earlier call
    made it); False off glibc."""
    if os.environ.get(MALLOC_SWITCH, "keep") == "system":
        return False
    if _malloc_state["kept"]:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    kept = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    _malloc_state["kept"] = kept
    if kept:
        logger.info(
            "host memory: freed blocks kept for reuse (%s=system: glibc's defaults)", MALLOC_SWITCH
        )
    return kept
