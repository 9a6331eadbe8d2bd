"""GET /ui: the browser view of a pagoda server (static files in server/static, no build step,
nothing fetched from outside): a streaming chat and completion playground (embeddings on a
--runner pooling server), the KV block pool and the queues live, and plots of the /metrics
numbers, all fed by the server's own API (/v1/models, /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/engine/events, /v1/requests/{id}/explain). The files are open like
/health; the API calls behind them carry the key the page is given (--api-key)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from pagoda.server.errors import APIError

# file name -> media type; nothing else under /ui is served
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "plots.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def read_asset(name: str) -> bytes:
    if name not in ASSETS:
        raise APIError(404, f"no file {name!r} under /ui", "path")
    return resources.files("pagoda.server").joinpath("static", name).read_bytes()


def add_ui_routes(app: FastAPI) -> None:
    @app.get("/ui", include_in_schema=False)
    async def ui_page() -> Response:
        return _asset("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_asset(name: str) -> Response:
        return _asset(name)


def _asset(name: str) -> Response:
    # no-cache: a browser revalidates, so a restarted server's page is never stale
    return Response(
        read_asset(name), media_type=ASSETS[name], headers={"cache-control": "no-cache"}
    )
