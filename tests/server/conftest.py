"""Real `pagoda serve` processes on free loopback ports.

- `start_server(model, *flags)`: start one (waits for /health 200); stopped at the end of the test.
- `tiny_server`: one per session on the tiny random Llama (most tests), with async scheduling.
- `smollm2_server`: one per session on the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.browser import browser, open_page  # noqa: F401  (fixtures)

START_TIMEOUT_S = 180.0
SMALL_POOL = ("--num-gpu-blocks-override", "512")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(
        self,
        model: str | None,
        flags: tuple[str, ...],
        api_key: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            mode="w+", prefix="pagoda-serve-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "pagoda.cli", "serve"]
        if model is not None:
            cmd.append(model)
        cmd += ["--port", str(self.port), "--uvicorn-log-level", "warning", *flags]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pagoda serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"pagoda serve did not become ready:\n{self.log()}")

    def log(self) -> str:
        self.log_file.flush()
        with open(self.log_file.name) as f:
            return f.read()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, timeout=60, **kwargs)

    def metric(self, name: str) -> float:
        """The first /metrics sample whose series starts with `name`, e.g.
        "pagoda:num_requests_running" or 'pagoda:request_success_total{finished_reason="stop"'."""
        for line in self.get("/metrics").text.splitlines():
            series = line.split(" ", 1)[0]
            if series == name or (series.startswith(name) and series[len(name)] in "{,"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        os.unlink(self.log_file.name)
        return int(self.proc.returncode)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(
        model: str | None, *flags: str, api_key: str | None = None, wait: bool = True
    ) -> ServerProcess:
        server = ServerProcess(model, flags, api_key)
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.stop(timeout=10)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: str) -> Iterator[ServerProcess]:
    # Async scheduling, as on a GPU by default (the SmolLM2 server keeps the CPU default: off).
    server = ServerProcess(tiny_llama_dir, (*SMALL_POOL, "--async-scheduling")).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[ServerProcess]:
    flags = ("--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    server = ServerProcess(None, (*SMALL_POOL, *flags)).wait_ready()
    yield server
    server.stop()
