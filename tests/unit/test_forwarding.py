"""The Ray Serve app's parts that need no cluster: the routing key of a request's body, a
forwarded request run through an ASGI app (plain, streamed, the client leaving), the app's
lifespan, and the ingress's answer when a replica dies (retried once while nothing was sent, an
error event mid-stream, a 503 after two losses) with a fake DeploymentHandle; the replica a
request asks for (x-pagoda-replica) reaches the router, and the ingress's own GET /v1/replicas
checks the API key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.exceptions import ActorDiedError

from pagoda.scaleout.forwarding import (
    ForwardedRequest,
    ResponseStart,
    lifespan,
    routing_key,
    run_asgi,
)
from pagoda.scaleout.ray_serve import PagodaIngress, RayServeOptions
from pagoda.scaleout.routing import prefix_key


def body(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def test_routing_key_of_completions_and_chat_bodies() -> None:
    text = "You are a helpful assistant. " * 20
    assert routing_key("/v1/completions", body({"prompt": text})) == prefix_key(text)
    assert routing_key("/v1/completions", body({"prompt": [text, "b"]})) == prefix_key(text)
    assert routing_key("/v1/completions", body({"prompt": [1, 2, 3]})) == prefix_key([1, 2, 3])
    assert routing_key("/v1/completions", body({"prompt": [[4, 5], [6]]})) == prefix_key([4, 5])
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    chat = routing_key("/v1/chat/completions", body({"messages": messages}))
    assert chat == prefix_key("sys\nhi")
    # Requests sharing their first 64 * 4 characters share a key; others do not.
    a = routing_key("/v1/completions", body({"prompt": text + "question one"}))
    b = routing_key("/v1/completions", body({"prompt": text + "another question"}))
    c = routing_key("/v1/completions", body({"prompt": "Other. " + text}))
    assert a == b != c
    # No key: other paths, bodies the replica will refuse, empty prompts.
    assert routing_key("/tokenize", body({"prompt": text})) is None
    assert routing_key("/v1/completions", b"{not json") is None
    assert routing_key("/v1/completions", body([1, 2])) is None
    assert routing_key("/v1/completions", body({"prompt": ""})) is None
    assert routing_key("/v1/chat/completions", body({"messages": []})) is None


def _app() -> tuple[FastAPI, dict[str, Any]]:
    seen: dict[str, Any] = {
        "started": False,
        "stopped": False,
        "disconnected": False,
        "stream_ended": asyncio.Event(),
    }

    async def life(app: FastAPI) -> AsyncIterator[None]:
        seen["started"] = True
        yield
        seen["stopped"] = True

    app = FastAPI(lifespan=life)  # type: ignore[arg-type]

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {"body": await request.json(), "query": request.url.query}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["disconnected"] = await request.is_disconnected()
                seen["stream_ended"].set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


def request(method: str, path: str, payload: bytes = b"", query: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest(method, path, query, [(b"content-type", b"application/json")], payload)


def test_run_asgi_answers_as_the_app_does() -> None:
    app, seen = _app()

    async def main() -> None:
        shutdown = await lifespan(app)  # type: ignore[arg-type]
        assert seen["started"]
        items = [x async for x in run_asgi(app, request("POST", "/echo", body({"a": 1}), b"x=2"))]  # type: ignore[arg-type]
        start = items[0]
        assert isinstance(start, ResponseStart) and start.status == 200
        assert not start.is_event_stream
        assert json.loads(b"".join(items[1:])) == {"body": {"a": 1}, "query": "x=2"}
        missing = [x async for x in run_asgi(app, request("GET", "/nope"))]  # type: ignore[arg-type]
        assert isinstance(missing[0], ResponseStart) and missing[0].status == 404
        # A consumer that stops early is a client that left: the app is told.
        stream = run_asgi(app, request("GET", "/stream"))  # type: ignore[arg-type]
        first = await anext(stream)
        assert isinstance(first, ResponseStart) and first.is_event_stream
        assert await anext(stream) == b"data: 0\n\n"
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.wait_for(seen["stream_ended"].wait(), 30)  # the app's stream ran its end
        assert seen["disconnected"]
        await shutdown()
        assert seen["stopped"]

    asyncio.run(main())


class FakeHandle:
    """A DeploymentHandle whose replicas answer from `script`: each call takes the next list of
    items; an exception in it is raised at that point, as a dead replica's is."""

    def __init__(self, script: list[list[Any]]) -> None:
        self.script = script
        self.calls = 0
        self.requests: list[ForwardedRequest] = []

    def options(self, **kwargs: Any) -> FakeHandle:
        return self

    def remote(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        items = self.script[self.calls]
        self.calls += 1
        self.requests.append(request)

        async def replies() -> AsyncIterator[Any]:
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return replies()


def _ingress_reply(
    script: list[list[Any]],
    headers: list[tuple[bytes, bytes]] | None = None,
    handle: FakeHandle | None = None,
    api_key: str | None = None,
    path: str = "/v1/completions",
) -> tuple[list[dict[str, Any]], int]:
    handle = handle or FakeHandle(script)
    ingress = PagodaIngress(handle, prefix_tokens=64, api_key=api_key)  # type: ignore[arg-type]
    app = ingress.__serve_build_asgi_app__()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body({"prompt": "hi"}), "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    method = "GET" if path == "/v1/replicas" else "POST"
    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    return sent, handle.calls


SSE = ResponseStart(200, [(b"content-type", b"text/event-stream")])
JSON = ResponseStart(200, [(b"content-type", b"application/json")])


def test_a_replica_lost_before_anything_was_sent_is_retried_once() -> None:
    sent, calls = _ingress_reply([[JSON, ActorDiedError()], [JSON, b'{"ok": true}']])
    assert calls == 2
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": JSON.headers}
    assert b"".join(m["body"] for m in sent[1:]) == b'{"ok": true}'
    assert sent[-1]["more_body"] is False


def test_two_lost_replicas_are_a_503_in_openai_s_shape() -> None:
    sent, calls = _ingress_reply([[ActorDiedError()], [JSON, ActorDiedError()]])
    assert calls == 2
    assert sent[0]["status"] == 503
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 503 and "died" in error["message"]


def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error_event() -> None:
    sent, calls = _ingress_reply([[SSE, b"data: 1\n\n", ActorDiedError()]])
    assert calls == 1  # part of the answer was sent: no retry
    assert sent[0]["status"] == 200
    text = b"".join(m["body"] for m in sent[1:]).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0] == "data: 1"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 503
    assert events[2] == "data: [DONE]"
    assert sent[-1]["more_body"] is False


