"""PagodaConnector: a prompt's KV blocks from a prefill instance (the producer) to a decode
instance (the consumer), over ZeroMQ: between processes on one host or across hosts.

Blocks are named by their prefix-cache hashes (scheduling/block_pool.hash_block_tokens, the
chain over the prompt's tokens and cache salt), which both instances compute alike from the same
prompt; so the decode instance needs nothing of the prefill's but its address, and what it
receives joins its prefix cache like blocks it computed itself.

    consumer: KVFetcher (a thread)              producer: KVServer (a thread)
    DEALER  [b"", request]          -->         ROUTER: under the engine's lock, the longest run
                                                of the asked hashes its prefix cache holds, and
                                                copies of those blocks from every layer's cache
            [b"", header, data...]  <--         one data frame per cache tensor (k, v, scales)

request: msgpack {"hashes": [...], "layout": [[dtype, per-block shape], ...]}; header: msgpack
{"num_blocks": n, "error": null or why}. A fetch that times out or fails is tried again
(`retries`), then given up: the engine then computes the prompt itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch
import zmq

from pagoda.kernels.paged_cache import Layout
from pagoda.kv_transfer_config import KVTransferConfig

logger = logging.getLogger(__name__)


@dataclass
class KVTransferStats:
    """Totals since start. Consumer: fetches asked, fetches given up (computed locally instead),
    tries after a failure, blocks and bytes received, seconds from asking to having the data.
    Producer: fetches served, blocks and bytes sent, seconds serving (lookup, copy, send)."""

    fetches: int = 0
    fetch_failures: int = 0
    fetch_retries: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    receive_seconds: float = 0.0
    fetches_served: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    send_seconds: float = 0.0


def _to_bytes(t: torch.Tensor) -> memoryview:
    flat: memoryview = t.contiguous().view(torch.uint8).reshape(-1).numpy().data
    return flat


def _from_bytes(buffer: Any, dtype: str, shape: list[int], count: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only frame: we only read it (scatter copies)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(count, *shape)


class KVServer:
    """The producer's thread: answers fetches with blocks of its prefix cache. `read_blocks`
    (the engine's, run under its lock) maps hashes to the longest held run and their data."""

    def __init__(
        self,
        config: KVTransferConfig,
        layout: Layout,
        read_blocks: Callable[[list[bytes]], list[torch.Tensor]],
        stats: KVTransferStats,
    ) -> None:
        self.layout = layout
        self.read_blocks = read_blocks
        self.stats = stats
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{config.kv_ip}:{config.kv_port}"
        try:
            self.socket.bind(address)
        except zmq.ZMQError as e:
            self.context.destroy(linger=0)
            raise ValueError(f"kv_transfer_config: cannot listen on {address}: {e}") from e
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pagoda-kv-server", daemon=True)
        self.thread.start()
        logger.info("KV transfer: serving prompt blocks at %s", address)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.context.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(100):
                continue
            frames = self.socket.recv_multipart()
            start = time.perf_counter()
            try:
                reply = self._answer(frames[-1])
            except Exception as e:  # noqa: BLE001 - answered (the consumer then computes) and logged
                logger.exception("KV server: a fetch failed")
                error = f"{type(e).__name__}: {e}"
                reply = [msgspec.msgpack.encode({"num_blocks": 0, "error": error})]
            self.socket.send_multipart([frames[0], b"", *reply], copy=False)
            self.stats.fetches_served += 1
            self.stats.send_seconds += time.perf_counter() - start

    def _answer(self, raw: bytes) -> list[Any]:
        try:
            request = msgspec.msgpack.decode(raw)
            layout = [(d, list(s)) for d, s in request["layout"]]
            hashes = [bytes(h) for h in request["hashes"]]
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as e:
            return [msgspec.msgpack.encode({"num_blocks": 0, "error": f"bad request: {e}"})]
        if layout != self.layout:
            error = "the caches differ (model, dtype, kv-cache dtype or block size)"
            return [msgspec.msgpack.encode({"num_blocks": 0, "error": error})]
        data = self.read_blocks(hashes)
        num_blocks = int(data[0].shape[0]) if data else 0
        frames = [_to_bytes(t) for t in data] if num_blocks else []
        self.stats.blocks_sent += num_blocks
        self.stats.bytes_sent += sum(f.nbytes for f in frames)
        header = msgspec.msgpack.encode({"num_blocks": num_blocks, "error": None})
        return [header, *frames]


@dataclass
class FetchResult:
    """A fetch's outcome: the first num_blocks of `hashes`' blocks (data: one tensor per cache
    tensor), or an error after every try."""

    request_id: str
    hashes: list[bytes]
    num_blocks: int = 0
    data: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None


class _FetchFailed(Exception):
    """A fetch try that may succeed if tried again (timeout, connection)."""


class KVFetcher:
    """The consumer's thread: fetches blocks from producers, one request at a time."""

    def __init__(self, config: KVTransferConfig, layout: Layout, stats: KVTransferStats) -> None:
        self.timeout_ms = int(config.timeout_s * 1000)
        self.retries = config.retries
        self.layout = layout
        self.stats = stats
        self.context = zmq.Context()
        self.jobs: queue.Queue[tuple[str, tuple[str, int], list[bytes]] | None] = queue.Queue()
        self.done: queue.Queue[FetchResult] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="pagoda-kv-fetcher", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, source: tuple[str, int], hashes: list[bytes]) -> None:
        self.jobs.put((request_id, source, hashes))

    def results(self, wait_s: float = 0.0) -> list[FetchResult]:
        """The fetches finished since the last call; waits up to wait_s for a first one."""
        out: list[FetchResult] = []
        try:
            out.append(self.done.get(timeout=wait_s) if wait_s > 0 else self.done.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)
        self.context.destroy(linger=0)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            request_id, source, hashes = job
            self.done.put(self._fetch(request_id, source, hashes))

    def _fetch(self, request_id: str, source: tuple[str, int], hashes: list[bytes]) -> FetchResult:
        start = time.perf_counter()
        error = ""
        for attempt in range(1 + self.retries):
            if attempt:
                self.stats.fetch_retries += 1
            try:
                num_blocks, data, size = self._try(source, hashes)
            except _FetchFailed as e:
                error = str(e)
                logger.warning("KV fetch of %s from %s:%d failed: %s", request_id, *source, e)
                continue
            self.stats.blocks_received += num_blocks
            self.stats.bytes_received += size
            self.stats.receive_seconds += time.perf_counter() - start
            return FetchResult(request_id, hashes, num_blocks, data)
        self.stats.fetch_failures += 1
        return FetchResult(request_id, hashes, error=error)

    def _try(
        self, source: tuple[str, int], hashes: list[bytes]
    ) -> tuple[int, list[torch.Tensor], int]:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{source[0]}:{source[1]}")
            request = msgspec.msgpack.encode({"hashes": hashes, "layout": self.layout})
            socket.send_multipart([b"", request])
            if not socket.poll(self.timeout_ms):
                raise _FetchFailed(f"no answer within {self.timeout_ms / 1000:g} s")
            frames = socket.recv_multipart(copy=False)
        except zmq.ZMQError as e:
            raise _FetchFailed(str(e)) from e
        finally:
            socket.close()
        header = msgspec.msgpack.decode(frames[1].bytes)
        if header["error"] is not None:
            raise _FetchFailed(f"the producer refused: {header['error']}")
        count = int(header["num_blocks"])
        if count == 0:
            return 0, [], 0
        data_frames = frames[2:]
        if len(data_frames) != len(self.layout):
            raise _FetchFailed(f"{len(data_frames)} data frames for {len(self.layout)} tensors")
        data = [
            _from_bytes(f.buffer, dtype, shape, count)
            for f, (dtype, shape) in zip(data_frames, self.layout)
        ]
        return count, data, sum(len(f.buffer) for f in data_frames)


