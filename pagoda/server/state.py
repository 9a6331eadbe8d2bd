"""ServerConfig and ServerState: what the routes share, and the server's lifecycle (start-up,
SIGTERM drain, the engine's death)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import uvicorn

from pagoda.client.async_client import AsyncEngine, EngineLaunch
from pagoda.config import EngineConfig
from pagoda.lora_request import LoRARequest
from pagoda.server.errors import APIError
from pagoda.server.lora_models import LoRAModels
from pagoda.server.metrics import Metrics

logger = logging.getLogger("pagoda.server")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 30.0
    log_requests: bool = True
    log_stats_interval: float = 10.0
    uvicorn_log_level: str = "info"
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice, --tool-call-parser)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # <think> apart from the answer (vLLM's --reasoning-parser: qwen3 or deepseek_r1)
    reasoning_parser: str | None = None
    # LoRA adapters served from the start (--lora-modules; server/lora.py numbers them), and
    # the runtime load / unload routes (PAGODA_ALLOW_RUNTIME_LORA_UPDATING)
    lora_modules: tuple[LoRARequest, ...] = ()
    allow_runtime_lora_updating: bool = False


class ServerState:
    """What the routes share: the engine client, the model names, draining and exit status."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServerConfig,
        launch: EngineLaunch | None = None,
    ) -> None:
        """`launch`: the engine process already started (launch_engine), if it was."""
        self.config = config
        self.engine_config = engine_config
        self.model_name = config.served_model_name or engine_config.model or "SmolLM2-135M-Instruct"
        if config.lora_modules and not engine_config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        self.loras = LoRAModels(config.lora_modules)
        if self.model_name in self.loras.by_name:
            raise ValueError(f"a LoRA adapter may not take the model's name {self.model_name!r}")
        self.metrics = Metrics(self.model_name)
        if engine_config.enable_lora:
            self.metrics.serve_loras(engine_config.max_loras, self.loras.name_of)
        self.engine = AsyncEngine(
            engine_config,
            self.metrics,
            self._on_engine_dead,
            log_requests=config.log_requests,
            launch=launch,
        )
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None

    def _on_engine_dead(self, reason: str) -> None:
        self.exit_code = 1
        # Let in-flight requests send their error events, then stop.
        asyncio.get_running_loop().call_later(1.0, self.stop)

    def fail(self, reason: str) -> None:
        """Stop with exit status 1 (a start-up step failed)."""
        logger.error("%s", reason)
        self.exit_code = 1
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    @property
    def unavailable_reason(self) -> str | None:
        if self.engine.dead_reason is not None:
            return f"the engine is not running: {self.engine.dead_reason}"
        if self.draining:
            return "the server is shutting down"
        if not self.engine.ready:
            return "the server is starting up"
        return None

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is unset, the served model's name or a LoRA adapter's."""
        if model is not None and model != self.model_name and model not in self.loras.by_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None: the base model."""
        return None if model is None else self.loras.by_name.get(model)

    def served_name(self, model: str | None) -> str:
        """The `model` a response names: the adapter's, or the served model's."""
        return model if self.lora_of(model) is not None and model else self.model_name

    def admit(self) -> None:
        """429 while --max-waiting-requests requests wait in the engine."""
        limit = self.config.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            raise APIError(
                429,
                f"too many requests waiting ({self.engine.num_waiting} >= --max-waiting-requests "
                f"{limit}); retry later",
                headers={"Retry-After": "1"},
            )

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let in-flight ones finish within the timeout, exit."""
        if self.draining:
            return
        self.draining = True
        n = len(self.engine.streams)
        logger.info(
            "SIGTERM: draining %d in-flight requests (timeout %.0f s)",
            n,
            self.config.shutdown_timeout,
        )
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self.engine.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.engine.streams):
            logger.warning("aborting request %s at the shutdown timeout", rid)
            self.engine.abort(rid)
        await asyncio.sleep(0.1)
        self.stop()

    async def log_stats_forever(self) -> None:
        interval = self.config.log_stats_interval
        while interval > 0:
            await asyncio.sleep(interval)
            line = self.metrics.stats_line()
            if line is not None:
                logger.info("%s", line)
