"""GET /v1/requests/{id}/explain on a real server: a finished request's timeline per sample
(scheduling/explain.py), 404 in OpenAI's shape for an id not kept, the last
--max-explained-requests kept, guarded by --api-key like the other /v1 routes (and the live
feed, GET /v1/engine/events, on the same keyed server)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from tests.server.conftest import SMALL_POOL, ServerProcess


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def test_a_finished_chat_explains_each_sample(tiny_server: ServerProcess) -> None:
    body = {
        "model": _model(tiny_server),
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        "n": 2,
        "ignore_eos": True,
    }
    r = tiny_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    explained = tiny_server.get(f"/v1/requests/{rid}/explain")
    assert explained.status_code == 200, explained.text
    e = explained.json()
    assert e["id"] == rid and e["object"] == "request.explanation"
    assert len(e["samples"]) == 2
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    for t in e["samples"]:
        events = [x["event"] for x in t["timeline"]]
        assert events[0] == "arrived" and events[-1] == "finished", events
        assert t["finish_reason"] == "length" and t["num_preemptions"] == 0
        assert t["timeline"][0]["num_prompt_tokens"] == prompt_tokens
        # the first token comes with the prompt's step (the leader's), then one a decode step
        assert t["num_decode_steps"] == 4
        assert 0 < t["share_of_steps"] <= 1
    leader = next(t for t in e["samples"] if t["num_prefill_chunks"] > 0)
    cached = leader["num_cached_prompt_tokens"]  # the session's earlier requests share a prefix
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    assert cached == details.get("cached_tokens", 0)
    prefilled = sum(x["num_tokens"] for x in leader["timeline"] if x["event"] == "prefill")
    assert cached + prefilled == prompt_tokens


def test_unknown_ids_are_404_and_only_the_last_n_are_kept(
    start_server: Callable[..., ServerProcess], tiny_llama_dir: str
) -> None:
    server = start_server(
        tiny_llama_dir, *SMALL_POOL, "--max-explained-requests", "1", api_key="sk-explain"
    )
    ids = []
    for _ in range(2):
        body = {"model": _model(server), "prompt": "abc", "max_tokens": 2}
        r = server.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    assert server.get(f"/v1/requests/{ids[1]}/explain").status_code == 200
    gone = server.get(f"/v1/requests/{ids[0]}/explain")
    assert gone.status_code == 404
    err = gone.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "request_id" and err["code"] == 404
    assert "--max-explained-requests" in err["message"]
    assert server.get("/v1/requests/nope/explain").status_code == 404
    no_key = server.get(f"/v1/requests/{ids[1]}/explain", headers={"Authorization": ""})
    assert no_key.status_code == 401
    # the live feed too
    assert httpx.get(server.url + "/v1/engine/events", timeout=10).status_code == 401
    with httpx.stream(
        "GET", server.url + "/v1/engine/events", headers=server.headers, timeout=30
    ) as feed:
        assert feed.status_code == 200
        first = next(line for line in feed.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["engine"]["block_state"]
