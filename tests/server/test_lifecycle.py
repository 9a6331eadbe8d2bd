"""Server lifecycle on real processes: API key, admission control (429), client disconnect,
SIGTERM drain, engine-process death, start-up."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from pagoda.server import app, auth
from tests.server.conftest import SMALL_POOL, ServerProcess

StartServer = Callable[..., ServerProcess]
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


def _assert_error_shape(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    return err


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


class Stream:
    """A raw streaming completion read on a background thread, event by event."""

    def __init__(
        self, server: ServerProcess, body: dict[str, Any], path: str = "/v1/completions"
    ) -> None:
        self.path = path
        self.events: list[str] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.done = threading.Event()
        self._close = threading.Event()
        self.client = httpx.Client(timeout=120)
        body = {"model": _model(server), "stream": True, **body}
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: ServerProcess, body: dict[str, Any]) -> None:
        try:
            with self.client.stream(
                "POST", server.url + self.path, json=body, headers=server.headers
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.first.set()
                    if self._close.is_set():
                        break
        except httpx.HTTPError:
            pass
        finally:
            self.first.set()
            self.done.set()

    def disconnect(self) -> None:
        self._close.set()
        self.done.wait(30)
        self.client.close()

    def wait(self, timeout: float = 120) -> list[str]:
        assert self.done.wait(timeout), "the stream did not end"
        return self.events

    @property
    def text(self) -> str:
        return "".join(
            c["text"]
            for e in self.events
            if e != "[DONE]"
            for c in json.loads(e).get("choices", [])
        )

    @property
    def finish_reason(self) -> str | None:
        for e in reversed(self.events):
            if e != "[DONE]":
                for c in json.loads(e).get("choices", []):
                    if c.get("finish_reason"):
                        return str(c["finish_reason"])
        return None


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


API_KEY = "sk-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir: str) -> Iterator[ServerProcess]:
    """One server with an API key for both key tests (they only read)."""
    server = ServerProcess(tiny_llama_dir, SMALL_POOL, api_key=API_KEY).wait_ready()
    yield server
    server.stop()


def test_api_key(keyed_server: ServerProcess) -> None:
    server = keyed_server
    url = server.url
    _assert_error_shape(httpx.get(url + "/v1/models"), 401)
    bad = {"Authorization": "Bearer wrong"}
    _assert_error_shape(httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=bad), 401)
    _assert_error_shape(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    out = server.client().completions.create(model=_model(server), prompt="hi", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_api_key_compared_whole_whatever_its_length(keyed_server: ServerProcess) -> None:
    key = API_KEY
    url = keyed_server.url + "/v1/models"
    wrong = [
        key[:-1],  # a prefix: shorter
        key + "0",  # longer
        key[:-1] + "0",  # same length, last byte differs
        "x" + key[1:],  # same length, first byte differs
        key.upper(),
        "sk-0123456789abcdéf",  # non-ASCII: still a 401, not a 500
    ]
    for token in wrong:
        headers = {"Authorization": f"Bearer {token}".encode()}
        _assert_error_shape(httpx.get(url, headers=headers), 401)
    for header in ("Bearer", key, f"Basic {key}", f"Bearer{key}", f"Bearer  {key}"):
        _assert_error_shape(httpx.get(url, headers={"Authorization": header}), 401)
    for header in (f"Bearer {key}", f"bearer {key}"):  # the scheme is case-insensitive
        assert httpx.get(url, headers={"Authorization": header}).status_code == 200


def test_api_key_check_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key check goes through hmac.compare_digest on equal-length digests, never through
    `==` / `!=` on the strings (which stop at the first differing character)."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    digest = hashlib.sha256(b"sekret").digest()
    assert auth.bearer_matches("Bearer sekret", digest)
    assert not auth.bearer_matches("Bearer sekre", digest)
    assert not auth.bearer_matches("Bearer sekret-and-more", digest)
    assert not auth.bearer_matches(None, digest)
    assert len(calls) == 3
    assert all(len(a) == len(b) == 32 for a, b in calls)


def test_admission_control_429(start_server: StartServer, tiny_llama_dir: str) -> None:
    server = start_server(
        tiny_llama_dir, *SMALL_POOL, "--max-num-seqs", "1", "--max-waiting-requests", "1"
    )
    running = Stream(server, {"prompt": "one", **LONG})
    assert running.first.wait(60) and running.status == 200
    waiting = Stream(server, {"prompt": "two", **LONG})
    assert _wait_for(lambda: server.metric("pagoda:num_requests_waiting") == 1)
    r = server.post("/v1/completions", {"model": _model(server), "prompt": "three"})
    _assert_error_shape(r, 429)
    assert r.headers["retry-after"] == "1"
    assert not running.done.is_set(), "the running request ended before the 429 was checked"
    running.disconnect()
    waiting.disconnect()
    # Once the queue is empty again, requests are admitted.
    assert _wait_for(lambda: server.metric("pagoda:num_requests_running") == 0)
    ok = server.post(
        "/v1/completions", {"model": _model(server), "prompt": "four", "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_disconnect_aborts_and_frees_blocks(start_server: StartServer, tiny_llama_dir: str) -> None:
    server = start_server(tiny_llama_dir, *SMALL_POOL)
    idle = server.metric("pagoda:kv_cache_usage_perc")
    body = {"prompt": "a steady neighbour", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    expected = server.post("/v1/completions", {"model": _model(server), **body}).json()
    leaver = Stream(server, {"prompt": "a client that leaves early", **LONG})
    stayer = Stream(server, body)
    assert leaver.first.wait(60) and stayer.first.wait(60)
    leaver.disconnect()
    assert _wait_for(
        lambda: server.metric('pagoda:request_success_total{finished_reason="abort"') == 1, 10
    ), server.log()
    stayer.wait()
    assert stayer.finish_reason == "length"
    assert stayer.text == expected["choices"][0]["text"]
    assert _wait_for(lambda: server.metric("pagoda:kv_cache_usage_perc") == idle)
    assert server.metric("pagoda:num_requests_running") == 0
    # The leaver stopped early: far fewer than its 900 tokens were generated.
    generated = server.metric("pagoda:generation_tokens_total")
    assert generated < 300 * 2 + 900


def test_sigterm_drains_in_flight_requests(start_server: StartServer, tiny_llama_dir: str) -> None:
    server = start_server(tiny_llama_dir, *SMALL_POOL, "--shutdown-timeout", "60")
    model = _model(server)
    stream = Stream(server, {"prompt": "finish me", **LONG})
    assert stream.first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert _wait_for(lambda: server.get("/health").status_code == 503, 10)
    r = server.post("/v1/completions", {"model": model, "prompt": "too late"})
    _assert_error_shape(r, 503)
    assert not stream.done.is_set(), "the stream ended before the drain was checked"
    stream.wait()
    assert stream.finish_reason == "length"
    assert stream.events[-1] == "[DONE]"
    assert server.proc.wait(30) == 0


def test_sigterm_aborts_at_the_shutdown_timeout(
    start_server: StartServer, tiny_llama_dir: str
) -> None:
    server = start_server(tiny_llama_dir, *SMALL_POOL, "--shutdown-timeout", "0.2")
    stream = Stream(server, {"prompt": "too long to finish", **LONG})
    assert stream.first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    stream.wait(30)
    assert stream.finish_reason == "abort"
    assert server.proc.wait(30) == 0


def _engine_pid(server_pid: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(entry)
    raise LookupError("no engine process found")


def test_engine_death_fails_streams_logs_them_and_exits(
    start_server: StartServer, tiny_llama_dir: str
) -> None:
    """The engine process dies mid-stream: each open stream ends with an SSE error event (503,
    naming the engine) and [DONE], the server logs each error with the request's id, answers
    /health with 503 (unless already gone) and exits non-zero."""
    server = start_server(tiny_llama_dir, *SMALL_POOL)
    model = _model(server)
    completion = Stream(server, {"prompt": "interrupted", "request_id": "cmpl-logged-1", **LONG})
    chat = Stream(
        server,
        {
            "model": model,
            "messages": [{"role": "user", "content": "interrupted"}],
            "request_id": "chat-logged-2",
            **LONG,
        },
        path="/v1/chat/completions",
    )
    assert completion.first.wait(60) and chat.first.wait(60)
    assert "cmpl-logged-1" not in server.log() and "chat-logged-2" not in server.log()
    os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
    for stream in (completion, chat):
        events = stream.wait(30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "engine" in error["message"]
    try:
        assert server.get("/health").status_code == 503
    except httpx.TransportError:
        pass  # already gone: exiting is what matters
    assert server.proc.wait(30) != 0
    log = server.log()
    for rid in ("cmpl-logged-1", "chat-logged-2"):
        lines = [line for line in log.splitlines() if rid in line]
        assert lines, log
        assert lines[0].startswith("ERROR") and "EngineDeadError" in lines[0], lines


def _answer(server: ServerProcess, path: str, deadline_s: float) -> httpx.Response:
    """The first answer of GET path once the server listens."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return server.get(path)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_starting_up_is_503(start_server: StartServer, tiny_llama_dir: str) -> None:
    """While the engine process starts, /health and requests answer 503 in OpenAI's shape, then
    200 once it is up. The engine is held stopped (SIGSTOP) from the moment it is spawned, while
    it is still importing, so the window the test looks into cannot close first."""
    server = start_server(tiny_llama_dir, *SMALL_POOL, wait=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            engine = _engine_pid(server.proc.pid)
            break
        except LookupError:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.01)
    os.kill(engine, signal.SIGSTOP)
    try:
        _assert_error_shape(_answer(server, "/health", 120), 503)
        early = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        _assert_error_shape(early, 503)
    finally:
        os.kill(engine, signal.SIGCONT)
    server.wait_ready()
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_engine_start_failure_exits_nonzero(start_server: StartServer, tmp_path: Any) -> None:
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    server = start_server(str(bad), wait=False)
    assert server.proc.wait(120) != 0
    log = server.log()
    assert "engine" in log
    assert "never retrieved" not in log  # the error is reported once, by the engine's client


