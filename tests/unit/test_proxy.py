"""`pagoda proxy`'s routing (server/proxy.py) against fake prefill and decode instances
(httpx.MockTransport): what each instance is asked, and what happens when one fails. The real
instances behind a real proxy: tests/server/test_disaggregated_serving.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pagoda.server.proxy import Proxy, ProxyConfig

PREFILL, DECODE = "http://prefill:1", "http://decode:2"
REMOTE = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 14579}


class Instances:
    """Fake instances: record every request; `prefill` answers as a kv_producer unless told
    to fail; the decode instance echoes the body it got; /tokenize counts `tokens`."""

    def __init__(self, prefill: Callable[[], httpx.Response] | None = None, tokens: int = 10):
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.prefill = prefill or (lambda: httpx.Response(200, json={"kv_transfer_params": REMOTE}))
        self.tokens = tokens
        self.decode_up = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        url = str(request.url)
        self.seen.append((url, body))
        if url.endswith("/tokenize"):
            return httpx.Response(200, json={"count": self.tokens})
        if url.startswith(PREFILL):
            return self.prefill()
        if not self.decode_up:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"echo": body})

    def asked(self, base: str) -> list[dict[str, Any]]:
        return [b for u, b in self.seen if u.startswith(base) and not u.endswith("/tokenize")]


def _route(instances: Instances, body: dict[str, Any], **config: Any) -> tuple[Proxy, Any]:
    proxy = Proxy(ProxyConfig([PREFILL], [DECODE], **config), httpx.MockTransport(instances))
    response = asyncio.run(proxy.route("/v1/completions", body, {}))
    return proxy, response


BODY = {"prompt": "hello", "max_tokens": 50, "n": 2, "best_of": 2, "stream_options": {}}


def test_prefill_then_decode_with_the_producers_params() -> None:
    instances = Instances()
    proxy, response = _route(instances, BODY)
    (prefill,) = instances.asked(PREFILL)
    assert prefill["max_tokens"] == 1 and prefill["n"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert "best_of" not in prefill and "stream_options" not in prefill
    (decode,) = instances.asked(DECODE)
    assert decode == {**BODY, "kv_transfer_params": REMOTE}  # the client's request, plus KV
    assert json.loads(response.body) == {"echo": decode}
    assert proxy.stats.prefilled == 1 and proxy.stats.computed_on_decode == 0


@pytest.mark.parametrize(
    "failure",
    [
        lambda: httpx.Response(503, json={}),
        lambda: (_ for _ in ()).throw(httpx.ConnectError("x")),
        lambda: httpx.Response(200, text="not json"),
    ],
    ids=["5xx", "unreachable", "not-json"],
)
def test_a_failing_prefill_is_tried_again_then_skipped(failure: Callable[[], Any]) -> None:
    instances = Instances(prefill=failure)
    proxy, response = _route(instances, BODY)
    assert len(instances.asked(PREFILL)) == 2  # one try, one retry
    (decode,) = instances.asked(DECODE)
    assert decode == BODY  # no kv_transfer_params: the decode instance computes the prompt
    assert response.status_code == 200
    assert proxy.stats.prefill_failures == 2 and proxy.stats.computed_on_decode == 1


def test_a_request_the_prefill_refuses_is_the_clients_answer() -> None:
    instances = Instances(prefill=lambda: httpx.Response(400, json={"error": {"code": 400}}))
    _, response = _route(instances, BODY)
    assert response.status_code == 400
    assert not instances.asked(DECODE)


def test_no_decode_instance_is_a_503_in_openais_shape() -> None:
    instances = Instances()
    instances.decode_up = False
    _, response = _route(instances, BODY)
    assert response.status_code == 503
    assert json.loads(response.body)["error"]["code"] == 503


@pytest.mark.parametrize("tokens,prefilled", [(10, False), (2000, True)])
def test_short_prompts_skip_the_prefill_instance(tokens: int, prefilled: bool) -> None:
    instances = Instances(tokens=tokens)
    proxy, _ = _route(instances, BODY, min_prefill_tokens=512)
    assert bool(instances.asked(PREFILL)) == prefilled
    assert proxy.stats.short_on_decode == (0 if prefilled else 1)


def test_bad_proxy_configs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ProxyConfig([], [DECODE])
    with pytest.raises(ValueError, match="http://"):
        ProxyConfig(["prefill:1"], [DECODE])
    with pytest.raises(ValueError, match="min-prefill-tokens"):
        ProxyConfig([PREFILL], [DECODE], min_prefill_tokens=-1)
