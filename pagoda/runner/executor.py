"""The executor: what EngineCore runs its steps on, without knowing where the ranks are. One rank
in this process is a `LocalExecutor` (below); a worker process per tensor-, pipeline- or
context-parallel rank is distributed/workers.py's `WorkerGroup`; distributed/executor.py picks
one from the config. Both hold the device tensors; the engine holds none.

The KV connector's worker side is the executor's too (distributed/kv_transfer.py's KVWorker,
beside the runner's caches; distributed/executor.py's ConnectedExecutor): the engine's scheduler
side (engine/remote_prefill.py) decides which blocks to send or fetch and passes that as
KVConnectorOps; the worker side holds the data and copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pagoda.config import EngineConfig
from pagoda.kernels.paged_cache import prefault_in_background
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.loading.draft import DraftModel
from pagoda.lora_request import LoRARequest
from pagoda.model_config import ModelConfig
from pagoda.runner.builder import build_runner, profiled_kv_budget
from pagoda.runner.draft_sampling import DraftGrammar
from pagoda.runner.lora import LoRATable
from pagoda.runner.model_runner import ModelRunner
from pagoda.scheduling.messages import KVConnectorOps, KVFetchDone, RunnerOutput, SchedulerOutput
from pagoda.spec_decode.methods import draft_kv_bytes_per_token

# The KV connector scheduler side's lookup, for a fetch of blocks not staged: under the engine's
# lock, the block ids of the longest run of the hashes its prefix cache holds, given to `read`
# (which copies them) while the lock is held; [] when it holds none.
CachedBlocks = Callable[
    [list[bytes], Callable[[list[int]], list[torch.Tensor]]], list[torch.Tensor]
]


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

    def set_draft_grammar(self, masks: DraftGrammar) -> None:
        """Where a draft model samples its drafts: the structured-output masks to sample them
        under (runner/draft_sampling.py)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def profiled_kv_budget(self) -> int:
        """On CUDA: the bytes the KV cache may take after a profiling step."""
        ...

    def warm_up_kernels(self) -> None: ...

    def capture_cuda_graphs(self) -> None: ...

    def compile_decode_step(self) -> None: ...

    def execute(self, out: SchedulerOutput) -> StepOutput: ...

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter on every rank (runner/lora.py); ValueError when it does
        not fit the model, and the ranks go on."""
        ...

    def remove_lora(self, lora_id: int) -> bool: ...

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

    def start_kv_connector(self, config: KVTransferConfig, cached_blocks: CachedBlocks) -> None:
        """Start the KV connector's worker side; `cached_blocks` is the scheduler side's lookup
        for fetches of blocks not staged (distributed/kv_transfer.py)."""
        ...

    def kv_connector(self, ops: KVConnectorOps) -> list[KVFetchDone]:
        """Have the worker side do `ops`; the fetches finished, when ops.poll asks."""
        ...

    def kv_transfer_stats(self) -> dict[str, float]: ...

    def close_kv_connector(self) -> None: ...


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
        return draft_kv_bytes_per_token(self.config.speculative_config, self.draft, kv_quant)

    def set_draft_grammar(self, masks: DraftGrammar) -> None:
        step = self.runner.draft_step
        if step is not None and step.sampler is not None:
            step.sampler.grammar = masks

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

    def add_lora(self, request: LoRARequest) -> None:
        _lora_table(self.runner).add(request)

    def remove_lora(self, lora_id: int) -> bool:
        return _lora_table(self.runner).remove(lora_id)

    def check_health(self) -> None:
        return None  # this process runs the steps: its failures raise in execute

    def shutdown(self) -> None:
        return None  # nothing runs beside this process

    def step_totals(self) -> tuple[list[int], list[float]] | None:
        return None

    def rank_stats(self) -> list[dict[str, Any]] | None:
        return None

    # Without --kv-transfer-config there is no KV connector (distributed/executor.py's
    # ConnectedExecutor has one), and the engine starts none.
    def start_kv_connector(self, config: KVTransferConfig, cached_blocks: CachedBlocks) -> None:
        raise ValueError("this executor has no KV connector: use ConnectedExecutor")

    def kv_connector(self, ops: KVConnectorOps) -> list[KVFetchDone]:
        raise ValueError("this executor has no KV connector")

    def kv_transfer_stats(self) -> dict[str, float]:
        return {}

    def close_kv_connector(self) -> None:
        return None


def _lora_table(runner: ModelRunner) -> LoRATable:
    if runner.lora is None:
        raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
    return runner.lora
