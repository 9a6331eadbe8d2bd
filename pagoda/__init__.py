"""pagoda: a paged, continuously batched LLM inference engine.

The whole public Python API::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from pagoda.engine import EngineCore
from pagoda.llm import LLM
from pagoda.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pagoda.request import EngineRequest
from pagoda.sampling import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = [
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