class KVConnector(Protocol):
    """What the engine (engine/remote_prefill.py) asks of a KV connector, the implementation
    kv_transfer_config's kv_connector names. A producer serves blocks of its prefix cache through
    the `read_blocks` it is built with; a consumer starts fetches and collects their results."""

    def start_fetch(self, request_id: str, source: tuple[str, int], hashes: list[bytes]) -> None:
        """Fetch from `source` the longest run of these blocks it holds (asynchronously)."""
        ...

    def finished_fetches(self, wait_s: float = 0.0) -> list[FetchResult]:
        """The fetches finished since the last call; waits up to wait_s for a first one."""
        ...

    def close(self) -> None: ...


class PagodaConnector:
    """ZeroMQ, between processes on one host or across hosts: a KVServer thread on a producer,
    a KVFetcher thread on a consumer (both on kv_both)."""

    def __init__(
        self,
        config: KVTransferConfig,
        layout: Layout,
        read_blocks: Callable[[list[bytes]], list[torch.Tensor]],
        stats: KVTransferStats,
    ) -> None:
        self.server = KVServer(config, layout, read_blocks, stats) if config.is_producer else None
        self.fetcher = KVFetcher(config, layout, stats) if config.is_consumer else None

    def start_fetch(self, request_id: str, source: tuple[str, int], hashes: list[bytes]) -> None:
        if self.fetcher is None:
            raise RuntimeError("only a kv_consumer (or kv_both) fetches")
        self.fetcher.submit(request_id, source, hashes)

    def finished_fetches(self, wait_s: float = 0.0) -> list[FetchResult]:
        return [] if self.fetcher is None else self.fetcher.results(wait_s)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.fetcher is not None:
            self.fetcher.close()


# kv_connector name -> implementation (kv_transfer_config.KV_CONNECTORS lists the names)
CONNECTORS: dict[str, Callable[..., KVConnector]] = {"PagodaConnector": PagodaConnector}


def make_connector(
    config: KVTransferConfig,
    layout: Layout,
    read_blocks: Callable[[list[bytes]], list[torch.Tensor]],
    stats: KVTransferStats,
) -> KVConnector:
    return CONNECTORS[config.kv_connector](config, layout, read_blocks, stats)
