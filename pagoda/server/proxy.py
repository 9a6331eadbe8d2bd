"""`pagoda proxy`: the router of prefill/decode disaggregation (vLLM's disaggregated-prefill
proxy, built in). It holds no model; it speaks OpenAI's API to clients and to the instances.

For each /v1/completions or /v1/chat/completions request:
1. a prefill instance (`pagoda serve --kv-transfer-config '{..."kv_role": "kv_producer"}'`, the
   --prefill URLs in turn) gets it with max_tokens 1, unstreamed, and kv_transfer_params
   {"do_remote_decode": true}; it computes the prompt (its blocks stay in its prefix cache) and
   answers with kv_transfer_params naming where to fetch them;
2. a decode instance (a kv_consumer, the --decode URLs in turn) gets the original request plus
   those kv_transfer_params: it fetches the prompt's blocks, computes the prompt's last token
   and decodes on; its answer, streamed or whole, is the client's.

With --min-prefill-tokens N, a prompt shorter than N tokens (counted by a decode instance's
/tokenize) skips the prefill instance: the decode instance computes it, as a colocated engine
would; short prompts cost little there, and they no longer queue behind long prefills.

A prefill instance that cannot be reached or answers 5xx is replaced by the next one, once; then
the request goes to the decode instance without kv_transfer_params and is computed there whole.
No request is lost and the client sees no difference but latency. A 4xx from the prefill
instance (the request itself is bad) is the client's answer.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagoda.server.errors import error_response

logger = logging.getLogger(__name__)

PREFILL_TRIES = 2
ROUTED = ("/v1/completions", "/v1/chat/completions")
# Fields a one-token prefill request must not keep from the client's request.
PREFILL_OVERRIDES: dict[str, Any] = {
    "max_tokens": 1,
    "max_completion_tokens": 1,
    "min_tokens": 0,
    "n": 1,
    "stream": False,
    "kv_transfer_params": {"do_remote_decode": True},
}


@dataclass
class ProxyConfig:
    prefill: list[str]  # base URLs, e.g. http://127.0.0.1:8100
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 600.0
    min_prefill_tokens: int = 0  # shorter prompts go straight to a decode instance

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise ValueError(f"--min-prefill-tokens must be >= 0, got {self.min_prefill_tokens}")
        if not self.prefill or not self.decode:
            raise ValueError("pagoda proxy needs at least one --prefill and one --decode URL")
        for url in [*self.prefill, *self.decode]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URLs start with http:// or https://, got {url!r}")
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]


@dataclass
class ProxyStats:
    requests: int = 0
    prefilled: int = 0  # prefill answered with kv_transfer_params
    prefill_failures: int = 0  # tries that failed (unreachable, 5xx)
    computed_on_decode: int = 0  # no prefill instance answered: the decode computed it all
    short_on_decode: int = 0  # under --min-prefill-tokens: sent to the decode instance
    decode_failures: int = 0
    by_instance: dict[str, int] = field(default_factory=dict)


class Proxy:
    def __init__(self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s, connect=5.0), transport=transport
        )
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)
        self.stats = ProxyStats()

    async def route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        self.stats.requests += 1
        if await self._is_short(path, body, headers):
            self.stats.short_on_decode += 1
            return await self._decode_request(path, body, headers)
        prefilled = await self._prefill_once(path, body, headers)
        if isinstance(prefilled, Response):
            return prefilled
        decode_body = dict(body)
        if prefilled is not None:
            decode_body["kv_transfer_params"] = prefilled
        else:
            self.stats.computed_on_decode += 1
        return await self._decode_request(path, decode_body, headers)

    async def _prefill_once(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The prefill's kv_transfer_params; a Response for a request the prefill refused
        (4xx); None when no prefill instance answered."""
        dropped = ("stream_options", "best_of")
        request = {k: v for k, v in body.items() if k not in dropped} | PREFILL_OVERRIDES
        for _ in range(PREFILL_TRIES):
            url = next(self._prefill)
            try:
                answer = await self.client.post(url + path, json=request, headers=headers)
            except httpx.HTTPError as e:
                self._prefill_failed(url, f"{type(e).__name__}: {e}")
                continue
            if answer.status_code >= 500:
                self._prefill_failed(url, f"HTTP {answer.status_code}")
                continue
            if answer.status_code != 200:
                return _relay(answer)
            try:
                params = answer.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                self._prefill_failed(url, "an answer that is not a JSON object")
                continue
            if not params:
                logger.warning("prefill %s is not a kv_producer (no kv_transfer_params)", url)
                return None
            self.stats.prefilled += 1
            self.stats.by_instance[url] = self.stats.by_instance.get(url, 0) + 1
            return dict(params)
        return None

    async def _is_short(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> bool:
        """Whether the prompt has fewer than min_prefill_tokens tokens (a decode instance's
        /tokenize counts them); False when that is off, the prompt is a batch, or counting
        fails (the request then takes the prefill route)."""
        if self.config.min_prefill_tokens == 0:
            return False
        prompt = body.get("prompt")
        if path.endswith("/chat/completions"):
            ask: dict[str, Any] = {"messages": body.get("messages")}
        elif isinstance(prompt, str):
            ask = {"prompt": prompt}
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt) < self.config.min_prefill_tokens
        else:
            return False
        try:
            answer = await self.client.post(
                self.config.decode[0] + "/tokenize", json=ask, headers=headers
            )
            count = int(answer.json()["count"]) if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            count = None
        return count is not None and count < self.config.min_prefill_tokens

    def _prefill_failed(self, url: str, why: str) -> None:
        self.stats.prefill_failures += 1
        logger.warning("prefill instance %s failed (%s)", url, why)

    async def _decode_request(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        last_error = ""
        for _ in range(len(self.config.decode)):
            url = next(self._decode)
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                answer = await self.client.send(request, stream=bool(body.get("stream")))
            except httpx.HTTPError as e:
                self.stats.decode_failures += 1
                last_error = f"{url}: {type(e).__name__}: {e}"
                logger.warning("decode instance %s failed (%s)", url, last_error)
                continue
            self.stats.by_instance[url] = self.stats.by_instance.get(url, 0) + 1
            if not body.get("stream"):
                return _relay(answer)
            return StreamingResponse(
                answer.aiter_raw(),
                status_code=answer.status_code,
                media_type=answer.headers.get("content-type"),
                background=BackgroundTask(answer.aclose),
            )
        return error_response(503, f"no decode instance answered ({last_error})")

    async def get(self, path: str, headers: dict[str, str]) -> Response:
        """GET passed to a decode instance (/v1/models)."""
        try:
            answer = await self.client.get(next(self._decode) + path, headers=headers)
        except httpx.HTTPError as e:
            return error_response(503, f"no decode instance answered ({e})")
        return _relay(answer)


def _relay(answer: httpx.Response) -> Response:
    return Response(
        answer.content,
        status_code=answer.status_code,
        media_type=answer.headers.get("content-type"),
    )


def _forwarded(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def build_proxy_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="pagoda proxy")

    async def routed(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        return await proxy.route(request.url.path, body, _forwarded(request))

    for path in ROUTED:
        app.add_api_route(path, routed, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.get("/v1/models", _forwarded(request))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/proxy/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(proxy.stats.__dict__)

    return app


def run_proxy(config: ProxyConfig) -> int:
    import uvicorn

    app = build_proxy_app(Proxy(config))
    logger.info(
        "pagoda proxy on http://%s:%d: prefill %s, decode %s",
        config.host,
        config.port,
        config.prefill,
        config.decode,
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    return 0
