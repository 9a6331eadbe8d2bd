"""pagoda: a paged, continuously batched LLM inference engine.

The whole public Python API::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from pagoda.client.llm import LLM
from pagoda.engine.core import EngineCore
from pagoda.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.scheduling.messages import EngineRequest
from pagoda.version import __version__

__all__ = [
    "__version__",
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineCore",
    "EngineRequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
