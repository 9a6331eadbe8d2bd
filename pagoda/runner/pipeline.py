"""One step of a pipeline stage (layers/parallel.PipelineStage): the step's requests run as
micro-batches, so that the stages overlap.

    stage 0:  [mb 0][mb 1]             each stage sends a micro-batch's stream on (non-blocking)
    stage 1:        [mb 0][mb 1]       as soon as it is done, then starts the next one

A micro-batch is a contiguous run of the step's requests (about equal tokens each), prepared
and attended on its own: its requests' KV reads and writes touch only their own blocks, so
running them apart computes what the whole batch computes. The last stage puts the micro-batches'
final hidden states back together in the step's order; the runner then samples them as it does
one process's.

Micro-batches split one step, so a lone request (B1 decode) runs as one, and the bubble
(S - 1 of S + M - 1 slots) is not filled by the next step: the scheduler's next step needs the
tokens this one samples (vLLM fills it with several batches in flight across steps).
"""

from __future__ import annotations

import time
from collections import deque
from itertools import accumulate
from typing import Any, Protocol

import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import forward_context
from pagoda.layers.parallel import PipelineStage
from pagoda.model_config import ModelConfig
from pagoda.models.interface import CausalLM
from pagoda.runner.input_batch import InputBatch
from pagoda.runner.step_inputs import InputBuffers


class StageTimeline:
    """When this stage computed each micro-batch of its recent steps: (step, micro-batch, start,
    end) in time.monotonic() seconds, a clock all the machine's processes share; a stage's span
    starts once its input arrived. The ranks report it in their stats, so the overlap of the
    stages can be read off (stage 0's micro-batch k + 1 beside stage 1's k)."""

    def __init__(self, keep: int = 256) -> None:
        self.steps = 0
        self.spans: deque[tuple[int, int, float, float]] = deque(maxlen=keep)


class StageRunner(Protocol):
    """What a step of a stage reads of its runner (model_runner.ModelRunner)."""

    pp: PipelineStage
    model: CausalLM
    model_config: ModelConfig
    batch: InputBatch
    buffers: InputBuffers
    block_size: int
    kv_caches: list[KVCache]
    device: torch.device
    num_micro_batches: int
    stage_timeline: StageTimeline

    def decode_num_splits(self, num_decodes: int) -> int: ...


def micro_batches(num_tokens: list[int], count: int) -> list[range]:
    """Split requests (their token counts, in step order) into at most `count` contiguous,
    non-empty runs of about equal tokens."""
    count = min(count, len(num_tokens))
    total = sum(num_tokens)
    before = [0, *accumulate(num_tokens)]  # tokens of requests [0, i)
    bounds = [0]
    for k in range(1, count):
        i = bounds[-1] + 1
        while i < len(num_tokens) - (count - k) and before[i] < total * k / count:
            i += 1
        bounds.append(i)
    bounds.append(len(num_tokens))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def pipelined_forward(
    runner: StageRunner, rids: list[str], token_ids: list[list[int]], seq_lens: list[int]
) -> torch.Tensor | None:
    """This stage's layers over the step's micro-batches. The last stage returns the final
    hidden states (num_tokens, hidden_size) in the step's order; the others None."""
    pp, model = runner.pp, runner.model
    config = runner.model_config
    tables = runner.batch.block_tables(rids, seq_lens, runner.block_size)
    hidden_size, dtype = int(config.hf_config.hidden_size), getattr(torch, config.dtype)
    outputs: list[torch.Tensor] = []
    sends: list[tuple[Any, torch.Tensor]] = []  # each send and the tensor it reads
    timeline = runner.stage_timeline
    timeline.steps += 1
    groups = micro_batches([len(t) for t in token_ids], runner.num_micro_batches)
    for index, group in enumerate(groups):
        group_ids = [token_ids[i] for i in group]
        num_decodes = sum(len(t) == 1 for t in group_ids)
        ids, pos, meta = runner.buffers.prepare(
            group_ids,
            seq_lens[group.start : group.stop],
            tables[group.start : group.stop],
            runner.block_size,
            decode_num_splits=runner.decode_num_splits(num_decodes),
        )
        stream = None
        if not pp.is_first:
            stream = pp.receive((2, meta.num_tokens, hidden_size), dtype, runner.device)
        start = time.monotonic()
        with forward_context(meta, runner.kv_caches):
            result = model(ids, pos, stream)
        timeline.spans.append((timeline.steps, index, start, time.monotonic()))
        if pp.is_last:
            outputs.append(result)
        else:
            sends.append((pp.send(result), result))
    for work, _ in sends:
        work.wait()
    return torch.cat(outputs) if pp.is_last else None
