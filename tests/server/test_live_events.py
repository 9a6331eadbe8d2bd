"""GET /v1/engine/events on a real server: server-sent events of the engine's block pool and
queues while a client reads them, with the /metrics numbers (latency percentiles, token
totals); a request in flight shows as running with its blocks held; a client's ?interval_s=
spaces its events (0.2 s to 60 s, else a 400). (--api-key guarding it: test_explain_api.py, on
its keyed server.)"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tests.server.conftest import ServerProcess


def _events(
    server: ServerProcess, until: Any, limit: int = 200, query: str = "", on_first: Any = None
) -> list[dict[str, Any]]:
    """Events read until `until(event)` holds (or `limit` events); `on_first()` is called once
    the first event has arrived."""
    seen: list[dict[str, Any]] = []
    url = server.url + "/v1/engine/events" + query
    with httpx.stream("GET", url, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            seen.append(json.loads(line[len("data: ") :]))
            if len(seen) == 1 and on_first is not None:
                on_first()
            elif until(seen[-1]) or len(seen) >= limit:
                break
    return seen


def test_the_feed_shows_a_request_running_on_its_blocks(tiny_server: ServerProcess) -> None:
    model = tiny_server.get("/v1/models").json()["data"][0]["id"]
    first = _events(tiny_server, lambda e: True)[0]  # idle: snapshots still come
    engine = first["engine"]
    n = len(engine["block_state"])
    assert n == len(engine["block_ref_cnt"]) == len(engine["block_owner"]) > 0
    assert set(first["metrics"]) >= {"ttft", "itl", "e2e", "generation_tokens_total"}
    assert set(first["metrics"]["ttft"]) == {"p50", "p90", "p99"}

    body = {"model": model, "prompt": "hello " * 20, "max_tokens": 800, "ignore_eos": True}
    done = threading.Event()

    def send() -> None:
        tiny_server.post("/v1/completions", body)
        done.set()

    def running(e: dict[str, Any]) -> bool:
        return any(r["queue"] == "running" for r in e["engine"]["requests"])

    # The request is sent once the feed is open (its first event read), so the snapshots are
    # being built all the while it runs, however long the feed took to connect.
    sender = threading.Thread(target=send, daemon=True)
    seen = _events(tiny_server, running, on_first=sender.start)
    assert running(seen[-1]), "no event showed the request running"
    engine = seen[-1]["engine"]
    (req,) = [r for r in engine["requests"] if r["queue"] == "running"]
    assert 0 < req["num_computed_tokens"] <= req["num_tokens"]
    owned = [i for i, o in enumerate(engine["block_owner"]) if o == 0]
    assert owned and all(engine["block_state"][i] == 2 for i in owned)
    assert all(engine["block_ref_cnt"][i] >= 1 for i in owned)
    assert engine["num_scheduled_tokens"] <= engine["max_num_batched_tokens"]
    assert done.wait(120)
    after = _events(tiny_server, lambda e: not e["engine"]["requests"])
    assert after[-1]["metrics"]["generation_tokens_total"] >= 800
    assert after[-1]["metrics"]["ttft"]["p50"] is not None


def test_a_client_s_interval_spaces_its_events(tiny_server: ServerProcess) -> None:
    # the engine snapshots every 0.2 s while watched; a 1 s client gets one of them a second
    seen = _events(tiny_server, lambda e: False, limit=3, query="?interval_s=1")
    times = [e["engine"]["time"] for e in seen]
    assert all(b - a > 0.5 for a, b in zip(times, times[1:])), times
    for bad in ("0.1", "61", "fast"):
        r = tiny_server.get(f"/v1/engine/events?interval_s={bad}")
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert error["param"] == "interval_s" and error["type"] == "BadRequestError"
