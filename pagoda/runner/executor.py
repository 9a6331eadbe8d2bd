"""The executor: what EngineCore runs its steps on, without knowing where the ranks are. One rank
in this process is a `LocalExecutor` (below); a worker process per tensor-, pipeline- or
context-parallel rank is distributed/workers.py's `WorkerGroup`; distributed/executor.py picks
one from the config. Both hold the device tensors; the engine holds none.

The KV connector's worker side is here too (kv_layout, read_blocks, write_blocks): the engine's
side (engine/remote_prefill.py) decides which blocks to send or fetch, the executor copies them
out of and into its caches, as host tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pagoda.config import EngineConfig
from pagoda.kernels.paged_cache import (
    Layout,
    cache_layout,
    gather_blocks,
    prefault_in_background,
    scatter_blocks,
)
from pagoda.loading.draft import DraftModel
from pagoda.model_config import ModelConfig
from pagoda.runner.builder import build_runner, profiled_kv_budget
from pagoda.runner.model_runner import ModelRunner
from pagoda.scheduling.messages import RunnerOutput, SchedulerOutput
from pagoda.spec_decode.methods import spec_method


class StepOutput(Protocol):
    def get(self) -> RunnerOutput:
        """The step's results, waiting for them if they are not there yet."""
        ...


class Executor(Protocol):
    model_config: ModelConfig
    eos_token_ids: frozenset[int]
    tokenizer: Any  # None where the engine's client tokenizes, or skip_tokenizer_init
    draft: DraftModel | None  # speculative decoding's draft model, beside the target

    def draft_kv_bytes_per_token(self, kv_quant: str | None) -> int:
        """Bytes per token of a draft model's own KV cache, sized beside the target's."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def profiled_kv_budget(self) -> int:
        """On CUDA: the bytes the KV cache may take after a profiling step."""
        ...

    def warm_up_kernels(self) -> None: ...

    def capture_cuda_graphs(self) -> None: ...

    def compile_decode_step(self) -> None: ...

    def execute(self, out: SchedulerOutput) -> StepOutput: ...

    def check_health(self) -> None:
        """RuntimeError where a rank has died."""
        ...

    def shutdown(self) -> None: ...

    def step_totals(self) -> tuple[list[int], list[float]] | None:
        """Each rank's steps and step seconds since start; None in one process."""
        ...

    def rank_stats(self) -> list[dict[str, Any]] | None:
        """Each rank's step, collective and memory totals; None in one process."""
        ...

    def kv_layout(self) -> Layout:
        """(dtype, shape of a block) of each cache tensor, as read_blocks gives them."""
        ...

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Host copies of the blocks, one tensor (len(block_ids), ...) per cache tensor."""
        ...

    def write_blocks(self, block_ids: list[int], data: Sequence[torch.Tensor]) -> None:
        """read_blocks' tensors (their first len(block_ids) blocks) into these blocks."""
        ...


class LocalExecutor:
    """One rank in this process: the ModelRunner build_runner makes (`runner`), its model, the
    tokenizer and a draft model."""

    def __init__(self, config: EngineConfig, load_tokenizer: bool) -> None:
        setup = build_runner(config, load_tokenizer=load_tokenizer)
        self.config = config
        self.runner: ModelRunner = setup.runner
        self.model_config = setup.model_config
        self.eos_token_ids = setup.eos_token_ids
        self.tokenizer: Any = setup.tokenizer
        self.draft = setup.draft

    def draft_kv_bytes_per_token(self, kv_quant: str | None) -> int:
        spec = self.config.speculative_config
        if spec is None:
            return 0
        return spec_method(spec).draft_kv_bytes_per_token(self.draft, kv_quant)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        prefault_in_background(self.runner.kv_caches)  # CPU: resident from the start

    def profiled_kv_budget(self) -> int:
        return profiled_kv_budget(self.runner, self.config)

    def warm_up_kernels(self) -> None:
        self.runner.warm_up_kernels()

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def compile_decode_step(self) -> None:
        self.runner.compile_decode_step()

    def execute(self, out: SchedulerOutput) -> StepOutput:
        return self.runner.execute(out)

    def check_health(self) -> None:
        return None  # this process runs the steps: its failures raise in execute

    def shutdown(self) -> None:
        return None  # nothing runs beside this process

    def step_totals(self) -> tuple[list[int], list[float]] | None:
        return None

    def rank_stats(self) -> list[dict[str, Any]] | None:
        return None

    def kv_layout(self) -> Layout:
        return cache_layout(self.runner.kv_caches)

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        return gather_blocks(self.runner.kv_caches, block_ids)

    def write_blocks(self, block_ids: list[int], data: Sequence[torch.Tensor]) -> None:
        scatter_blocks(self.runner.kv_caches, block_ids, data)
