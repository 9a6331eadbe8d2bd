"""Disaggregated serving end to end: `pagoda serve` as a kv_producer (prefill), another as a
kv_consumer (decode), and `pagoda proxy` in front of them, all separate processes on this host.

- Completions and chat, whole and streamed, through the proxy equal one colocated engine's
  (greedy): the decode instance continued from the prompt blocks it fetched (its
  pagoda:kv_transfer_* metrics count them).
- A prefill instance killed while requests are in flight loses none of them: the proxy sends
  them to the decode instance without KV, which computes them whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pagoda import LLM, SamplingParams
from tests.server.conftest import SMALL_POOL, ServerProcess, free_port

# Longer than a few 16-token blocks: the full blocks are what a decode instance fetches.
PROMPTS = [
    "The history of the printing press begins with movable type in East Asia, long before "
    "Gutenberg built his press in Mainz around 1440, and it changed how",
    "A short list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\ndef factorial(n):\n    ",
]
MAX_TOKENS = 12


def _kv_flags(role: str, port: int) -> tuple[str, ...]:
    config = {"kv_connector": "PagodaConnector", "kv_role": role, "kv_port": port}
    return ("--kv-transfer-config", json.dumps(config))


class Proxy:
    def __init__(self, prefill: str, decode: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "pagoda.cli", "proxy", "--prefill", prefill]
        self.proc = subprocess.Popen([*cmd, "--decode", decode, "--port", port])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("pagoda proxy did not start")

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/proxy/stats", timeout=10).json())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str) -> Iterator[tuple[ServerProcess, ServerProcess, Proxy]]:
    prefill = ServerProcess(tiny_llama_dir, (*SMALL_POOL, *_kv_flags("kv_producer", free_port())))
    decode = ServerProcess(tiny_llama_dir, (*SMALL_POOL, *_kv_flags("kv_consumer", free_port())))
    prefill.wait_ready()
    decode.wait_ready()
    proxy = Proxy(prefill.url, decode.url)
    yield prefill, decode, proxy
    proxy.stop()
    for server in (prefill, decode):
        server.stop(timeout=10)


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir: str) -> LLM:
    """One colocated engine in this process."""
    return LLM(tiny_llama_dir, num_gpu_blocks_override=512)


@pytest.fixture(scope="module")
def colocated(oracle: LLM) -> Callable[[str], str]:
    """The oracle's greedy completion of a prompt."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return lambda prompt: oracle.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def _body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def _sample(server: ServerProcess, name: str, direction: str) -> float:
    """The value of series `name` with label direction="..." in the server's /metrics."""
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and f'direction="{direction}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {direction}")


def _streamed_text(response: httpx.Response) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_completions_through_the_proxy_equal_colocated(
    cluster: tuple[ServerProcess, ServerProcess, Proxy], colocated: Callable[[str], str]
) -> None:
    prefill, decode, proxy = cluster
    for prompt in PROMPTS:
        whole = proxy.post("/v1/completions", _body(prompt))
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["text"] == colocated(prompt)
        streamed = proxy.post("/v1/completions", _body(prompt, stream=True))
        assert _streamed_text(streamed) == colocated(prompt)
    blocks = "pagoda:kv_transfer_blocks_total"
    assert _sample(decode, blocks, "received") == _sample(prefill, blocks, "sent") > 0
    assert _sample(decode, "pagoda:kv_transfer_bytes_total", "received") > 0
    assert proxy.stats()["prefilled"] == 2 * len(PROMPTS)


@pytest.mark.slow  # completions take the same route in the default suite
def test_chat_through_the_proxy(
    cluster: tuple[ServerProcess, ServerProcess, Proxy], oracle: LLM
) -> None:
    _, _, proxy = cluster
    content = "Name three colours of the rainbow, then say which one is between the other two."
    messages = [{"role": "user", "content": content}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    got = proxy.post("/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    want = oracle.chat([messages], params, use_tqdm=False)[0].outputs[0].text
    assert got.json()["choices"][0]["message"]["content"] == want


def test_the_prefill_instance_answers_where_its_kv_is(
    cluster: tuple[ServerProcess, ServerProcess, Proxy],
) -> None:
    prefill, _, _ = cluster
    asked = prefill.post(
        "/v1/completions", _body(PROMPTS[0], kv_transfer_params={"do_remote_decode": True})
    )
    params = asked.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    plain = prefill.post("/v1/completions", _body(PROMPTS[0]))
    assert plain.json()["kv_transfer_params"] is None


def test_bad_kv_transfer_params_are_a_400(
    cluster: tuple[ServerProcess, ServerProcess, Proxy],
) -> None:
    _, decode, _ = cluster
    bad = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x"}
    answer = decode.post("/v1/completions", _body(PROMPTS[0], kv_transfer_params=bad))
    assert answer.status_code == 400
    assert "remote_port" in answer.json()["error"]["message"]


def test_a_killed_prefill_instance_loses_no_request(
    cluster: tuple[ServerProcess, ServerProcess, Proxy], colocated: Callable[[str], str]
) -> None:
    """Last in this module: it kills the prefill instance. Requests in flight and after it
    complete, computed on the decode instance, with the colocated outputs."""
    prefill, _, proxy = cluster
    prompts = [f"{p} (take {i})" for i in range(4) for p in PROMPTS]
    before = proxy.stats()["prefilled"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(proxy.post, "/v1/completions", _body(p)) for p in prompts]
        # killed once the first of them has been prefilled: at most 4 are in flight then, so
        # at least 12 meet the dead instance
        deadline = time.monotonic() + 120
        while proxy.stats()["prefilled"] == before:
            assert time.monotonic() < deadline, "no request was prefilled"
            time.sleep(0.01)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        answers = [f.result() for f in futures]
    after = proxy.post("/v1/completions", _body(PROMPTS[1]))
    for prompt, answer in [*zip(prompts, answers), (PROMPTS[1], after)]:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == colocated(prompt)
    stats = proxy.stats()
    assert stats["computed_on_decode"] >= 1 and stats["prefill_failures"] >= 2
