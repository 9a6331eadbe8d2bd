"""Starting the engine process: `launch_engine` spawns it and loads the tokenizer in a thread
meanwhile; `wait_ready` waits for its report (ready, or its error)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineConfig

ENGINE_START_TIMEOUT_S = 600.0


@dataclass
class EngineLaunch:
    """An engine process being started (launch_engine) and the tokenizer loading beside it."""

    process: Any
    ready: Any  # the read end of the pipe the engine reports ready (or its error) on
    in_addr: str
    out_addr: str
    tokenizer: concurrent.futures.Future[Any]

    def kill(self) -> None:
        """End the engine process if it still runs. It ignores SIGTERM, which multiprocessing's
        exit handler sends, so a server that stops before its AsyncEngine shuts the engine
        down (Ctrl-C while it imports) must kill it, or that handler waits for it forever."""
        if self.process.exitcode is None:
            self.process.kill()


def launch_engine(config: EngineConfig, addresses: tuple[str, str] | None = None) -> EngineLaunch:
    """Spawn the engine process (it connects to the client's sockets at `addresses`, bound by
    the AsyncEngine that takes the launch) and load the tokenizer in a thread meanwhile.

    `pagoda serve` launches before importing the server (FastAPI, uvicorn), so the engine loads
    the model while this process imports them; AsyncEngine.start launches when nothing did."""
    if addresses is None:
        addresses = ipc_addresses()
    mp = multiprocessing.get_context("spawn")
    parent_conn, child_conn = mp.Pipe(duplex=False)
    process = mp.Process(
        target=_run_engine_process,
        args=(config, *addresses, child_conn),
        name="pagoda-engine",
        # A daemonic process may not start processes: with tensor or pipeline parallelism
        # the engine starts its ranks, so it is not daemonic then (shutdown() still ends it, and it
        # ends itself within a second of this process going away: engine/process.py).
        daemon=config.world_size == 1,
    )
    process.start()
    child_conn.close()
    return EngineLaunch(process, parent_conn, *addresses, _in_thread(_load_tokenizer, config))


def wait_ready(conn: Any, process: Any) -> tuple[str, Any]:
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                result: tuple[str, Any] = conn.recv()
                return result
            except EOFError:
                break
        if not process.is_alive():
            break
    code = process.exitcode
    return ("error", f"the engine process exited during start-up (exit code {code})")


def _run_engine_process(*args: Any) -> None:
    """The engine process's entry point; the engine (and torch) is imported there only, not in
    the client's process."""
    from pagoda.engine.process import run_engine_process

    run_engine_process(*args)


def ipc_addresses() -> tuple[str, str]:
    """Fresh socket addresses for the client's (in, out) ZeroMQ sockets."""
    base = os.path.join(tempfile.gettempdir(), f"pagoda-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


def _load_tokenizer(config: EngineConfig) -> Any:
    # Imported here: transformers takes a second or more to import, which the server's process
    # then spends beside the engine process's start rather than before it.
    from pagoda.loading.tokenizer import load_tokenizer_for

    return load_tokenizer_for(config)


def _in_thread(
    fn: Callable[[EngineConfig], Any], config: EngineConfig
) -> concurrent.futures.Future[Any]:
    """fn(config) in a daemon thread (a process that stops early does not wait for it)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(config))
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(e)

    threading.Thread(target=run, name="pagoda-tokenizer", daemon=True).start()
    return future
