"""Where the engine runs: EngineConfig's "auto" device made concrete, and config dtype names as
torch dtypes (the configs are torch-free and name dtypes as strings)."""

from __future__ import annotations

import torch

from pagoda.config import EngineConfig


def resolve_device(config: EngineConfig) -> EngineConfig:
    """`config` with device "auto" replaced by "cuda" when CUDA is available, else "cpu"."""
    if config.device != "auto":
        return config
    return config.with_device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a config names ("float32", "bfloat16", "int8", "float8_e4m3fn", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype
