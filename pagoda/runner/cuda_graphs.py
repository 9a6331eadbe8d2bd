"""Capture and replay of pure-decode batches as CUDA graphs; eager stays the reference.

A decode step of B requests replays the graph captured for the smallest size >= B in the
ladder 1, 2, 4, 8, 16, 24, ... (steps of 8 up to max_num_seqs, at most 512); rows B.. of that
size are padding (slot -1: no KV write; seq_len 0: no KV read). Graphs are captured over views of
the runner's persistent input buffers (forward_context.InputBuffers) and write the step's
`DecodeOutput` (the hidden states; for sizes up to LOGITS_IN_GRAPH_MAX also the LM head's logits
and their argmax, which a greedy batch samples) into static outputs, so a replay needs nothing but
the inputs the runner already placed there. Prefill, mixed and oversize batches run eagerly.

Contract that makes replay equal eager: the captured forward launches only device work (no host
sync, no host value derived from the batch), and the decode split-K factor depends only on the
padded size, so an eager step of the same size runs the same kernels on the same shapes.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import forward_context
from pagoda.runner.step_inputs import InputBuffers

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# Decode batches up to this size also run the LM head and argmax inside the graph. Each size
# keeps its (size, vocab) logits as a static output: 87 rows in all (26 MB for a 152k vocab).
LOGITS_IN_GRAPH_MAX = 32


class DecodeOutput(NamedTuple):
    """What a pure-decode step's forward leaves for sampling; rows past the batch are padding."""

    hidden: torch.Tensor  # (size, hidden_size)
    logits: torch.Tensor | None  # (size, vocab) in the model's dtype, when size <= the limit
    greedy: torch.Tensor | None  # (size,) int64 argmax of logits


DecodeBody = Callable[[torch.Tensor, torch.Tensor], DecodeOutput]  # (input ids, positions)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, then multiples of 8, ending at min(max_num_seqs, 512)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size >= num_reqs, or None when the batch is larger than all."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        body: DecodeBody,
        kv_caches: list[KVCache],
        buffers: InputBuffers,
        block_size: int,
        sizes: list[int],
        num_splits: Callable[[int], int],
    ) -> None:
        """body: the step's device work (the runner's decode_body); sizes: the batch sizes to
        capture (capture_sizes); num_splits: the decode split-K factor of a batch size."""
        self.body = body
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = block_size
        self.sizes = sizes
        self.num_splits = num_splits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeOutput] = {}  # size -> its static outputs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            # An all-padding batch: the launches do not depend on the values, only on shapes.
            ids, pos, meta = self.buffers.prepare(
                [],
                [],
                [],
                self.block_size,
                pad_to=size,
                full_width=True,
                decode_num_splits=self.num_splits(size),
            )
            with forward_context(meta, self.kv_caches):
                for _ in range(2):  # compiles the triton kernels, settles the allocator
                    self.body(ids, pos)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.body(ids, pos)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def replay(self, size: int) -> DecodeOutput:
        """Run the graph of `size` on the inputs now in the buffers."""
        self.graphs[size].replay()
        return self.outputs[size]
