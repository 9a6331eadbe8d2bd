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

The connector has two sides. The scheduler side (engine/remote_prefill.py) decides which blocks
to fetch, load, stage or drop, and sends that as KVConnectorOps (scheduling/messages.py) through
the executor; the worker side, KVWorker below (the executor's, beside the runner's caches), holds
the transport, every block's data and the staging area, and does the copies. The engine holds
no block data.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch
import zmq

from pagoda.kernels.paged_cache import KVCache, Layout, cache_layout, gather_blocks, scatter_blocks
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.runner.executor import CachedBlocks
from pagoda.scheduling.messages import KVConnectorOps, KVFetchDone

logger = logging.getLogger(__name__)

# Bytes of prompt blocks a producer keeps staged for decode instances to fetch.
STAGE_BYTES = 1 << 30


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


class KVWorker:
    """The KV connector's worker side, beside the runner's caches: the transport (the configured
    connector), the blocks fetched for each request until a load writes them, and the staging
    area: a finished prompt's blocks copied out (at most STAGE_BYTES, oldest dropped first), so
    that a decode instance's fetch of them is answered without waiting for the engine's step."""

    def __init__(
        self, config: KVTransferConfig, caches: Sequence[KVCache], cached_blocks: CachedBlocks
    ) -> None:
        self.caches = caches
        self.cached_blocks = cached_blocks
        self.stats = KVTransferStats()
        self.fetched: dict[str, list[torch.Tensor]] = {}
        self.staged: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.staged_bytes = 0
        self.stage_lock = threading.Lock()  # the engine thread stages, the server thread reads
        layout = cache_layout(caches)
        self.connector = make_connector(config, layout, self._read_blocks, self.stats)

    def apply(self, ops: KVConnectorOps) -> list[KVFetchDone]:
        """Do the ops (in their fields' order); with ops.poll, then report the fetches finished
        since the last poll (waiting up to ops.wait_s for a first one)."""
        for request_id, source, hashes in ops.fetches:
            self.stats.fetches += 1
            self.connector.start_fetch(request_id, source, hashes)
        for request_id in ops.drops:
            self.fetched.pop(request_id, None)
        for request_id, block_ids in ops.loads:
            scatter_blocks(self.caches, block_ids, self.fetched.pop(request_id))
        for block_ids, hashes in ops.saves:
            self._stage(gather_blocks(self.caches, block_ids), hashes)
        done: list[KVFetchDone] = []
        if not ops.poll:
            return done
        for result in self.connector.finished_fetches(ops.wait_s):
            if result.num_blocks:
                self.fetched[result.request_id] = result.data
            done.append(
                KVFetchDone(result.request_id, result.hashes, result.num_blocks, result.error)
            )
        return done

    def _stage(self, data: list[torch.Tensor], hashes: list[bytes]) -> None:
        """One copy per request; each block's entries are views into it (a request's blocks
        are staged, and so dropped, together)."""
        with self.stage_lock:
            for i, block_hash in enumerate(hashes):
                blocks = [t[i] for t in data]
                if self.staged.pop(block_hash, None) is None:
                    self.staged_bytes += sum(b.numel() * b.element_size() for b in blocks)
                self.staged[block_hash] = blocks
            while self.staged_bytes > STAGE_BYTES and self.staged:
                _, old = self.staged.popitem(last=False)
                self.staged_bytes -= sum(b.numel() * b.element_size() for b in old)

    def _read_blocks(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of `hashes` this engine holds, one tensor per cache tensor ([] when
        it holds none): from the staging area when it starts there, else from the caches where
        the scheduler side finds them, under the engine's lock."""
        with self.stage_lock:
            run = []
            for block_hash in hashes:
                blocks = self.staged.get(block_hash)
                if blocks is None:
                    break
                run.append(blocks)
        if run:
            return [torch.stack(parts) for parts in zip(*run)]
        return self.cached_blocks(hashes, lambda ids: gather_blocks(self.caches, ids))

    def close(self) -> None:
        self.connector.close()
