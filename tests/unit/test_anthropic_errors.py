"""Anthropic's error shape on the Messages paths (server/anthropic_errors.py), on a bare FastAPI
app with the server's handlers: each status maps to Anthropic's error type, Retry-After stays,
the field leads the message, and every other path keeps OpenAI's shape. Also the x-api-key
check's constant-time comparison (server/auth.py)."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagoda.server import auth
from pagoda.server.anthropic_errors import install_anthropic_error_handlers, on_messages_path
from pagoda.server.errors import APIError, install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_anthropic_error_handlers(app)

    for prefix in ("/v1/messages", "/v1/chat"):

        @app.get(prefix + "/fail/{status}")
        async def fail(status: int) -> None:
            headers = {"Retry-After": "1"} if status == 429 else None
            raise APIError(status, "went wrong", "field" if status == 400 else None, headers)

        @app.get(prefix + "/crash")
        async def crash() -> None:
            raise RuntimeError("boom")

    return app


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_statuses_map_to_anthropic_types(status: int, kind: str) -> None:
    client = TestClient(_app())
    r = client.get(f"/v1/messages/fail/{status}")
    assert r.status_code == status
    message = "field: went wrong" if status == 400 else "went wrong"
    assert r.json() == {"type": "error", "error": {"type": kind, "message": message}}
    assert r.headers.get("retry-after") == ("1" if status == 429 else None)
    other = client.get(f"/v1/chat/fail/{status}")
    assert other.status_code == status and other.json()["error"]["message"] == "went wrong"


def test_internal_errors_and_unknown_routes() -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.get("/v1/messages/crash")
    assert r.status_code == 500
    assert r.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal server error (RuntimeError)"},
    }
    assert client.get("/v1/chat/crash").json()["error"]["type"] == "InternalServerError"
    r = client.get("/v1/messages/nope/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_messages_paths() -> None:
    assert on_messages_path("/v1/messages") and on_messages_path("/v1/messages/count_tokens")
    assert not on_messages_path("/v1/messagesx") and not on_messages_path("/v1/chat/completions")


def test_x_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    digest = hashlib.sha256(b"sekret").digest()
    assert auth.header_key_matches("sekret", digest)
    assert not auth.header_key_matches("sekre", digest)
    assert not auth.header_key_matches("Bearer sekret", digest)
    assert not auth.header_key_matches(None, digest)
    assert len(calls) == 3
    assert all(len(a) == len(b) == 32 for a, b in calls)
