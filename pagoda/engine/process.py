"""EngineCore in its own process, and the two messages that link it to the API process.

    API process                                   engine process
    RequestIn  (add | abort | abort_sample)  -->  EngineCore.add_request / abort
               <--  OutputsOut (accepted ids, per-request errors, outputs of a step, stats)

Both travel as msgpack (msgspec) over a pair of zmq PUSH/PULL sockets. The engine drains every
pending input before each step and answers at once when an input changed anything, so a request
is accepted or refused within one step. A request the engine refuses (ValueError) is reported in
`errors` and never enters the scheduler; any other exception ends the process with `fatal` set.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from pagoda.config import EngineConfig
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineCoreOutput, EngineRequest, SchedulerStats

logger = logging.getLogger(__name__)

ADD, ABORT, ABORT_SAMPLE = "add", "abort", "abort_sample"


class RequestIn(msgspec.Struct, array_like=True, omit_defaults=True):
    """API -> engine. kind "add" carries a tokenized request; "abort" names user request ids
    (every sample); "abort_sample" names one sample's engine id."""

    kind: str
    request_ids: list[str]
    prompt_token_ids: list[int] = []
    sampling_params: dict[str, Any] = {}
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class OutputsOut(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine -> API: what happened since the last message."""

    num_inputs: int  # RequestIn messages the engine has read in total
    stats: SchedulerStats | None = None
    outputs: list[EngineCoreOutput] = []
    accepted: list[str] = []
    errors: dict[str, str] = {}  # request id -> why add_request refused it
    fatal: str | None = None  # the engine died of this


class EngineInfo(msgspec.Struct):
    """Sent once, when the engine is ready."""

    pid: int
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in SamplingParams.__annotations__}


def _to_engine_request(msg: RequestIn) -> EngineRequest:
    return EngineRequest(
        request_id=msg.request_ids[0],
        prompt_token_ids=msg.prompt_token_ids,
        sampling_params=SamplingParams(**msg.sampling_params),
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )


class EngineLoop:
    """The engine process's loop: drain inputs, step, send outputs."""

    def __init__(self, engine: Any, in_socket: zmq.Socket, out_socket: zmq.Socket) -> None:
        self.engine = engine
        self.in_socket = in_socket
        self.out_socket = out_socket
        self.decoder = msgspec.msgpack.Decoder(RequestIn)
        self.encoder = msgspec.msgpack.Encoder()
        self.num_inputs = 0
        self.parent_pid = os.getppid()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_socket, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished_requests()
            # Idle: block on input (wake up now and then so a dead parent is noticed).
            if busy or poller.poll(timeout=1000):
                self._drain_inputs()
            elif os.getppid() != self.parent_pid:
                return
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self._send(OutputsOut(self.num_inputs, self.engine.stats(), outputs=outputs))

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
            if msg.kind == ADD:
                rid = msg.request_ids[0]
                try:
                    self.engine.add_request(_to_engine_request(msg))
                    accepted.append(rid)
                except ValueError as e:
                    errors[rid] = str(e)
            elif msg.kind == ABORT:
                self.engine.abort_request(msg.request_ids)
            elif msg.kind == ABORT_SAMPLE:
                for rid in msg.request_ids:
                    self.engine.abort_sample(rid)
        if got:
            stats = self.engine.stats()
            self._send(OutputsOut(self.num_inputs, stats, accepted=accepted, errors=errors))

    def _send(self, out: OutputsOut) -> None:
        self.out_socket.send(self.encoder.encode(out))


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

        engine = EngineCore(config)
        info = EngineInfo(
            pid=os.getpid(),
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            num_blocks=engine.num_blocks,
            block_size=engine.block_size,
        )
        ready.send(("ready", msgspec.msgpack.encode(info)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        logger.exception("engine failed to start")
        ready.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    loop = EngineLoop(engine, in_socket, out_socket)
    try:
        loop.run()
    except Exception as e:  # noqa: BLE001
        logger.exception("engine loop died")
        out = OutputsOut(loop.num_inputs, fatal=f"{type(e).__name__}: {e}")
        out_socket.send(encoder.encode(out), flags=zmq.NOBLOCK)
        time.sleep(0.1)
        os._exit(1)
    os._exit(0)
