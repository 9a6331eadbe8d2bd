"""WorkerGroup: the engine's executor (runner/executor.py) under tensor, pipeline and context
parallelism. It starts one process per rank (distributed/worker.py), sends each of them every
call the engine makes of its executor (the scheduler's output for each step: the same deltas a
single runner gets) and returns the reply rank's results (the last pipeline stage's first
rank: rank 0 without pipeline stages).

A rank that dies is never silent: every wait also watches the processes, so a rank killed in
the middle of a step (or between steps: check_health) raises RuntimeError naming it, and the
engine fails as it does for its own errors (the server answers 503 and exits non-zero). The
ranks exit when the engine's end of their pipes closes (the engine exited or shut them down).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.worker import reply_rank, run_worker
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.loading.draft import DraftModel
from pagoda.loading.tokenizer import load_tokenizer_for
from pagoda.lora_request import LoRARequest
from pagoda.model_config import ModelConfig
from pagoda.runner.draft_sampling import DraftGrammar
from pagoda.scheduling.messages import KVConnectorOps, KVFetchDone, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.distributed.kv_transfer import CachedBlocks

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# A rank's report of a failed collective may come before its killed peer's death shows.
DEATH_GRACE_S = 2.0
# ... and where the report says a peer's connection went (gloo's words), a peer is going for
# sure: on a loaded machine its death took over 2 s to show (a killed rank's teardown), so its
# name is waited for longer before the report is raised instead.
PEER_LOST_WORDS = ("Connection reset by peer", "Connection closed by peer")
PEER_LOST_GRACE_S = 15.0
STATS_REFRESH_S = 1.0


# A spawned rank that finds itself re-running the user's script at import (no main guard) exits
# at once with this code, and the engine names the fix instead of three tracebacks.
UNGUARDED_EXIT = 87
UNGUARDED_MESSAGE = (
    "pagoda starts its parallel ranks as new Python processes, which import your script again, "
    "and your script creates the LLM when it is imported: move that code under "
    '`if __name__ == "__main__":`'
)


class WorkerGroup:
    draft: DraftModel | None = None  # the ranks hold a draft model, each a whole one

    def __init__(self, config: EngineConfig, load_tokenizer: bool = True) -> None:
        if getattr(mp.current_process(), "_inheriting", False):
            # this process is a rank being spawned, still importing the parent's main module,
            # which is creating an engine: the script has no main guard
            os._exit(UNGUARDED_EXIT)
        if config.optimization_level:
            logger.warning("parallel ranks run every step eagerly: -O is ignored")
        self.tokenizer: Any = None  # the ranks run token ids; the engine's may detokenize
        if load_tokenizer and not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer_for(config)
        self.config = config
        size = config.world_size
        self.tp_size = config.tensor_parallel_size
        self.cp_size = config.prefill_context_parallel_size
        self.reply_rank = reply_rank(config)
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, torch.get_num_threads() // size)  # the engine's cores, shared out
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(config, rank, size, init_method, child, threads),
                name=f"pagoda-rank{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._last_words: dict[int, tuple[str, str] | None] = {}  # of exited ranks
        self._finalizer = weakref.finalize(self, _shutdown, self.conns, self.procs)
        logger.info(
            "%d ranks: tensor parallel %d x pipeline %d x prefill context parallel %d (pids %s)",
            size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.prefill_context_parallel_size,
            [p.pid for p in self.procs],
        )
        try:
            ready = [self._receive(rank) for rank in range(size)]
        except Exception:
            self.shutdown()
            raise
        # The config of the rank whose KV cache per token is the largest: every rank's cache
        # has the engine's number of blocks.
        configs: list[ModelConfig] = [r[0] for r in ready]
        self.model_config = max(
            configs, key=lambda c: c.num_layers_per_rank * c.num_kv_heads_per_rank
        )
        self.eos_token_ids: frozenset[int] = ready[0][1]
        self._totals: tuple[list[int], list[float]] = ([], [])
        self._totals_time = -STATS_REFRESH_S

    # ---- the executor's interface, as EngineCore uses it -------------------------------
    def execute(self, out: SchedulerOutput) -> RemoteOutput:
        self._send("execute", out)
        return RemoteOutput(self)

    def add_lora(self, request: LoRARequest) -> None:
        """Every rank reads its share; a rank that cannot answers the error's text."""
        errors = [e for e in self.call_all("add_lora", request) if e is not None]
        if errors:
            self.call_all("remove_lora", request.lora_int_id)
            raise ValueError(errors[0])

    def remove_lora(self, lora_id: int) -> bool:
        return all(self.call_all("remove_lora", lora_id))

    def draft_kv_bytes_per_token(self, kv_quant: str | None) -> int:
        """The largest rank's: each holds a whole draft model's cache beside its share."""
        return max(self.call_all("draft_kv_bytes_per_token", kv_quant))

    def set_draft_grammar(self, masks: DraftGrammar) -> None:
        """The grammars live in the engine's process: on the ranks a draft model samples its
        drafts without their masks. Verification stays exact (a draft the grammar refuses has
        p = 0 and is rejected); fewer drafts of a structured request are accepted."""
        return None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.call_all("allocate_kv_cache", num_blocks)

    def warm_up_kernels(self) -> None:
        self.call_all("warm_up_kernels")

    def capture_cuda_graphs(self) -> None:
        self.call_all("capture_cuda_graphs")

    def compile_decode_step(self) -> None:
        self.call_all("compile_decode_step")

    def profiled_kv_budget(self) -> int:
        """The smallest rank's KV budget: every rank's cache has the same number of blocks."""
        return min(self.call_all("profiled_kv_budget"))

    def memory(self) -> list[dict[str, int]]:
        """Each rank's weight and KV-cache bytes."""
        return self.call_all("memory")

    def rank_stats(self) -> list[dict[str, Any]]:
        """Each rank's stats() with its memory() beside them."""
        return [s | m for s, m in zip(self.stats(), self.memory(), strict=True)]

    # The KV connector's worker side: EngineConfig refuses --kv-transfer-config with parallel
    # ranks, so the engine never starts one on a WorkerGroup.
    def start_kv_connector(self, config: KVTransferConfig, cached_blocks: CachedBlocks) -> None:
        raise ValueError("KV transfer is not supported with parallel ranks")

    def kv_connector(self, ops: KVConnectorOps) -> list[KVFetchDone]:
        raise ValueError("KV transfer is not supported with parallel ranks")

    def kv_transfer_stats(self) -> dict[str, float]:
        return {}

    def close_kv_connector(self) -> None:
        return None

    def step_totals(self) -> tuple[list[int], list[float]]:
        """Each rank's steps and step seconds since start, asked of the ranks at most once a
        second (the engine's stats go out after every step)."""
        now = time.monotonic()
        if now - self._totals_time >= STATS_REFRESH_S:
            stats = self.stats()
            self._totals = ([int(s["steps"]) for s in stats], [s["step_seconds"] for s in stats])
            self._totals_time = now
        return self._totals

    def stats(self) -> list[dict[str, Any]]:
        """Each rank's steps and step seconds, its collectives' calls, bytes and seconds, and
        its recent micro-batch spans (runner/pipeline.StageTimeline)."""
        return self.call_all("stats")

    # ---- the processes ---------------------------------------------------------------------
    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Run `method` on every rank; each rank's result, in rank order."""
        self._send(method, *args, reply_all=True)
        return [self._receive(rank) for rank in range(len(self.procs))]

    def check_health(self) -> None:
        """RuntimeError if a rank has exited (naming the one that died first, see _failure)."""
        if any(not proc.is_alive() for proc in self.procs):
            raise self._failure(grace=0.0)

    def shutdown(self) -> None:
        self._finalizer()

    def _send(self, method: str, *args: Any, reply_all: bool = False) -> None:
        self.check_health()
        for conn in self.conns:
            try:
                conn.send((method, args, reply_all))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise self._failure() from None  # the pipe broke as a rank went: says which

    def _receive(self, rank: int) -> Any:
        """Rank `rank`'s next reply; an error (see _failure) if it reports one or a rank dies."""
        conn = self.conns[rank]
        ready = wait([conn, *(p.sentinel for p in self.procs)])
        if conn in ready or conn.poll():
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                raise self._failure() from None  # the pipe broke as a rank went: says which
            if status == "error":
                self._last_words[rank] = (value[0], value[1])
                raise self._failure(reporter=rank)
            return value
        raise self._failure()

    def _failure(self, reporter: int | None = None, grace: float = DEATH_GRACE_S) -> Exception:
        """The error to raise for a failed group. A rank that died without a word (killed) is
        named, with `reporter`'s report as the cause: its peers fail in their next collective
        ("connection reset by peer"), and one of them may report first, so up to `grace`
        seconds (PEER_LOST_GRACE_S where the report says a peer's connection went) are given
        for such a death to show. Otherwise the reporter's error, or the first exited rank's."""
        report = None if reporter is None else self._last_words[reporter]
        if report is not None and any(words in report[1] for words in PEER_LOST_WORDS):
            grace = max(grace, PEER_LOST_GRACE_S)
        deadline = time.monotonic() + grace
        while True:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            silent = [r for r in dead if self._last_word(r) is None]
            if silent:
                error = RuntimeError(self._died(silent[0]))
                if reporter is not None and report is not None:
                    error.__cause__ = _failure(self._name(reporter), *report)
                return error
            alive = [p.sentinel for r, p in enumerate(self.procs) if p.is_alive() and r != reporter]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                break
            wait(alive, timeout=left)  # until one of them exits, or the grace ends
        if reporter is None and not dead:
            return RuntimeError("a rank's pipe to the engine broke, but no rank has exited")
        rank = reporter if reporter is not None else dead[0]
        word = self._last_word(rank)
        assert word is not None  # a silent death was returned above
        return _failure(self._name(rank), *word)

    def _last_word(self, rank: int) -> tuple[str, str] | None:
        """The error an exited rank reported before it went (kind, text), None if it died
        without one; read from its pipe once, then kept."""
        if rank not in self._last_words:
            word = None
            conn = self.conns[rank]
            try:
                if conn.poll():
                    status, value = conn.recv()
                    if status == "error":
                        word = (value[0], value[1])
            except (EOFError, OSError):
                pass
            self._last_words[rank] = word
        return self._last_words[rank]

    def _name(self, rank: int) -> str:
        """How messages name a rank: "tensor-parallel rank 1", "pipeline stage 1", or both, or
        "context-parallel rank 1"."""
        stage, tp_rank = divmod(rank, self.tp_size)
        if self.cp_size > 1:
            return f"context-parallel rank {rank}"
        if len(self.procs) == self.tp_size:
            return f"tensor-parallel rank {tp_rank}"
        if self.tp_size == 1:
            return f"pipeline stage {stage}"
        return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"

    def _died(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1)  # reaped, so its exit code is known (a broken pipe shows first)
        if proc.exitcode == UNGUARDED_EXIT:
            return UNGUARDED_MESSAGE
        return (
            f"{self._name(rank)} (pid {proc.pid}) died with exit code {proc.exitcode}; "
            "the engine cannot continue without it"
        )


class RemoteOutput:
    """A step's results, on their way from the reply rank (as pending_output.PendingOutput)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def get(self) -> RunnerOutput:
        result: RunnerOutput = self.group._receive(self.group.reply_rank)
        return result


def _failure(name: str, kind: str, text: str) -> Exception:
    """A rank's exception, as the engine raises it: ValueError stays ValueError (bad input, as
    on one rank: e.g. a tensor_parallel_size the heads do not divide)."""
    if kind == "ValueError":
        return ValueError(text)
    return RuntimeError(f"{name} failed: {kind}: {text}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shutdown(conns: list[Connection], procs: list[BaseProcess]) -> None:
    """Close the pipes (each rank exits on their end) and reap the processes."""
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=SHUTDOWN_GRACE_S)
