"""Tensor parallelism inside the layers: which slice of each weight a rank holds, and the two
collectives that put the slices' results together (torch.distributed: gloo on CPU, NCCL on CUDA).

A rank holds 1/N of every projection (Megatron's split, as vLLM does it):

    column-parallel (q/k/v, gate/up):          output rows split; no collective after it
    row-parallel (o_proj, down_proj):          input columns split; all-reduce of the partial sums
    vocab-parallel embedding:                   vocabulary rows split; all-reduce of the rows
    LM head:                                    vocabulary rows split; all-gather of the logits

So each layer runs two all-reduces. Attention splits by whole GQA groups while there are at
least N kv heads (TensorParallel.heads); with fewer, each rank keeps the one kv head its query
heads read, so kv heads are replicated N / num_kv_heads times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    """What this rank's collectives cost: calls, bytes sent in, seconds inside the calls (the
    whole exchange with gloo on CPU; with NCCL on CUDA only the launch, which is asynchronous)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, x: torch.Tensor, start: float) -> None:
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        self.seconds += time.perf_counter() - start


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group. size 1: no group, no collective."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup of the ranks
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def part(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total`; ValueError if it does not
        divide."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} must divide {what} ({total}); "
                "choose a size that divides it"
            )
        length = total // self.size
        return self.rank * length, length

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((first query head, query heads), (first kv head, kv heads)) of this rank.

        With at least `size` kv heads, each rank takes whole GQA groups (a kv head and the query
        heads that read it), as evenly as they go: SmolLM2's 3 kv heads over 2 ranks are 2 + 1
        (6 + 3 query heads), where vLLM would refuse the size. With fewer, query heads split
        evenly and each rank keeps the one kv head they read, replicated size / num_kv_heads
        times."""
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads}")
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            base, extra = divmod(num_kv_heads, self.size)
            first = self.rank * base + min(self.rank, extra)
            count = base + (1 if self.rank < extra else 0)
            return (first * group, count * group), (first, count)
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} must be a multiple of the number of key/value "
                f"heads ({num_kv_heads}) when it exceeds it"
            )
        q_part = self.part(num_heads, "the number of attention heads")
        return q_part, (self.rank // (self.size // num_kv_heads), 1)

    def vocab_part(self, vocab_size: int) -> tuple[int, int]:
        """(start, length) of this rank's vocabulary rows: ceil(V / size) each, the last rank
        fewer (possibly none) when size does not divide V."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(per_rank, vocab_size - start)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place; identical on every rank."""
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self.stats.add(x, start)
        return x

    def all_gather_last(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, then keep the first `total`
        columns. x: (n, ceil(total / size)) on every rank (the last rank's padded)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.stats.add(x, start)
        return torch.cat(parts, dim=-1)[..., :total]


SINGLE = TensorParallel()


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage of the pipeline: a contiguous run of decoder layers. The first stage
    also holds the embedding, the last the final norm and the LM head. Between stages the
    residual stream passes as one (2, num_tokens, hidden_size) tensor (the hidden states and
    the residual, so the next stage computes exactly what one process would), sent
    point-to-point to the same tensor-parallel rank of the next stage. size 1: the whole model.

    `peer_offset` is the distance in global ranks between stages (the tensor-parallel size)."""

    rank: int = 0
    size: int = 1
    global_rank: int = 0
    peer_offset: int = 1
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers: num_layers // size each, the remainder one each
        to the stages before the last (the last also runs the LM head), as vLLM splits them."""
        if num_layers < self.size:
            raise ValueError(
                f"pipeline_parallel_size={self.size} exceeds the model's {num_layers} layers"
            )
        counts = [num_layers // self.size] * self.size
        for i in range(num_layers % self.size):
            counts[-2 - i] += 1
        start = sum(counts[: self.rank])
        return start, start + counts[self.rank]

    def send(self, x: torch.Tensor) -> Any:
        """Start sending x to the next stage; returns the request to wait() on (x must live
        until then)."""
        start = time.perf_counter()
        work = dist.isend(x.contiguous(), self.global_rank + self.peer_offset)
        self.stats.add(x, start)
        return work

    def receive(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The tensor the previous stage sent next (in the order it sent them). Its seconds
        include the wait for that stage: the pipeline's bubble, as this stage sees it."""
        start = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.global_rank - self.peer_offset)
        self.stats.add(x, start)
        return x


WHOLE_MODEL = PipelineStage()


@dataclass(frozen=True)
class ContextParallel:
    """This process's place among the prefill-context-parallel ranks (layers/context_parallel.py):
    each holds the whole model and 1/size of every request's KV cache (the positions p with
    p % size == rank). size 1: no group, no collective."""

    rank: int = 0
    size: int = 1
    group: Any = None
    stats: CollectiveStats = field(default_factory=CollectiveStats, compare=False)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order (x has the same shape on every rank)."""
        if self.size == 1:
            return [x]
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.stats.add(x, start)
        return parts


NO_CONTEXT_PARALLEL = ContextParallel()
