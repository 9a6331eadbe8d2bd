"""pagoda on Ray Serve: N engine replicas behind one OpenAI-compatible route.

    PagodaIngress   Ray's HTTP entry (a light replica, no engine). It reads the request, keys it
                    by its prompt's prefix (forwarding.routing_key) and streams it to an engine
                    replica through a DeploymentHandle; Ray's request router for the engine
                    deployment (ray_router.PrefixAwareRouter) picks the replica, or takes the
                    one the x-pagoda-replica header names. It answers GET /v1/replicas itself
                    (the replicas' ids), so the browser view (/ui) shows each replica's engine.
    PagodaEngine    one replica: pagoda's own FastAPI app (server/app.py) over its own engine
                    process, so endpoints, errors and streams are those of `pagoda serve`. It
                    reports its SLO window to Ray's autoscaler (autoscaling.py) and its engine's
                    death to Ray's health check, which replaces the replica.

A replica that dies under a request: if nothing was sent to the client yet, the request is
retried once on another replica; otherwise a stream ends with an error event in OpenAI's shape
(then [DONE]) and a plain response with a 503. None hangs.

Run it with `pagoda serve --ray ...`, or `serve run deploy/ray-serve.yaml` (app_builder).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.deployment import Deployment
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pagoda.config import EngineConfig
from pagoda.scaleout.autoscaling import SLOPolicyConfig, SLOWindow
from pagoda.scaleout.forwarding import (
    REPLICA_HEADER,
    ASGIApp,
    ForwardedRequest,
    Message,
    ResponseStart,
    lifespan,
    pinned_replica,
    routing_key,
    run_asgi,
)
from pagoda.server.auth import bearer_matches, key_digest
from pagoda.server.state import ServerConfig

logger = logging.getLogger("pagoda.ray_serve")

ROUTERS = {
    "prefix": "pagoda.scaleout.ray_router:PrefixAwareRouter",
    "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}
# A replica whose actor died or cannot be reached: the request may go to another one.
REPLICA_GONE = (RayActorError, ActorUnavailableError)


@dataclass(frozen=True)
class RayServeOptions:
    """The deployment's shape. Autoscaling on the SLO when max_replicas > min_replicas;
    otherwise min_replicas fixed replicas."""

    min_replicas: int = 2
    max_replicas: int = 2
    router: str = "prefix"
    max_imbalance: int = 4
    prefix_tokens: int = 64
    max_ongoing_requests: int = 256
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0  # 1 on GPU nodes: Ray places one replica per GPU
    slo: SLOPolicyConfig = field(default_factory=SLOPolicyConfig)
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas} and "
                f"{self.max_replicas}"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {self.router!r}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas


# ---- the engine replica -----------------------------------------------------------------------
class PagodaEngine:
    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, engine_config: EngineConfig, server_config: ServerConfig, slo: SLOPolicyConfig
    ) -> None:
        # Imported in the replica: the server's modules are not needed by the ingress.
        from pagoda.server.app import build_app
        from pagoda.server.state import ServerState

        began = time.monotonic()
        self.name = serve.get_replica_context().replica_id.unique_id.encode()
        self.state = ServerState(engine_config, server_config)
        self.window = SLOWindow(slo)
        self.state.metrics.finished_listeners.append(self._observe)
        self.app: ASGIApp = build_app(self.state)  # type: ignore[assignment]
        self._shutdown = await lifespan(self.app)
        while not self.state.engine.ready:
            if self.state.engine.dead_reason is not None:
                raise RuntimeError(f"the engine failed to start: {self.state.engine.dead_reason}")
            await asyncio.sleep(0.02)
        self.start_seconds = time.monotonic() - began
        logger.info("replica ready in %.2f s", self.start_seconds)

    def _observe(self, state: Any) -> None:
        m = state.metrics
        if m.first_token_time is None:
            return
        # With n > 1 the samples decode side by side: time per token of the longest one.
        tokens = max((len(s.token_ids) for s in state.samples), default=0)
        tpot = None
        if tokens > 1 and m.last_token_time is not None:
            tpot = (m.last_token_time - m.first_token_time) / (tokens - 1)
        self.window.record(m.first_token_time - m.arrival_time, tpot)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in run_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER, self.name)])
            yield item

    def info(self) -> dict[str, float]:
        return {"start_seconds": self.start_seconds}

    def check_health(self) -> None:
        """Ray's health check: a dead engine fails it and Ray replaces the replica."""
        reason = self.state.engine.dead_reason
        if reason is not None:
            raise RuntimeError(f"the engine is not running: {reason}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.window.report(queue_depth=self.state.engine.num_waiting)

    async def __del__(self) -> None:
        shutdown = getattr(self, "_shutdown", None)
        if shutdown is not None:
            await shutdown()


# ---- the ingress ------------------------------------------------------------------------------
class PagodaIngress:
    def __init__(
        self, engine: DeploymentHandle, prefix_tokens: int, api_key: str | None = None
    ) -> None:
        self.engine = engine.options(method_name="forward", stream=True)
        self.prefix_tokens = prefix_tokens
        self.key_digest = None if api_key is None else key_digest(api_key.encode())

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # A plain coroutine function: uvicorn takes a bound method for an ASGI2 app.
        async def app(
            scope: Message,
            receive: Callable[[], Awaitable[Message]],
            send: Callable[[Message], Awaitable[None]],
        ) -> None:
            await self.asgi(scope, receive, send)

        return app

    async def asgi(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        # Under a route prefix, the replica's app sees the path below it.
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        headers = list(scope.get("headers", []))
        if path == "/v1/replicas" and scope["method"] == "GET":
            await self._list_replicas(headers, send)
            return
        request = ForwardedRequest(
            method=scope["method"],
            path=path,
            query_string=scope.get("query_string", b""),
            headers=headers,
            body=bytes(body),
            prefix_key=routing_key(path, bytes(body), self.prefix_tokens),
            replica=pinned_replica(headers),
        )
        await self._forward(request, send)

    async def _list_replicas(
        self, headers: list[tuple[bytes, bytes]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        """GET /v1/replicas: the engine replicas' ids (what x-pagoda-replica names), guarded
        by the API key like the replicas' /v1 routes."""
        if self.key_digest is not None:
            authorization = dict(headers).get(b"authorization")
            presented = None if authorization is None else authorization.decode("latin-1")
            if not bearer_matches(presented, self.key_digest):
                message = "invalid or missing API key: send 'Authorization: Bearer <key>'"
                await _send_error(send, 401, message)
                return
        ids = await asyncio.to_thread(engine_replica_ids, serve.get_replica_context().app_name)
        await _send_json(send, 200, {"object": "list", "replicas": ids})

    async def _forward(
        self, request: ForwardedRequest, send: Callable[[Message], Awaitable[None]]
    ) -> None:
        """Send the response of an engine replica; retry once on another while nothing was
        sent (see the module's text)."""
        for attempt in (1, 2):
            start: ResponseStart | None = None
            sent = False
            try:
                replies = cast(DeploymentResponseGenerator, self.engine.remote(request))
                async for item in replies:
                    if isinstance(item, ResponseStart):
                        start = item
                        continue
                    if not sent:
                        await _send_start(send, start)
                        sent = True
                    await send({"type": "http.response.body", "body": item, "more_body": True})
                if not sent:
                    await _send_start(send, start)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            except REPLICA_GONE as e:
                logger.warning("replica lost under a request (attempt %d): %s", attempt, e)
                if sent:
                    await _send_lost_midway(send, start)
                    return
            except Exception:  # a bug in a replica: an answer in OpenAI's shape, not Ray's
                logger.exception("the engine replica failed a request")
                if sent:
                    await _send_lost_midway(send, start)
                else:
                    await _send_error(send, 500, "the engine replica failed this request")
                return
        await _send_error(send, 503, "the replica serving this request died; retry later")


def engine_replica_ids(app_name: str) -> list[str]:
    """The unique ids of the application's engine replicas, from the names Ray gives their
    actors (the replicas' full ids: SERVE_REPLICA::<app>#PagodaEngine#<unique id>)."""
    prefix = f"SERVE_REPLICA::{app_name}#PagodaEngine#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] if isinstance(a, dict) else a for a in actors]
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix))


async def _send_start(
    send: Callable[[Message], Awaitable[None]], start: ResponseStart | None
) -> None:
    if start is None:
        raise RuntimeError("the replica sent a body before its status")
    await send({"type": "http.response.start", "status": start.status, "headers": start.headers})


async def _send_error(
    send: Callable[[Message], Awaitable[None]], status: int, message: str
) -> None:
    from pagoda.server.errors import error_body

    await _send_json(send, status, error_body(status, message).model_dump())


async def _send_json(send: Callable[[Message], Awaitable[None]], status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_lost_midway(
    send: Callable[[Message], Awaitable[None]], start: ResponseStart | None
) -> None:
    """The replica died (or failed) after part of the response was sent: a stream gets OpenAI's
    error event and [DONE], as pagoda serve ends a stream whose engine died; any other body just
    ends."""
    from pagoda.server.errors import error_body

    tail = b""
    if start is not None and start.is_event_stream:
        error = error_body(503, "the replica serving this request died mid-stream")
        tail = f"data: {json.dumps(error.model_dump())}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": tail, "more_body": False})


# ---- the application --------------------------------------------------------------------------
def build_application(
    engine_config: EngineConfig, server_config: ServerConfig, options: RayServeOptions
) -> serve.Application:
    """The Ray Serve application: the ingress bound to the engine deployment."""
    engine = cast(Deployment, serve.deployment(PagodaEngine)).options(
        name="PagodaEngine",
        ray_actor_options={
            "num_cpus": options.replica_num_cpus,
            "num_gpus": options.replica_num_gpus,
        },
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.router],  # type: ignore[arg-type]
            request_router_kwargs=(
                {"max_imbalance": options.max_imbalance} if options.router == "prefix" else {}
            ),
        ),
        health_check_period_s=2.0,
        # A replica scaled away finishes its requests first, as SIGTERM drains pagoda serve.
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
        **_scaling(options),
    )
    ingress = cast(Deployment, serve.deployment(serve.ingress()(PagodaIngress))).options(
        name="PagodaIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    app: serve.Application = ingress.bind(
        engine.bind(engine_config, server_config, options.slo),
        options.prefix_tokens,
        server_config.api_key,
    )
    return app


