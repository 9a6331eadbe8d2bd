"""Adapter loads and unloads sent to the engine process (`LoRAUpdate`), each answered as a
request is: accepted, or the engine's error (a ValueError here). The server's runtime
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` and its --lora-modules go through them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from pagoda.lora_request import LoRARequest
from pagoda.scheduling.messages import EngineCoreOutputs, EngineInput, LoRAUpdate


class LoRACalls:
    def __init__(self, send: Callable[[EngineInput], None]) -> None:
        self._send = send
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[None]] = {}

    async def load(self, request: LoRARequest) -> None:
        """ValueError when the engine cannot take the adapter (LoRA off, a bad adapter)."""
        await self._call(LoRAUpdate(f"lora-{next(self._ids)}", add=request))

    async def unload(self, lora_id: int) -> None:
        """ValueError when the engine holds no adapter of that id."""
        await self._call(LoRAUpdate(f"lora-{next(self._ids)}", remove=lora_id))

    async def _call(self, update: LoRAUpdate) -> None:
        future = asyncio.get_running_loop().create_future()
        self._pending[update.call_id] = future
        try:
            self._send(update)
            await future
        finally:
            self._pending.pop(update.call_id, None)

    def resolve(self, msg: EngineCoreOutputs) -> None:
        """The engine's answers in `msg` (call ids among its accepted ids and errors)."""
        for call_id in msg.accepted:
            future = self._pending.get(call_id)
            if future is not None and not future.done():
                future.set_result(None)
        for call_id, why in msg.errors.items():
            future = self._pending.get(call_id)
            if future is not None and not future.done():
                future.set_exception(ValueError(why))

    def fail(self, error: Exception) -> None:
        """The engine is gone: every pending call fails."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
