"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

400 for invalid input (never FastAPI's 422), 401, 404, 429 (admission control, with Retry-After),
500 and 503 (starting up, draining after SIGTERM, or the engine process is gone).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.client.tokenizer import PromptError
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
)

logger = logging.getLogger("pagoda.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields
)


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


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    info = ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status
    )
    return ErrorResponse(error=info)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = error_body(status, message, param)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def bad_field(e: ValueError) -> APIError:
    """A 400 for a SamplingParams / engine ValueError; `param` is the field its message names
    first (their messages start with the field's name)."""
    message = str(e)
    first = message.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    return APIError(400, message, first if first in _REQUEST_FIELDS else None)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_member(part: str) -> bool:
    """Whether a validation error's location part names the member of a union that pydantic
    tried (`str`, `list[...]`, a model's class name, a tag spelled as one), not a field."""
    return "[" in part or part in _TYPE_NAMES or part[:1].isupper()


def _field_path(error: Any) -> list[str]:
    """The field a validation error is about, as the parts of its location."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path"):  # where it came from, not its name
        loc = loc[1:]
    return [p for p in loc if not _union_member(p)]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(PromptError)
    async def bad_prompt(request: Request, e: PromptError) -> JSONResponse:
        return error_response(400, str(e), e.field)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        # of the errors in the first bad field (one per union member tried), the deepest
        path = _field_path(first)
        for other in errors[1:]:
            deeper = _field_path(other)
            if deeper[:1] == path[:1] and len(deeper) > len(path):
                first, path = other, deeper
        param = ".".join(path) or None
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