def _scaling(options: RayServeOptions) -> dict[str, Any]:
    if not options.autoscaling:
        return {"num_replicas": options.min_replicas}
    config = AutoscalingConfig(
        min_replicas=options.min_replicas,
        initial_replicas=options.min_replicas,
        max_replicas=options.max_replicas,
        upscale_delay_s=options.upscale_delay_s,
        downscale_delay_s=options.downscale_delay_s,
        look_back_period_s=options.look_back_period_s,
        policy=AutoscalingPolicy(
            policy_function="pagoda.scaleout.autoscaling:SLOAutoscalingPolicy",
            policy_kwargs=asdict(options.slo),
        ),
    )
    return {"autoscaling_config": config}


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`serve run pagoda.scaleout.ray_serve:app_builder model=...` and the `import_path` of
    deploy/ray-serve.yaml: args are `model`, `engine` (LLM(...) keyword arguments), `server`
    (ServerConfig's fields), `slo` (SLOPolicyConfig's) and RayServeOptions' other fields."""
    args = dict(args)
    engine_config = EngineConfig.from_kwargs(args.pop("model", None), **args.pop("engine", {}))
    server_config = ServerConfig(**args.pop("server", {}))
    slo = SLOPolicyConfig(**args.pop("slo", {}))
    return build_application(engine_config, server_config, RayServeOptions(slo=slo, **args))


def run_on_ray(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    options: RayServeOptions,
    address: str | None = None,
) -> int:
    """`pagoda serve --ray`: deploy on the Ray cluster at `address` (None: RAY_ADDRESS, or a
    local one started here), serve on the server's host and port until SIGINT or SIGTERM, then
    delete the application (and stop a local cluster)."""
    import signal
    import threading

    import ray

    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        app = build_application(engine_config, server_config, options)
        serve.run(app, name="pagoda", route_prefix="/")
        logger.info(
            "pagoda on Ray Serve: %d-%d engine replicas on http://%s:%d",
            options.min_replicas,
            options.max_replicas,
            server_config.host,
            server_config.port,
        )
        stop.wait()
        serve.delete("pagoda")
    finally:
        ray.shutdown()
    return 0
