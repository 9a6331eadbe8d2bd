"""LoRA adapters on the server, as vLLM serves them: a request names an adapter as its `model`;
`--lora-modules name=path` (or its JSON form) serves adapters from the start; with
PAGODA_ALLOW_RUNTIME_LORA_UPDATING=true (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) the
routes `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` add and remove them at run
time, behind --api-key like every /v1 route. The engine reads and checks an adapter when it is
loaded (a bad one is a 400 and the server goes on)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, params
from fastapi.responses import PlainTextResponse

from pagoda.client.async_client import EngineDeadError
from pagoda.lora_request import LoRARequest
from pagoda.server.errors import APIError
from pagoda.server.lora_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

if TYPE_CHECKING:
    from pagoda.server.state import ServerState


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
