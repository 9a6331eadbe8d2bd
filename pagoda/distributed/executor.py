"""The engine's executor for a config: a worker process per rank when it asks for more than one
(tensor x pipeline x prefill context parallel sizes), else the one rank in this process, with
the KV connector's worker side beside its caches when the config has --kv-transfer-config."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from pagoda.config import EngineConfig
from pagoda.distributed.workers import WorkerGroup
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.runner.executor import CachedBlocks, Executor, LocalExecutor
from pagoda.scheduling.messages import KVConnectorOps, KVFetchDone

if TYPE_CHECKING:
    from pagoda.distributed.kv_transfer import KVWorker


def make_executor(config: EngineConfig, load_tokenizer: bool) -> Executor:
    """Without `load_tokenizer` (the engine process: its client tokenizes) the executor's
    tokenizer is None and only the tokenizer's EOS id is read (runner/builder.py)."""
    if config.world_size > 1:
        return WorkerGroup(config, load_tokenizer)
    if config.kv_transfer_config is not None:
        return ConnectedExecutor(config, load_tokenizer)
    return LocalExecutor(config, load_tokenizer)


class ConnectedExecutor(LocalExecutor):
    """One rank in this process with the KV connector's worker side (`kv_worker`), which
    holds the transport and the blocks' data and copies them out of and into the runner's
    caches as the scheduler side's KVConnectorOps say."""

    kv_worker: KVWorker | None = None

    def start_kv_connector(self, config: KVTransferConfig, cached_blocks: CachedBlocks) -> None:
        # Imported here: ZeroMQ is the server's dependency, not the engine's (the GPU
        # machine's benchmarks run the engine without it).
        from pagoda.distributed.kv_transfer import KVWorker

        self.kv_worker = KVWorker(config, self.runner.kv_caches, cached_blocks)

    def kv_connector(self, ops: KVConnectorOps) -> list[KVFetchDone]:
        assert self.kv_worker is not None, "start_kv_connector first"
        return self.kv_worker.apply(ops)

    def kv_transfer_stats(self) -> dict[str, float]:
        return {} if self.kv_worker is None else asdict(self.kv_worker.stats)

    def close_kv_connector(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.close()
