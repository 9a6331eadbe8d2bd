"""LoRA adapters on the server, as vLLM serves them: a request names an adapter as its `model`;
`--lora-modules name=path` (or its JSON form) serves adapters from the start; with
PAGODA_ALLOW_RUNTIME_LORA_UPDATING=true (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) the
routes `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` add and remove them at run
time, behind --api-key like every /v1 route. The engine reads and checks an adapter when it is
loaded (a bad one is a 400 and the server goes on)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, params
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagoda.client.async_client import EngineDeadError
from pagoda.lora_request import LoRARequest
from pagoda.server.errors import APIError

if TYPE_CHECKING:
    from pagoda.server.state import ServerState

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


async def load_modules(state: ServerState) -> None:
    """--lora-modules, once the engine runs: a module the engine refuses stops the server."""
    for request in list(state.loras.by_name.values()):
        try:
            await state.engine.lora.load(request)
        except (ValueError, EngineDeadError) as e:
            state.fail(f"--lora-modules {request.lora_name}={request.lora_path}: {e}")
            return


def add_lora_routes(app: FastAPI, state: ServerState, deps: Sequence[params.Depends]) -> None:
    if not state.config.allow_runtime_lora_updating:
        return

    @app.post("/v1/load_lora_adapter", dependencies=deps)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if not name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        async with state.loras.lock:
            if name in state.loras.by_name or name == state.model_name:
                raise APIError(
                    400, f"The lora adapter '{name}' has already been loaded.", "lora_name"
                )
            request = state.loras.numbered(LoRARequest(name, 1, body.lora_path))
            await _engine_call(state.engine.lora.load(request))
            state.loras.by_name[name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=deps)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        async with state.loras.lock:
            request = state.loras.by_name.pop(name, None)
            if request is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            await _engine_call(state.engine.lora.unload(request.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _engine_call(call: Awaitable[None]) -> None:
    try:
        await call
    except ValueError as e:
        raise APIError(400, str(e), "lora_path") from e
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not running: {e}") from e
