"""AsyncEngine: the API process's client of the engine process, with one stream per request.

The engine process owns EngineCore (pagoda/engine/process.py). This side tokenizes (and applies
chat templates: the server hands it messages and prompts, never tokens it made), sends EngineRequest / AbortRequest
(scheduling/messages.py) and folds every EngineCoreOutputs into per-request `RequestState`s (output_processor.py: detokenize,
stop strings, n > 1 grouping). A request's consumer wakes on its stream's event and builds a
(delta) RequestOutput from the state, so outputs that arrive faster than the consumer reads them
coalesce instead of queueing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from pagoda.client.engine_launch import EngineLaunch, ipc_addresses, launch_engine, wait_ready
from pagoda.client.finished import Explanations, finish_line
from pagoda.client.lora_calls import LoRACalls
from pagoda.client.output_processor import RequestState
from pagoda.client.pooling import check_runner
from pagoda.client.tokenizer import (
    CompletionPrompt,
    Conversation,
    Prompt,
    PromptError,
    chat_prompt,
    completion_prompts,
)
from pagoda.client.validation import check_request
from pagoda.config import EngineConfig
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import (
    AbortRequest,
    EngineCoreOutputs,
    EngineInfo,
    EngineInput,
    EngineRequest,
    EngineSnapshot,
    SchedulerStats,
    WatchRequest,
)

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """What the client reports as outputs arrive (the server's Prometheus metrics)."""

    def set_engine_stats(self, stats: SchedulerStats) -> None: ...

    def observe_tokens(
        self, state: RequestState, num_new: int, previous_token_time: float | None, now: float
    ) -> None: ...

    def observe_finished(self, state: RequestState) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can be served any more."""


@dataclass
class RequestStream:
    state: RequestState
    event: asyncio.Event = field(default_factory=asyncio.Event)
    accepted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    error: Exception | None = None


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        metrics: EngineObserver,
        on_dead: Callable[[str], None],
        log_requests: bool = True,
        launch: EngineLaunch | None = None,
    ) -> None:
        """`launch`: the engine process already started for `config` (launch_engine)."""
        self.config = config
        self.metrics = metrics
        self.on_dead = on_dead
        self.log_requests = log_requests
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self.stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self.dead_reason: str | None = None
        self.streams: dict[str, RequestStream] = {}
        self.explanations = Explanations(config.scheduler.max_explained_requests)
        self.snapshot: EngineSnapshot | None = None  # the latest, while watch() is on
        self._unacked: set[str] = set()
        self.lora = LoRACalls(self._send)  # runtime adapter loads and unloads
        self._launch = launch
        self._process: Any = None if launch is None else launch.process
        self._tasks: list[asyncio.Task[None]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        # Sends never wait (PUSH to a live peer), so the sending socket is a plain one: an
        # abort can go out from a `finally` of a cancelled task.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        if launch is not None:
            self._in_addr, self._out_addr = launch.in_addr, launch.out_addr
        else:
            self._in_addr, self._out_addr = ipc_addresses()
        self._to_engine = self._sync_ctx.socket(zmq.PUSH)
        self._to_engine.bind(self._in_addr)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(self._out_addr)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.info is not None and self.dead_reason is None

    @property
    def engine_pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    async def start(self) -> None:
        """Spawn the engine process (unless launched already) and wait until it has loaded the
        model and the tokenizer has loaded here."""
        launch = self._launch
        if launch is None:
            launch = launch_engine(self.config, (self._in_addr, self._out_addr))
            self._process = launch.process
        loop = asyncio.get_running_loop()
        tokenizer = asyncio.wrap_future(launch.tokenizer)
        kind, payload = await loop.run_in_executor(None, wait_ready, launch.ready, self._process)
        if kind != "ready":
            # The engine's error is the one reported; the tokenizer's, if any, has its cause.
            await asyncio.gather(tokenizer, return_exceptions=True)
            self._die(f"the engine failed to start: {payload}")
            return
        self.tokenizer = await tokenizer
        self.info = msgspec.msgpack.decode(payload, type=EngineInfo)
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._tasks.append(asyncio.create_task(self._output_loop()))
        logger.info("engine ready (pid %d, %d KV blocks)", self.info.pid, self.info.num_blocks)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        proc = self._process
        if proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            except (ValueError, OSError):
                pass
            if proc.is_alive():
                proc.kill()  # it ignores SIGTERM (see run_engine_process) and holds no state
                await asyncio.get_running_loop().run_in_executor(None, proc.join, 10)
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
        for addr in (self._in_addr, self._out_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except OSError:
                pass

    def _on_process_exit(self) -> None:
        code = self._process.exitcode if self._process is not None else None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._die(f"the engine process exited unexpectedly (exit code {code})")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("%s", reason)
        self.dead_reason = reason
        self.lora.fail(EngineDeadError(reason))
        for stream in self.streams.values():
            stream.error = EngineDeadError(reason)
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(reason))
                stream.accepted.exception()  # mark retrieved: the consumer may be gone
            stream.event.set()
        self.on_dead(reason)

    # ---- text: prompts in, token text out (PromptError for bad input) ----------------------
    def chat_prompt(
        self,
        conversation: Conversation,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """A conversation's prompt text and token ids under the model's (or the given) template."""
        return chat_prompt(
            self.tokenizer,
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            template_kwargs,
        )

    def completion_prompts(self, prompt: CompletionPrompt, field: str = "prompt") -> list[Prompt]:
        """The (text, token ids) prompts of a completion request's `prompt` (or other field)."""
        return completion_prompts(self.tokenizer, prompt, field)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids given by a client: PromptError unless each is in the vocab."""
        vocab = self.info.vocab_size if self.info is not None else 0
        if any(t < 0 or t >= vocab for t in token_ids):
            raise PromptError(f"token ids must be in [0, {vocab})", "tokens")
        return self.decode(token_ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    # ---- requests --------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine, counting those sent but not yet acknowledged."""
        return self.stats.num_waiting + len(self._unacked)

    async def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Send a request and wait until the engine accepts it (within one step). ValueError if
        the engine refuses it, EngineDeadError if the engine is gone. The caller must then read
        `outputs(stream)` or `release(stream)`. pooling: an embedding request (--runner pooling;
        its vector is `stream.state.pooled` once finished)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        assert self.info is not None
        check_runner(self.info, pooling)
        if params.structured_outputs is not None:
            from pagoda.engine.grammar import check_structured_outputs

            # Off the event loop: a large schema takes a while to check.
            await asyncio.to_thread(check_structured_outputs, params.structured_outputs)
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_num_seqs = self.config.scheduler.max_num_seqs
        check_request(
            self.info, max_num_seqs, prompt_token_ids, params, kv_transfer_params, pooling
        )
        arrival = time.time()
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival)
        msg = EngineRequest(
            request_id, prompt_token_ids, params, arrival, priority, cache_salt,
            kv_transfer_params, lora_request,
        )  # fmt: skip
        try:
            raw = self._encoder.encode(msg)
        except (OverflowError, msgspec.EncodeError) as e:  # e.g. an int past 64 bits
            raise ValueError(f"the request cannot be sent to the engine: {e}") from e
        stream = RequestStream(state)
        self.streams[request_id] = stream
        self._unacked.add(request_id)
        self._to_engine.send(raw)
        try:
            await stream.accepted
        except BaseException as e:
            self.streams.pop(request_id, None)
            self._unacked.discard(request_id)
            if not isinstance(e, (ValueError, EngineDeadError)):
                # Cancelled while waiting (the client left): the engine may still accept it.
                self._send(AbortRequest([request_id]))
            raise
        return stream

    async def outputs(
        self, stream: RequestStream, delta: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs of one request: with delta=True whatever is new each time, else the
        whole request once it has finished. EngineDeadError if the engine goes away. Leaving
        early (or being cancelled) aborts the request."""
        state = stream.state
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                if delta:
                    out = state.make_output(delta=True)
                    if state.finished or any(c.token_ids or c.text for c in out.outputs):
                        yield out
                elif state.finished:
                    yield state.make_output()
                if state.finished:
                    return
        finally:
            self.release(stream)

    def release(self, stream: RequestStream) -> None:
        """Forget a request; abort it in the engine if it is still running."""
        state = stream.state
        self.streams.pop(state.request_id, None)
        if not state.finished and stream.error is None and self.dead_reason is None:
            state.abort()
            self._record_finished(state)
            self._send(AbortRequest([state.request_id]))

    def abort(self, request_id: str) -> None:
        """Finish a request as aborted; its consumer gets a last output with reason "abort"."""
        stream = self.streams.get(request_id)
        if stream is not None and not stream.state.finished:
            stream.state.abort()
            self._record_finished(stream.state)
            stream.event.set()
            self._send(AbortRequest([request_id]))

    def watch(self, interval_s: float) -> None:
        """Ask the engine for a snapshot (`self.snapshot`) every interval_s; 0 stops them."""
        self._send(WatchRequest(interval_s))

    def _send(self, msg: EngineInput) -> None:
        self._to_engine.send(self._encoder.encode(msg))

    # ---- outputs ---------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            raw = await self._from_engine.recv()
            msg = self._decoder.decode(raw)
            if msg.fatal is not None:
                self._die(f"the engine process failed: {msg.fatal}")
                return
            self._handle(msg)

    def _handle(self, msg: EngineCoreOutputs) -> None:
        self.lora.resolve(msg)
        if msg.snapshot is not None:
            self.snapshot = msg.snapshot
        if msg.stats is not None:
            self.stats = msg.stats
            self.metrics.set_engine_stats(msg.stats)
        for rid in msg.accepted:
            self._unacked.discard(rid)
            stream = self.streams.get(rid)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_result(None)
        for rid, why in msg.errors.items():
            self._unacked.discard(rid)
            stream = self.streams.get(rid)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_exception(ValueError(why))
        now = time.time()
        aborts: list[str] = []
        touched: dict[str, RequestStream] = {}
        for out in msg.outputs:
            stream = self.streams.get(out.parent_id)
            if stream is None or stream.state.finished:
                continue
            state = stream.state
            if out.explain is not None:
                self.explanations.add(out.parent_id, out.explain)
            previous = state.metrics.last_token_time
            abort_id = state.add(out)
            self.metrics.observe_tokens(state, len(out.new_token_ids), previous, now)
            if abort_id is not None:
                aborts.append(abort_id)
            if state.finished:  # finished requests were skipped above
                self._record_finished(state)
            touched[out.parent_id] = stream
        for stream in touched.values():
            stream.event.set()
        if aborts:
            self._send(AbortRequest(aborts, all_samples=False))

    def _record_finished(self, state: RequestState) -> None:
        self.metrics.observe_finished(state)
        if self.log_requests:
            logger.info("%s", finish_line(state))
        self.explanations.log(state.request_id)
