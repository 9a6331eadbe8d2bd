"""An embedding checkpoint's own pooling: its sentence-transformers files (modules.json, the
Pooling module's config.json, a Normalize module), as vLLM reads them."""

from __future__ import annotations

import json
import os
from typing import Any

from pagoda.pooler_config import DEFAULT_POOLER, PoolerConfig

# sentence-transformers' Pooling config keys -> pooling types pagoda runs
_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def checkpoint_pooler(folder: str | None) -> PoolerConfig:
    """The folder's sentence-transformers pooling, DEFAULT_POOLER's fields where it has none
    (no modules.json, or a GGUF file). ValueError for a pooling mode pagoda does not run."""
    path = None if folder is None else os.path.join(folder, "modules.json")
    if path is None or not os.path.isfile(path):
        return DEFAULT_POOLER
    modules = _read_json(path)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    pooling_type = DEFAULT_POOLER.pooling_type
    if "Pooling" in kinds:
        config = _read_json(os.path.join(folder or "", kinds["Pooling"]["path"], "config.json"))
        on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
        if len(on) != 1 or on[0] not in _MODES:
            raise ValueError(
                f"{folder}: sentence-transformers pooling {on} is not supported; pagoda pools "
                "with one of pooling_mode_lasttoken, pooling_mode_mean_tokens, "
                "pooling_mode_cls_token (or pass --pooler-config)"
            )
        pooling_type = _MODES[on[0]]
    return PoolerConfig(pooling_type, "Normalize" in kinds)


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The output sizes a Matryoshka model allows (vLLM reads the same config fields): its
    `matryoshka_dimensions`; [] (any size) for `is_matryoshka`; None for a model that is
    neither (its vectors are not to be cut)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    if getattr(hf_config, "is_matryoshka", False):
        return []
    return None
