"""An HTTP request carried whole to a replica and run there against pagoda's own ASGI app, so a
replica answers every endpoint, error and stream exactly as `pagoda serve` does. Nothing here
imports ray: the Ray Serve app (ray_serve.py) moves these objects between its deployments.

    ForwardedRequest   what the ingress read from the client (method, path, headers, body) and
                       the routing key the request router reads (`prefix_key`)
    run_asgi           the replica's side: the app's response as a ResponseStart, then body
                       chunks; a cancelled consumer is a client that went away
    lifespan           the app's ASGI lifespan (its engine's start and shutdown), run by hand
                       because nothing else serves the app
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pagoda.scaleout.routing import prefix_key

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

# The paths whose JSON body carries a prompt to route by, and where the prompt is.
_PROMPT_FIELDS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix_key: bytes | None = None  # read by the request router (ray_router.py)
    replica: str | None = None  # the replica asked for (REPLICA_HEADER), read by the router


# A request with this header goes to that engine replica (its unique id, as every response of
# the Ray Serve app names it in the same header): the live view's feed and a request's
# explanation are each replica's own.
REPLICA_HEADER = b"x-pagoda-replica"


def pinned_replica(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == REPLICA_HEADER and value:
            return value.decode("latin-1")
    return None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def is_event_stream(self) -> bool:
        return any(
            k.lower() == b"content-type" and v.startswith(b"text/event-stream")
            for k, v in self.headers
        )


def routing_key(path: str, body: bytes, prefix_tokens: int = 64) -> bytes | None:
    """The prefix key of a completions or chat request's prompt (its first prompt when it has
    several); None for other paths and for bodies the replica will refuse anyway."""
    field = _PROMPT_FIELDS.get(path)
    if field is None:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    prompt = _prompt_text(payload.get(field))
    return None if prompt is None else prefix_key(prompt, prefix_tokens)


def _prompt_text(value: Any) -> str | list[int] | None:
    """A completions prompt (text, token ids, or a list of either: its first) or chat messages
    (their contents joined: the chat template adds the same text around every conversation)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(t, int) for t in value):
        return value
    if isinstance(value[0], (str, list)):
        return _prompt_text(value[0])
    parts = []
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    return "\n".join(parts) or None


def http_scope(request: ForwardedRequest) -> Message:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("ray-serve-ingress", 0),
        "server": ("pagoda-replica", 0),
        "state": {},
    }


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through `app`: a ResponseStart, then the body's chunks. Closing the
    iterator early (the client went away) tells the app so (http.disconnect), as uvicorn
    would, and the request is aborted in the engine."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client disconnected")
        await messages.put(message)

    async def call() -> None:
        try:
            await app(http_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(call())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            # The app sees http.disconnect and returns; a stuck one is cancelled.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()


async def lifespan(app: ASGIApp) -> Callable[[], Awaitable[None]]:
    """Run the app's lifespan startup; returns the coroutine function that shuts it down.
    A startup failure is raised here (RuntimeError with the app's message)."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope: Message = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}

    async def run() -> None:
        await app(scope, inbox.get, outbox.put)

    task = asyncio.create_task(run())
    reply = await outbox.get()
    if reply["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app failed to start: {reply.get('message', reply['type'])}")

    async def shutdown() -> None:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task

    return shutdown