def test_a_killed_tensor_parallel_rank_fails_streams_and_exits(
    start_server: StartServer, tiny_llama_dir: str
) -> None:
    """Rank 1 of two (a process the engine started) is killed mid-stream: the stream ends with a
    503 error event and the server exits non-zero, as when the engine itself dies."""
    server = start_server(tiny_llama_dir, *SMALL_POOL, "--tensor-parallel-size", "2")
    stream = Stream(server, {"prompt": "interrupted", **LONG})
    assert stream.first.wait(60)
    found = re.search(
        r"2 ranks: tensor parallel 2 x pipeline 1 x prefill context parallel 1 \(pids \[(\d+), (\d+)\]\)",
        server.log(),
    )
    assert found, server.log()
    os.kill(int(found.group(2)), signal.SIGKILL)
    events = stream.wait(30)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine" in error["message"]
    assert server.proc.wait(30) != 0
    assert "rank 1" in server.log()


def test_a_server_stopped_while_starting_ends_its_engine(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pagoda serve` starts the engine process before importing the server; stopped before its
    AsyncEngine exists (Ctrl-C during those imports), it kills the engine, which ignores the
    SIGTERM of multiprocessing's exit handler (that handler would wait for it forever)."""
    from pagoda.cli import main
    from pagoda.client import async_client

    launched: list[async_client.EngineLaunch] = []
    launch_engine = async_client.launch_engine

    def launch(config: Any) -> async_client.EngineLaunch:
        launched.append(launch_engine(config))
        return launched[-1]

    def interrupted(*args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(async_client, "launch_engine", launch)
    monkeypatch.setattr(app, "run_server", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["serve", tiny_llama_dir, *SMALL_POOL, "--port", "1"])
    (engine,) = launched
    engine.process.join(10)
    assert engine.process.exitcode == -signal.SIGKILL
