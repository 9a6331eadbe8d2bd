"""The LoRA adapters a server serves, by the names requests give as `model` (server/lora.py
has the routes), and how `pagoda serve` is told about them: --lora-modules values and the
runtime-updating switch."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Mapping, Sequence

from pydantic import BaseModel

from pagoda.lora_request import LoRARequest

RUNTIME_UPDATING_ENV = ("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(env: Mapping[str, str] = os.environ) -> bool:
    return any(env.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV)


def parse_lora_module(text: str) -> LoRARequest:
    """One --lora-modules value: `name=path`, or vLLM's JSON `{"name": ..., "path": ...,
    "base_model_name": ...}`; its id is set when the server numbers them (LoRAModels)."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from e
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields):
            raise ValueError(f"--lora-modules {text!r}: a JSON module needs name and path")
        return LoRARequest(fields["name"], 1, fields["path"], fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give name=path")
    return LoRARequest(name, 1, path)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    """The adapters served, by name (ids from 1 in the order they were added)."""

    def __init__(self, modules: Sequence[LoRARequest]) -> None:
        self._ids = itertools.count(1)
        self.by_name: dict[str, LoRARequest] = {}
        self.lock = asyncio.Lock()  # one load or unload at a time
        for module in modules:
            if module.lora_name in self.by_name:
                raise ValueError(f"--lora-modules names {module.lora_name!r} twice")
            self.by_name[module.lora_name] = self.numbered(module)

    def numbered(self, request: LoRARequest) -> LoRARequest:
        return LoRARequest(
            request.lora_name, next(self._ids), request.lora_path, request.base_model_name
        )

    def name_of(self, lora_id: int) -> str:
        found = (r.lora_name for r in self.by_name.values() if r.lora_int_id == lora_id)
        return next(found, str(lora_id))
