"""One worker rank: a process that joins the ranks' torch.distributed group (gloo on CPU, NCCL on
CUDA), builds its share of the model and its runner (runner/builder.py), then runs the calls the
engine sends it, in order, until the engine goes away.

Global rank r is tensor-parallel rank r % T of pipeline stage r // T (T ranks a stage); each
stage's ranks form their own tensor-parallel group. Under prefill context parallelism (alone for
now) global rank r is context-parallel rank r, and every rank samples the same tokens from the
same gathered hidden states (runner/context_parallel.py).

    engine (WorkerGroup)                      rank r (this loop)
    (method, args) to every rank       -->    the runner's method; every rank runs every step
                                       <--    ("ok", result): the reply rank (the last
                                              stage's first) after each call; the others
                                              only for calls made with reply_all
                                       <--    ("error", (type name, text)): any rank
                                              whose call raised, which then exits 1

A last stage's ranks compute identical logits (the LM head's all-gather) and seed identically,
so each samples the same tokens; the reply rank's are the ones returned.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.kernels.paged_cache import kv_cache_bytes
from pagoda.layers.parallel import (
    NO_CONTEXT_PARALLEL,
    SINGLE,
    WHOLE_MODEL,
    ContextParallel,
    PipelineStage,
    TensorParallel,
)
from pagoda.lora_request import LoRARequest
from pagoda.runner.builder import RankSetup, build_runner, profiled_kv_budget
from pagoda.runner.model_runner import ModelRunner
from pagoda.scheduling.messages import RunnerOutput, SchedulerOutput
from pagoda.spec_decode.methods import draft_kv_bytes_per_token

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that neither answers nor dies (a dead rank's peers
# fail at once: its sockets close).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def run_worker(
    config: EngineConfig, rank: int, size: int, init_method: str, conn: Connection, threads: int
) -> None:
    """Entry point of global rank `rank` of `size`; `conn` is its pipe to the engine."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {rank}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's to handle; it ends the workers
    torch.set_num_threads(threads)
    try:
        tp, pp, cp = join_group(config, rank, size, init_method)
        torch.manual_seed(config.seed)
        setup = build_runner(config, tp, pp, cp)
        conn.send(("ok", (setup.model_config, setup.eos_token_ids)))
    except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
        logger.exception("rank %d failed to start", rank)
        _report(conn, e)
        os._exit(1)
    serve(conn, setup, config, rank, tp, pp, cp)


def join_group(
    config: EngineConfig, rank: int, size: int, init_method: str
) -> tuple[TensorParallel, PipelineStage, ContextParallel]:
    """Join the world group; return this rank's tensor-parallel group, pipeline stage and
    context-parallel rank (the world group's, which then has no other parallelism)."""
    backend = "nccl" if config.device_type == "cuda" else "gloo"
    if config.device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    stage = rank // tp_size
    group: Any = dist.group.WORLD
    if pp_size > 1 and tp_size > 1:  # every rank creates every stage's group, in order
        groups = [
            dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)
        ]
        group = groups[stage]
    cp_size = config.prefill_context_parallel_size
    if cp_size > 1:
        return SINGLE, WHOLE_MODEL, ContextParallel(rank, cp_size, dist.group.WORLD)
    tp = TensorParallel(rank % tp_size, tp_size, group)
    return tp, PipelineStage(stage, pp_size, rank, tp_size), NO_CONTEXT_PARALLEL


def reply_rank(config: EngineConfig) -> int:
    """The global rank whose results the engine reads: the last stage's first."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def serve(
    conn: Connection,
    setup: RankSetup,
    config: EngineConfig,
    rank: int,
    tp: TensorParallel,
    pp: PipelineStage,
    cp: ContextParallel,
) -> None:
    runner = setup.runner
    replies = rank == reply_rank(config)
    steps = StepStats()

    def execute(out: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        result = runner.execute(out).get()
        steps.add(start)
        return result

    calls: dict[str, Any] = {
        "execute": execute,
        "allocate_kv_cache": runner.allocate_kv_cache,
        "warm_up_kernels": runner.warm_up_kernels,
        "capture_cuda_graphs": runner.capture_cuda_graphs,
        "compile_decode_step": runner.compile_decode_step,
        "profiled_kv_budget": lambda: profiled_kv_budget(runner, config),
        "draft_kv_bytes_per_token": lambda kv_quant: draft_kv_bytes_per_token(
            config.speculative_config, setup.draft, kv_quant
        ),
        "add_lora": lambda request: _add_lora(runner, request),
        "remove_lora": lambda lora_id: runner.lora is not None and runner.lora.remove(lora_id),
        "memory": lambda: memory_of(setup),
        "stats": lambda: {
            **asdict(steps),
            **{f"collective_{k}": v for k, v in asdict(tp.stats).items()},
            **{f"pipeline_{k}": v for k, v in asdict(pp.stats).items()},
            **{f"context_{k}": v for k, v in asdict(cp.stats).items()},
            "micro_batch_spans": list(runner.stage_timeline.spans),
        },
    }
    while True:
        try:
            method, args, reply_all = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            os._exit(0)
        try:
            result = calls[method](*args)
        except Exception as e:  # noqa: BLE001
            logger.exception("rank %d failed in %s", rank, method)
            _report(conn, e)
            os._exit(1)
        if replies or reply_all:
            conn.send(("ok", result))


@dataclass
class StepStats:
    """This rank's steps: how many, and their seconds (execute to results on the host)."""

    steps: int = 0
    step_seconds: float = 0.0

    def add(self, start: float) -> None:
        self.steps += 1
        self.step_seconds += time.perf_counter() - start


def memory_of(setup: RankSetup) -> dict[str, int]:
    """This rank's bytes of weights and of KV cache."""
    kv = kv_cache_bytes(setup.runner.kv_caches)
    return {"weight_bytes": setup.model_config.weight_bytes, "kv_cache_bytes": kv}


def _report(conn: Connection, e: BaseException) -> None:
    try:
        conn.send(("error", (type(e).__name__, str(e))))
    except (OSError, ValueError):
        pass


def _add_lora(runner: ModelRunner, request: LoRARequest) -> str | None:
    """The adapter on this rank; an adapter that does not fit is its error's text (the rank
    goes on), not a failure."""
    if runner.lora is None:
        return "LoRA is not enabled: start the engine with --enable-lora"
    try:
        runner.lora.add(request)
    except ValueError as e:
        return str(e)
    return None
