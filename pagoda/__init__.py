"""pagoda: a paged, continuously batched LLM inference engine.

The whole public Python API::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagoda.lora_request import LoRARequest
from pagoda.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooler_config import PoolerConfig, PoolingParams
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.scheduling.messages import EngineRequest
from pagoda.version import __version__

if TYPE_CHECKING:
    from pagoda.client.llm import LLM
    from pagoda.engine.core import EngineCore

# Imported on first use: they bring in torch (seconds), which processes that never run the model
# (the API server of `pagoda serve`, the proxy, the CLI's parser) do without.
_LAZY = {"LLM": "pagoda.client.llm", "EngineCore": "pagoda.engine.core"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")


__all__ = [
    "__version__",
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineCore",
    "EngineRequest",
    "Logprob",
    "LoRARequest",
    "PoolerConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
]
