"""Errors on the Anthropic Messages routes (/v1/messages...) in Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.

The app's OpenAI handlers (errors.py) are wrapped, not copied: on a Messages path their answer is
reshaped, keeping its status (400, 401, 404, 429 with Retry-After, 500, 503) and naming the field
at the start of the message. Every other path keeps OpenAI's shape.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from pagoda.server.anthropic_protocol import AnthropicErrorInfo, AnthropicErrorResponse

MESSAGES_PATH = "/v1/messages"

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

Handler = Callable[[Request, Any], Response | Awaitable[Response]]


def on_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(status: int, message: str) -> AnthropicErrorResponse:
    info = AnthropicErrorInfo(type=ERROR_TYPES.get(status, "api_error"), message=message)
    return AnthropicErrorResponse(error=info)


def anthropic_error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = anthropic_error_body(status, message)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def install_anthropic_error_handlers(app: FastAPI) -> None:
    """Reshape the app's error handlers' answers on Messages paths; call it after
    install_error_handlers (errors.py), before the app serves."""
    for exc_class, handler in list(app.exception_handlers.items()):
        app.exception_handlers[exc_class] = _reshaping(handler)


def _reshaping(handler: Handler) -> Callable[[Request, Any], Awaitable[Response]]:
    async def reshaped(request: Request, e: Any) -> Response:
        if isinstance(e, RequestValidationError) and on_messages_path(request.url.path):
            return anthropic_error_response(400, validation_message(e))
        answer = handler(request, e)
        response = await answer if inspect.isawaitable(answer) else answer
        if not on_messages_path(request.url.path):
            return response
        error = json.loads(bytes(response.body))["error"]
        message, param = str(error["message"]), error.get("param")
        if param and not message.startswith(str(param)):
            message = f"{param}: {message}"
        retry = response.headers.get("retry-after")
        headers = {"Retry-After": retry} if retry is not None else None
        return anthropic_error_response(response.status_code, message, headers)

    return reshaped


def validation_message(e: RequestValidationError) -> str:
    """`<field path>: <what is wrong>` for the most specific of pydantic's errors: the branches
    of a union (`str`, `list[...]`) and a block's type tag are left out of the path."""
    errors = e.errors()
    if not errors:
        return "invalid request"
    if errors[0].get("type") == "json_invalid":
        return "the request body is not valid JSON"
    located = [(_field_path(err.get("loc", ())), str(err.get("msg", "invalid"))) for err in errors]
    head = located[0][0]
    path, message = max((p for p in located if p[0][: len(head)] == head), key=lambda p: len(p[0]))
    return f"{'.'.join(path)}: {message}" if path else message


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    out: list[str] = []
    after_index = False
    for part in loc:
        text = str(part)
        if out == [] and text in ("body", "query", "path"):
            continue
        branch = text == "str" or "[" in text
        tag = after_index and text in ("text", "tool_use", "tool_result")
        if not (branch or tag):
            out.append(text)
        after_index = isinstance(part, int)
    return out
