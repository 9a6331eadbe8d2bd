"""The held-out clients' kind of fuzz, from the repo: request bodies drawn from the OpenAPI schema
the server publishes (/openapi.json, through hypothesis-jsonschema) and sent to every POST route
that takes a JSON body; no answer may be a 5xx, and the server must still answer afterwards.

Three servers with a 64-token context (so that any valid request is short): the tiny Llama
generating, the tiny Qwen3 with --runner pooling for /v1/embeddings, and the tiny Qwen3 under
the Qwen3-Reranker recipe (--hf-overrides) for /v1/score and /v1/rerank. The draws are
derandomized: the same bodies on every run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema

from tests.server.conftest import SMALL_POOL, ServerProcess

CONTEXT = ("--max-model-len", "64")
NEW_ENDPOINTS = {
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
}
RERANKER = (
    '{"architectures": ["Qwen3ForSequenceClassification"], '
    '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
)
FUZZED = {*NEW_ENDPOINTS, "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
SERVER_OF = {"/v1/embeddings": "pooling", "/v1/score": "scoring", "/v1/rerank": "scoring"}
EXAMPLES = 15


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Callable[[str], str]) -> Iterator[dict[str, ServerProcess]]:
    generate = ServerProcess(tiny_model_dir("llama"), (*SMALL_POOL, *CONTEXT))
    pooling = ServerProcess(tiny_model_dir("qwen3"), (*SMALL_POOL, *CONTEXT, "--runner", "pooling"))
    scoring = ServerProcess(
        tiny_model_dir("qwen3"), (*SMALL_POOL, *CONTEXT, "--hf-overrides", RERANKER)
    )
    started = {
        "generate": generate.wait_ready(),
        "pooling": pooling.wait_ready(),
        "scoring": scoring.wait_ready(),
    }
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def schema(servers: dict[str, ServerProcess]) -> dict[str, Any]:
    r = servers["generate"].get("/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def _json_body_routes(schema: dict[str, Any]) -> list[str]:
    routes = []
    for path, methods in schema["paths"].items():
        body = methods.get("post", {}).get("requestBody", {}).get("content", {})
        if "application/json" in body:
            routes.append(path)
    return sorted(routes)


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def _body_schema(schema: dict[str, Any], path: str, model: str) -> dict[str, Any]:
    """The route's body schema with its $refs' definitions beside it; `model` always the served
    one (another name is a 404 before any other field is read)."""
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ref = body.get("$ref", "")
    components = schema["components"]
    if ref.startswith("#/components/schemas/"):
        body = components["schemas"][ref.rsplit("/", 1)[1]]
    if "model" in body.get("properties", {}):
        body = {**body, "properties": {**body["properties"], "model": {"const": model}}}
    return {**body, "components": components}


def test_the_published_schema_covers_the_new_endpoints(schema: dict[str, Any]) -> None:
    assert NEW_ENDPOINTS <= set(_json_body_routes(schema))
    for path in ("/v1/responses/{response_id}",):
        assert {"get", "delete"} <= set(schema["paths"][path])


@pytest.mark.parametrize("path", sorted(FUZZED))
def test_no_body_drawn_from_the_schema_gets_a_5xx(
    servers: dict[str, ServerProcess], schema: dict[str, Any], path: str
) -> None:
    assert path in _json_body_routes(schema)
    server = servers[SERVER_OF.get(path, "generate")]
    strategy = from_schema(_body_schema(schema, path, _model(server)))
    answers: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def send(body: Any) -> None:
        r = server.post(path, body)
        answers[r.status_code] = answers.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{path} {body!r} -> {r.status_code} {r.text[:500]}"

    send()
    assert answers.get(200), f"{path}: no drawn body was valid ({answers})"
    assert sum(answers.values()) >= EXAMPLES
    assert server.get("/health").status_code == 200


def test_the_metrics_count_every_endpoint_s_requests(servers: dict[str, ServerProcess]) -> None:
    """A request on each new endpoint is a finished request and its prompt tokens in /metrics,
    as a chat completion is."""
    hi = [{"role": "user", "content": "Hi"}]
    two = {"max_tokens": 2, "ignore_eos": True}
    cases = [  # path, server, body, finish reason
        ("/v1/chat/completions", "generate", {"messages": hi, **two}, "length"),
        (
            "/v1/responses",
            "generate",
            {"input": "Hi", "max_output_tokens": 2, "ignore_eos": True},
            "length",
        ),
        ("/v1/messages", "generate", {"messages": hi, **two}, "length"),
        ("/v1/embeddings", "pooling", {"input": "Hi"}, "stop"),
    ]
    for path, kind, body, reason in cases:
        server = servers[kind]
        counters = (
            f'pagoda:request_success_total{{finished_reason="{reason}"',
            "pagoda:prompt_tokens_total",
        )
        before = [server.metric(c) for c in counters]
        r = server.post(path, {"model": _model(server), **body})
        assert r.status_code == 200, r.text
        after = [server.metric(c) for c in counters]
        assert after[0] - before[0] == 1, path
        assert after[1] - before[1] > 0, path
