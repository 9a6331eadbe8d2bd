"""EngineCore in its own process, linked to the API process by the contract's messages.

    API process                                         engine process
    EngineInput (EngineRequest | AbortRequest)  -->  EngineCore.add_request / abort
                <--  EngineCoreOutputs (accepted ids, per-request errors, outputs of a step, stats)

Both are msgspec Structs (scheduling/messages.py), sent as they are as msgpack over a pair of
zmq PUSH/PULL sockets. The engine drains every
pending input before each step and answers at once when an input changed anything, so a request
is accepted or refused within one step. A request the engine refuses (ValueError) is reported in
`errors` and never enters the scheduler; any other exception ends the process with `fatal` set.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from pagoda.config import EngineConfig
from pagoda.scheduling.messages import (
    EngineCoreOutputs,
    EngineInput,
    EngineRequest,
    EngineSnapshot,
    LoRAUpdate,
    WatchRequest,
)
from pagoda.scheduling.snapshot import build_snapshot

logger = logging.getLogger(__name__)


class EngineLoop:
    """The engine process's loop: drain inputs, step, send outputs."""

    def __init__(self, engine: Any, in_socket: zmq.Socket, out_socket: zmq.Socket) -> None:
        self.engine = engine
        self.in_socket = in_socket
        self.out_socket = out_socket
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_inputs = 0
        self.parent_pid = os.getppid()
        self.watch_interval_s = 0.0  # WatchRequest: 0 while nobody watches
        self.last_snapshot = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_socket, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished_requests()
            # Idle: block on input (wake up now and then so a dead parent is noticed, and a
            # watching client gets its snapshots).
            wake_ms = int(1000 * self.watch_interval_s) if self.watch_interval_s else 1000
            if busy or poller.poll(timeout=wake_ms):
                self._drain_inputs()
            elif os.getppid() != self.parent_pid:
                return
            else:
                self.engine.check_health()  # a dead tensor-parallel rank ends the process
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                out = EngineCoreOutputs(self.num_inputs, self.engine.stats(), outputs=outputs)
                out.snapshot = self._snapshot_due()
                self._send(out)
            elif self.watch_interval_s:
                snapshot = self._snapshot_due()
                if snapshot is not None:
                    self._send(EngineCoreOutputs(self.num_inputs, snapshot=snapshot))

    def _snapshot_due(self) -> EngineSnapshot | None:
        """A snapshot when a client watches and its interval has passed since the last."""
        now = time.monotonic()
        if not self.watch_interval_s or now - self.last_snapshot < self.watch_interval_s:
            return None
        self.last_snapshot = now
        return build_snapshot(self.engine.scheduler)

    def _drain_inputs(self) -> None:
        accepted: list[str] = []
        errors: dict[str, str] = {}
        got = False
        while True:
            try:
                raw = self.in_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            self.num_inputs += 1
            msg = self.decoder.decode(raw)
            if isinstance(msg, WatchRequest):
                self.watch_interval_s, self.last_snapshot = max(0.0, msg.interval_s), 0.0
            elif isinstance(msg, EngineRequest):
                try:
                    self.engine.add_request(msg)
                    accepted.append(msg.request_id)
                except ValueError as e:
                    errors[msg.request_id] = str(e)
            elif isinstance(msg, LoRAUpdate):
                try:
                    self.engine.update_lora(msg)
                    accepted.append(msg.call_id)
                except ValueError as e:
                    errors[msg.call_id] = str(e)
            elif msg.all_samples:
                self.engine.abort_request(msg.request_ids)
            else:
                for rid in msg.request_ids:
                    self.engine.abort_sample(rid)
        if got:
            stats = self.engine.stats()
            self._send(EngineCoreOutputs(self.num_inputs, stats, accepted=accepted, errors=errors))

    def _send(self, out: EngineCoreOutputs) -> None:
        self.out_socket.send(self.encoder.encode(out))


def freeze_startup_heap() -> int:
    """Collect the garbage startup left, then move every live object into the permanent
    generation, which the cyclic collector never scans again (vLLM's freeze_gc_heap, after its
    engine's warm-up); returns how many were frozen. Startup leaves ~540k tracked objects
    (modules, the model's parameters, the compiled graphs: SmolLM2 at -O2), so a full
    collection, which CPython runs whenever enough objects have outlived two collections,
    stalled every request's step for 0.25-0.4 s (benchmarks/gc_pause.py); after the freeze it
    scans only what serving made. Objects created later are collected as before; the frozen
    ones are freed by reference counting when they die, never by the cyclic collector: for a
    process that holds one engine until it exits (the served engine process), not for one
    that builds many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_engine_process(config: EngineConfig, in_addr: str, out_addr: str, ready: Any) -> None:
    """Entry point of the engine process: build EngineCore, report ready on the `ready` pipe,
    loop until the parent goes away. Any exception is reported as `fatal` before exiting 1."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine: %(message)s")
    # Ctrl-C and a SIGTERM sent to the whole process group are the API process's to handle (it
    # drains first); it ends this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    in_socket = ctx.socket(zmq.PULL)
    in_socket.connect(in_addr)
    out_socket = ctx.socket(zmq.PUSH)
    out_socket.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from pagoda.engine.core import EngineCore

        # The client holds the tokenizer: the engine reads only its EOS id.
        engine = EngineCore(config, load_tokenizer=False)
        logger.info("startup heap frozen: %d objects", freeze_startup_heap())
        ready.send(("ready", msgspec.msgpack.encode(engine.info())))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        logger.exception("engine failed to start")
        ready.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    loop = EngineLoop(engine, in_socket, out_socket)
    try:
        loop.run()
    except Exception as e:  # noqa: BLE001
        logger.exception("engine loop died")
        out = EngineCoreOutputs(loop.num_inputs, fatal=f"{type(e).__name__}: {e}")
        out_socket.send(encoder.encode(out), flags=zmq.NOBLOCK)
        time.sleep(0.1)
        os._exit(1)
    os._exit(0)
