"""Engine fixtures: one SmolLM2 engine per session (loading takes a few seconds)."""

from __future__ import annotations

import pytest

from pagoda import LLM


@pytest.fixture(scope="session")
def smollm2_llm() -> LLM:
    # float32: the engine tests compare it with HF transformers token for token
    return LLM(None, quantization="none", num_gpu_blocks_override=512)


@pytest.fixture(scope="session")
def smollm2_o2_llm(smollm2_path: str) -> LLM:
    """SmolLM2's GGUF (kept quantized) with compiled decode steps (-O2): compiling takes most of
    a minute on 2 cores, so the tests that need this engine plainly share one."""
    llm = LLM(smollm2_path, optimization_level=2, max_model_len=512, num_gpu_blocks_override=256)
    assert llm.engine.executor.runner.compiled is not None
    return llm
