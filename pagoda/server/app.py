"""The OpenAI-compatible HTTP server: the FastAPI app over AsyncEngine, its API-key check, and
running it under uvicorn (the first SIGTERM drains).

Routes: /health, /metrics, /version and /ui (open; webui.py), /v1/models, /tokenize, /detokenize,
/v1/completions (completions.py), /v1/chat/completions (chat.py), /v1/embeddings
(embeddings.py, --runner pooling), /v1/score and /v1/rerank (scoring.py, a classifier),
/v1/responses (responses.py), and Anthropic's /v1/messages
and /v1/messages/count_tokens (messages.py). Every error leaves in OpenAI's shape (errors.py),
except on the Messages routes: Anthropic's (anthropic_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request, params
from fastapi.responses import Response

from pagoda.client.async_client import EngineLaunch
from pagoda.config import EngineConfig
from pagoda.server.anthropic_errors import install_anthropic_error_handlers, on_messages_path
from pagoda.server.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from pagoda.server.auth import bearer_matches, header_key_matches, key_digest
from pagoda.server.chat import conversation, create_chat_completion
from pagoda.server.completions import create_completion
from pagoda.server.embeddings import create_embedding
from pagoda.server.embeddings_protocol import EmbeddingRequest
from pagoda.server.errors import APIError, error_response, install_error_handlers
from pagoda.server.live import MIN_INTERVAL_S, Watchers, event_stream
from pagoda.server.lora import add_lora_routes, load_modules
from pagoda.server.messages import count_tokens, create_message
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagoda.server.response_store import ResponseStore
from pagoda.server.responses import add_response_routes
from pagoda.server.scoring import add_scoring_routes
from pagoda.server.state import ServerConfig, ServerState
from pagoda.server.webui import add_ui_routes
from pagoda.version import __version__

logger = logging.getLogger("pagoda.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = asyncio.create_task(_start(state))
        stats = asyncio.create_task(state.log_stats_forever())
        try:
            yield
        finally:
            stats.cancel()
            start.cancel()
            await state.engine.shutdown()

    app = FastAPI(
        title="pagoda", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    install_anthropic_error_handlers(app)
    deps = [Depends(_guard(state))]
    _add_open_routes(app, state)
    add_ui_routes(app)
    _add_model_routes(app, state, deps)
    _add_request_routes(app, state, deps)
    watchers = Watchers(state.engine)

    @app.get("/v1/engine/events", dependencies=deps)
    async def engine_events(request: Request, interval_s: float = MIN_INTERVAL_S) -> Response:
        """Server-sent events of the engine's state for the live view (server/live.py)."""
        return event_stream(request, state.engine, state.metrics, watchers, interval_s)

    @app.post("/v1/completions", dependencies=deps)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", dependencies=deps)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.post("/v1/embeddings", dependencies=deps)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(state, body, request)

    add_response_routes(app, state, deps, ResponseStore())
    add_scoring_routes(app, state, deps)
    add_lora_routes(app, state, deps)

    @app.post("/v1/messages", dependencies=deps)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens", dependencies=deps)
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(state, body)

    return app


async def _start(state: ServerState) -> None:
    """The engine, then the adapters of --lora-modules."""
    await state.engine.start()
    if state.engine.ready:
        await load_modules(state)


# ---- auth --------------------------------------------------------------------------------------
def _guard(state: ServerState) -> Callable[[Request], Awaitable[None]]:
    key = state.config.api_key
    digest = None if key is None else key_digest(key.encode())

    async def guard(request: Request) -> None:
        """401 without the API key, 503 while unavailable (open paths excepted). The Messages
        routes take the key as Anthropic's clients send it (`x-api-key`) too."""
        path = request.url.path
        if path in OPEN_PATHS:
            return
        headers = request.headers
        if digest is not None and not bearer_matches(headers.get("authorization"), digest):
            if not on_messages_path(path):
                raise APIError(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>'"
                )
            if not header_key_matches(headers.get("x-api-key"), digest):
                raise APIError(401, "invalid or missing API key: send 'x-api-key: <key>'")
        reason = state.unavailable_reason
        if reason is not None:
            raise APIError(503, reason)

    return guard


# ---- the model and its tokenizer, health ------------------------------------------------------------------------------
def _add_open_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = state.unavailable_reason
        if reason is not None:
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _add_model_routes(app: FastAPI, state: ServerState, deps: Sequence[params.Depends]) -> None:
    @app.get("/v1/models", dependencies=deps)
    async def models() -> ModelList:
        info = state.engine.info
        card = ModelCard(
            id=state.model_name,
            root=state.engine_config.model or state.model_name,
            max_model_len=info.max_model_len if info else None,
        )
        adapters = [
            ModelCard(
                id=r.lora_name,
                root=r.lora_path,
                parent=state.model_name,
                max_model_len=card.max_model_len,
            )
            for r in state.loras.by_name.values()
        ]
        return ModelList(data=[card, *adapters])

    @app.post("/tokenize", dependencies=deps)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        ids = _token_ids(state, body)
        info = state.engine.info
        return {
            "count": len(ids),
            "max_model_len": info.max_model_len if info else None,
            "tokens": ids,
        }

    @app.post("/detokenize", dependencies=deps)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        state.check_model(body.model)
        return {"prompt": state.engine.detokenize(body.tokens)}


def _add_request_routes(app: FastAPI, state: ServerState, deps: Sequence[params.Depends]) -> None:
    @app.get("/v1/requests/{request_id}/explain", dependencies=deps)
    async def explain(request_id: str) -> dict[str, Any]:
        """A finished request's timeline per sample (scheduling/explain.py); the request id is
        the response's `id` (`<id>-<i>` for prompt i of a completion with several)."""
        found = state.engine.explanations.get(request_id)
        if found is None:
            keep = state.engine.explanations.keep
            raise APIError(
                404,
                f"no finished request {request_id!r} is kept (the last {keep} are; "
                "--max-explained-requests)",
                "request_id",
            )
        return found


def _token_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None and body.messages is None:
        return state.engine.tokenize(body.prompt, body.add_special_tokens)
    if body.messages is not None and body.prompt is None:
        messages = conversation(body.messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return state.engine.chat_prompt(messages, None, body.add_generation_prompt, False, tools)[1]
    raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")


# ---- running -----------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains (ServerState.drain) instead of stopping."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self.loop is not None:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self.state.drain()))  # type: ignore[union-attr]
            return
        super().handle_exit(sig, frame)


def run_server(
    engine_config: EngineConfig, config: ServerConfig, launch: EngineLaunch | None = None
) -> int:
    """Serve until SIGTERM (drain, exit 0), SIGINT, or the engine's death (exit 1). `launch`:
    the engine process already started for engine_config (launch_engine), if it was."""
    state = ServerState(engine_config, config, launch)
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        timeout_keep_alive=5,
    )
    server = _Server(uv_config, state)
    state.server = server
    logger.info(
        "pagoda %s serving %s on http://%s:%d",
        __version__,
        state.model_name,
        config.host,
        config.port,
    )
    server.run()
    return state.exit_code
