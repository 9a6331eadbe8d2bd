"""What /v1/completions and /v1/chat/completions share: sending prompts to the engine, reading
their outputs (whole here, streamed in sse.py), usage and logprob ranking."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response

from pagoda.client.async_client import AsyncEngine, EngineDeadError, RequestStream
from pagoda.client.pooling import POOLING_SAMPLING
from pagoda.client.tokenizer import Prompt
from pagoda.outputs import Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server.errors import APIError, bad_field
from pagoda.server.protocol import PromptTokensDetails, SamplingFields, Usage
from pagoda.server.state import ServerState

T = TypeVar("T")


class RequestFields(Protocol):
    """What add_all reads of a request body (SamplingFields, EmbeddingRequest)."""

    @property
    def priority(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def grammar_field(self) -> str: ...


async def add_all(
    state: ServerState,
    prefix: str,
    prompts: list[Prompt],
    params: SamplingParams,
    body: RequestFields,
    pooling: bool = False,
) -> list[RequestStream]:
    """Send every prompt to the engine; a refusal aborts the ones already accepted. pooling:
    embedding requests (--runner pooling)."""
    state.admit()
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
            streams.append(
                await state.engine.add(
                    rid,
                    text,
                    ids,
                    params,
                    body.priority,
                    body.cache_salt,
                    body.kv_transfer_params,
                    pooling,
                    state.lora_of(getattr(body, "model", None)),
                )
            )
    except BaseException as e:
        for s in streams:
            state.engine.release(s)
        if isinstance(e, ValueError) and str(e).startswith("structured_outputs"):
            raise APIError(400, str(e), body.grammar_field) from e  # the grammar's check
        if isinstance(e, ValueError):
            raise bad_field(e) from e
        if isinstance(e, EngineDeadError):
            raise APIError(503, f"the engine is not running: {e}") from e
        raise
    return streams


async def add_pooling(
    state: ServerState, prefix: str, prompts: list[Prompt], body: RequestFields, field: str
) -> list[RequestStream]:
    """add_all for pooling requests (--runner pooling: embeddings, scores); a 400 from the
    engine's checks of the prompts names `field`, the request's input."""
    try:
        return await add_all(state, prefix, prompts, POOLING_SAMPLING, body, pooling=True)
    except APIError as e:
        if e.status == 400 and e.param in (None, "prompt"):
            e.param = field
        raise


async def collect_pooled(engine: AsyncEngine, streams: list[RequestStream]) -> list[bytes]:
    """The engine's vector (or label logits) of every pooling stream, once all have finished."""
    await collect(engine, streams)
    pooled = [s.state.pooled for s in streams]
    assert all(p is not None for p in pooled), "a pooling request finished without its output"
    return [p for p in pooled if p is not None]


async def collect(engine: AsyncEngine, streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream; APIError 500 if a sample ended in an error."""
    outs: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge([engine.outputs(s, delta=False) for s in streams]):
            outs[i] = out
    except EngineDeadError as e:
        raise APIError(503, f"the engine is not running: {e}") from e
    done = [o for o in outs if o is not None]
    for out in done:
        check_sample_errors(out)
    return done


class GenerationError(Exception):
    """A sample the engine could not finish (finish_reason "error"), as vLLM raises it."""


GENERATION_ERROR = (
    "the engine could not finish the output: its grammar (structured outputs or tool_choice) "
    "refused the token the model produced; see the server log"
)


def check_sample_errors(out: RequestOutput) -> None:
    """APIError 500 where a sample of `out` finished with "error"."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise APIError(500, GENERATION_ERROR)


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
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


async def until_disconnect(
    request: Request, work: Callable[[], Coroutine[Any, Any, Response]]
) -> Response:
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


def kv_transfer_response(state: ServerState, body: SamplingFields) -> dict[str, Any] | None:
    """A prefill instance's answer to a request that asks for remote decode (vLLM's
    kv_transfer_params with do_remote_decode): where a decode instance fetches its prompt's KV
    (kv_transfer_config.py). None otherwise."""
    kv = state.engine.config.kv_transfer_config
    asked = body.kv_transfer_params or {}
    if kv is None or not kv.is_producer or not asked.get("do_remote_decode"):
        return None
    return kv.remote_params()


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def ranked(entry: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The top-`top` alternatives of one position by rank (the sampled token included if it is
    among them)."""
    alternatives = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top),
        key=lambda kv: kv[1].rank or 0,
    )
    return alternatives[:top]


def token_text(engine: AsyncEngine, tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else engine.decode([tid])