def test_a_replica_s_own_failure_is_a_500_in_openai_s_shape_not_retried() -> None:
    sent, calls = _ingress_reply([[RuntimeError("a bug")]])
    assert calls == 1
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"]["code"] == 500


def test_bad_ray_serve_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        RayServeOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="min_replicas"):
        RayServeOptions(min_replicas=0, max_replicas=2)
    with pytest.raises(ValueError, match="router"):
        RayServeOptions(router="random")
    assert RayServeOptions(min_replicas=1, max_replicas=3).autoscaling
    assert not RayServeOptions(min_replicas=2, max_replicas=2).autoscaling


def test_the_replica_header_pins_a_request_for_the_router() -> None:
    handle = FakeHandle([[JSON, b"{}"], [JSON, b"{}"]])
    _ingress_reply([], [(b"X-Pagoda-Replica", b"abc123")], handle)
    _ingress_reply([], [], handle)
    assert [r.replica for r in handle.requests] == ["abc123", None]
    assert handle.requests[0].prefix_key == routing_key("/v1/completions", body({"prompt": "hi"}))


def test_the_replica_list_is_guarded_by_the_api_key() -> None:
    handle = FakeHandle([])
    sent, calls = _ingress_reply([], [], handle, api_key="sk-ray", path="/v1/replicas")
    assert sent[0]["status"] == 401 and calls == 0
    assert json.loads(sent[1]["body"])["error"]["code"] == 401
