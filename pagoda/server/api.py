"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncEngine.

Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for
invalid input (never FastAPI's 422), 401, 404, 429 (admission control, with Retry-After) and 503
(starting up, draining after SIGTERM, or the engine process is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.client.async_client import AsyncEngine, EngineDeadError, RequestStream
from pagoda.client.tokenizer import apply_chat_template
from pagoda.config import EngineConfig
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server.metrics import Metrics
from pagoda.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagoda.version import __version__

logger = logging.getLogger("pagoda.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
T = TypeVar("T")


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


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(
            message=message, type=_ERROR_TYPES.get(status, "Error"), param=param, code=status
        )
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _bad_field(e: ValueError) -> APIError:
    """A 400 for a SamplingParams / engine ValueError; `param` is the field its message names
    first (their messages start with the field's name)."""
    message = str(e)
    first = message.split(" ", 1)[0]
    return APIError(400, message, first if first in _REQUEST_FIELDS else None)


_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields
)


class ServerState:
    """What the routes share: the engine client, the model names, draining and exit status."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.model_name = config.served_model_name or engine_config.model or "SmolLM2-135M-Instruct"
        self.metrics = Metrics(self.model_name)
        self.engine = AsyncEngine(
            engine_config, self.metrics, self._on_engine_dead, log_requests=config.log_requests
        )
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None

    def _on_engine_dead(self, reason: str) -> None:
        self.exit_code = 1
        # Let in-flight requests send their error events, then stop.
        asyncio.get_running_loop().call_later(1.0, self.stop)

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


# ---- the app -----------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = asyncio.create_task(state.engine.start())
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
    _install_error_handlers(app)

    key_digest = None if state.config.api_key is None else _digest(state.config.api_key.encode())

    async def guard(request: Request) -> None:
        """401 without the API key, 503 while unavailable (open paths excepted)."""
        if request.url.path in OPEN_PATHS:
            return
        if key_digest is not None and not bearer_matches(
            request.headers.get("authorization"), key_digest
        ):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
        reason = state.unavailable_reason
        if reason is not None:
            raise APIError(503, reason)

    deps = [Depends(guard)]

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

    @app.get("/v1/models", dependencies=deps)
    async def models() -> ModelList:
        info = state.engine.info
        return ModelList(
            data=[
                ModelCard(
                    id=state.model_name,
                    root=state.engine_config.model or state.model_name,
                    max_model_len=info.max_model_len if info else None,
                )
            ]
        )

    @app.post("/tokenize", dependencies=deps)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        tok = state.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            text = _chat_prompt(state, body.messages, body.add_generation_prompt, False, None)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        info = state.engine.info
        return {
            "count": len(ids),
            "max_model_len": info.max_model_len if info else None,
            "tokens": ids,
        }

    @app.post("/detokenize", dependencies=deps)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        _check_model(state, body.model)
        info = state.engine.info
        vocab = info.vocab_size if info else 0
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=deps)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions", dependencies=deps)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(state, body, request)

    return app


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def bearer_matches(authorization: str | None, key_digest: bytes) -> bool:
    """Whether an Authorization header carries the key whose SHA-256 is `key_digest`.

    The comparison takes the same time whatever the token (vLLM's way): both sides are hashed
    to 32 bytes, so neither the key's content nor its length leaks through response times, and
    hmac.compare_digest does not stop at the first differing byte. Starlette decodes headers as
    latin-1, so encoding back to latin-1 recovers the bytes the client sent.
    """
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(" ")
    presented = _digest(token.encode("latin-1"))
    return hmac.compare_digest(presented, key_digest) and scheme.lower() == "bearer"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = str(first.get("msg", "invalid request"))
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif param:
            message = f"{param}: {message}"
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail) if e.status_code != 404 else f"no route {request.url.path}"
        return error_response(e.status_code, message)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal server error ({type(e).__name__})")


# ---- shared request plumbing --------------------------------------------------------------------
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def _admit(state: ServerState) -> None:
    limit = state.config.max_waiting_requests
    if limit is not None and state.engine.num_waiting >= limit:
        raise APIError(
            429,
            f"too many requests waiting ({state.engine.num_waiting} >= --max-waiting-requests "
            f"{limit}); retry later",
            headers={"Retry-After": "1"},
        )


def _chat_prompt(
    state: ServerState,
    messages: list[Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
) -> str:
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return apply_chat_template(
            state.engine.tokenizer, conversation, chat_template, add_generation_prompt,
            continue_final_message,
        )  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), "messages") from e
    except Exception as e:  # a broken template given by the client
        raise APIError(400, f"the chat template failed: {e}", "chat_template") from e


async def _add_all(
    state: ServerState,
    prefix: str,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    body: Any,
) -> list[RequestStream]:
    """Send every prompt to the engine; a refusal aborts the ones already accepted."""
    _admit(state)
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
            streams.append(
                await state.engine.add(rid, text, ids, params, body.priority, body.cache_salt)
            )
    except BaseException as e:
        for s in streams:
            state.engine.release(s)
        if isinstance(e, ValueError):
            raise _bad_field(e) from e
        if isinstance(e, EngineDeadError):
            raise APIError(503, f"the engine is not running: {e}") from e
        raise
    return streams


async def _merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None, False))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e, True))
            return
        await queue.put((i, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, work: Callable[[], Any]) -> Any:
    """Run `work()`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.create_task(work())

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    return task.result()


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def _stream_error(rid: str, e: Exception) -> str:
    """Log an error raised once a stream's headers are sent (the client only sees it as an SSE
    event), then the event. A dead engine is logged without a traceback: its cause is logged
    where the engine died."""
    traceback = None if isinstance(e, EngineDeadError) else e
    logger.error("request %s: error in the stream: %r", rid, e, exc_info=traceback)
    return _error_event(e)


def _error_event(e: Exception) -> str:
    status = 503 if isinstance(e, EngineDeadError) else 500
    message = str(e) if isinstance(e, EngineDeadError) else f"internal error ({type(e).__name__})"
    body = ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES[status], code=status))
    return _sse(body)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The top-`top` alternatives of one position by rank (the sampled token included if it is
    among them)."""
    ranked = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top),
        key=lambda kv: kv[1].rank or 0,
    )
    return ranked[:top]


def _token_text(tokenizer: Any, tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])


# ---- /v1/completions ----------------------------------------------------------------------------
async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    _check_model(state, body.model)
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must be unset or equal to n", "best_of")
    prompts = _completion_prompts(state, body.prompt)
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs)
    except ValueError as e:
        raise _bad_field(e) from e
    rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, rid, prompts, params, body)
    n = params.n
    if body.stream:
        gen = _completion_stream(state, body, rid, streams, prompts, n)
        return StreamingResponse(gen, media_type="text/event-stream")

    async def work() -> Response:
        outs = await _collect(state, streams)
        return JSONResponse(_completion_response(state, body, rid, outs, prompts, n).model_dump())

    return await _until_disconnect(request, work)


def _completion_prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    out: list[tuple[str | None, list[int]]] = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt must not be empty", "prompt")
            out.append((p, tok.encode(p)))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            out.append((None, list(p)))
        else:
            raise APIError(
                400, "prompt must be a string, a list of strings or of token ids", "prompt"
            )
    return out


async def _collect(state: ServerState, streams: list[RequestStream]) -> list[RequestOutput]:
    outs: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in _merge([state.engine.outputs(s, delta=False) for s in streams]):
            outs[i] = out
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not running: {e}") from e
    return [o for o in outs if o is not None]


def _completion_logprobs(
    state: ServerState, c: CompletionOutput, top: int, offset: int
) -> CompletionLogprobs | None:
    if c.logprobs is None:
        return None
    tok = state.engine.tokenizer
    result = CompletionLogprobs()
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry[tid]
        text = _token_text(tok, tid, lp)
        result.tokens.append(text)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append(
            {_token_text(tok, t, alt): alt.logprob for t, alt in _ranked(entry, top)}
            if top
            else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _completion_response(
    state: ServerState,
    body: CompletionRequest,
    rid: str,
    outs: list[RequestOutput],
    prompts: list[tuple[str | None, list[int]]],
    n: int,
) -> CompletionResponse:
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outs):
        prefix = (prompts[i][0] or "") if body.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append(
                CompletionChoice(
                    index=i * n + c.index,
                    text=prefix + c.text,
                    logprobs=_completion_logprobs(state, c, body.logprobs or 0, len(prefix)),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    return CompletionResponse(
        id=rid,
        model=state.model_name,
        choices=choices,
        usage=_usage(prompt_tokens, completion_tokens, cached),
    )


async def _completion_stream(
    state: ServerState,
    body: CompletionRequest,
    rid: str,
    streams: list[RequestStream],
    prompts: list[tuple[str | None, list[int]]],
    n: int,
) -> AsyncIterator[str]:
    completion_tokens = 0
    cached = [0] * len(streams)
    offsets = [0] * (len(streams) * n)
    echoed: set[int] = set()
    done: set[int] = set()  # choices whose finish_reason was sent: nothing follows it
    try:
        async for i, out in _merge([state.engine.outputs(s, delta=True) for s in streams]):
            cached[i] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                if index in done or not (c.text or c.token_ids or c.finish_reason):
                    continue
                if c.finish_reason is not None:
                    done.add(index)
                text = c.text
                if body.echo and index not in echoed:
                    echoed.add(index)
                    text = (prompts[i][0] or "") + text
                completion_tokens += len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=_completion_logprobs(state, c, body.logprobs or 0, offsets[index]),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
                offsets[index] += len(text)
            if choices:
                chunk = CompletionResponse(id=rid, model=state.model_name, choices=choices)
                yield _sse(chunk)
        if body.include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            usage = _usage(prompt_tokens, completion_tokens, sum(cached))
            yield _sse(CompletionResponse(id=rid, model=state.model_name, choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001 - reported in the stream, headers are gone
        yield _stream_error(rid, e)
    yield "data: [DONE]\n\n"


# ---- /v1/chat/completions -----------------------------------------------------------------------
async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    _check_model(state, body.model)
    if body.tools:
        raise APIError(400, "tools are not supported by this server", "tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    text = _chat_prompt(
        state, body.messages, body.add_generation_prompt, body.continue_final_message,
        body.chat_template,
    )  # fmt: skip
    ids = state.engine.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        params = body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise _bad_field(e) from e
    rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, rid, [(text, ids)], params, body)
    if body.stream:
        return StreamingResponse(
            _chat_stream(state, body, rid, streams[0], len(ids)), media_type="text/event-stream"
        )

    async def work() -> Response:
        out = (await _collect(state, streams))[0]
        choices = [
            ChatChoice(
                index=c.index,
                message=ResponseMessage(content=c.text),
                logprobs=_chat_logprobs(state, c, body.top_logprobs or 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        response = ChatCompletionResponse(
            id=rid,
            model=state.model_name,
            choices=choices,
            usage=_usage(len(ids), completion_tokens, out.num_cached_tokens),
        )
        return JSONResponse(response.model_dump())

    return await _until_disconnect(request, work)


def _chat_logprobs(state: ServerState, c: CompletionOutput, top: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    tok = state.engine.tokenizer
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        lp = entry[tid]
        text = _token_text(tok, tid, lp)
        alts = [
            TopLogprob(
                token=(t := _token_text(tok, a, alt)), logprob=alt.logprob, bytes=list(t.encode())
            )
            for a, alt in _ranked(entry, top)
        ]
        content.append(
            TokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=alts
            )
        )
    return ChatLogprobs(content=content)


async def _chat_stream(
    state: ServerState,
    body: ChatCompletionRequest,
    rid: str,
    stream: RequestStream,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    model = state.model_name
    n = stream.state.params.n
    first = [
        ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)
    ]
    yield _sse(ChatCompletionChunk(id=rid, model=model, choices=first))
    completion_tokens = 0
    cached = 0
    done: set[int] = set()  # choices whose finish_reason was sent: nothing follows it
    try:
        async for out in state.engine.outputs(stream, delta=True):
            cached = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                if c.index in done or not (c.text or c.token_ids or c.finish_reason):
                    continue
                if c.finish_reason is not None:
                    done.add(c.index)
                completion_tokens += len(c.token_ids)
                choices.append(
                    ChatChunkChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text),
                        logprobs=_chat_logprobs(state, c, body.top_logprobs or 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            if choices:
                yield _sse(ChatCompletionChunk(id=rid, model=model, choices=choices))
        if body.include_usage:
            usage = _usage(prompt_tokens, completion_tokens, cached)
            yield _sse(ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage))
    except Exception as e:  # noqa: BLE001 - reported in the stream, headers are gone
        yield _stream_error(rid, e)
    yield "data: [DONE]\n\n"


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


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGTERM (drain, exit 0), SIGINT, or the engine's death (exit 1)."""
    state = ServerState(engine_config, config)
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
