"""The engine's executor for a config: a worker process per rank when it asks for more than one
(tensor x pipeline x prefill context parallel sizes), else the one rank in this process."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.distributed.workers import WorkerGroup
from pagoda.runner.executor import Executor, LocalExecutor


def make_executor(config: EngineConfig, load_tokenizer: bool) -> Executor:
    """Without `load_tokenizer` (the engine process: its client tokenizes) the executor's
    tokenizer is None and only the tokenizer's EOS id is read (runner/builder.py)."""
    if config.world_size > 1:
        return WorkerGroup(config, load_tokenizer)
    return LocalExecutor(config, load_tokenizer)
