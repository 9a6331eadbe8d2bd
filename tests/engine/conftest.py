"""Engine fixtures: one SmolLM2 engine per session (loading takes a few seconds)."""

from __future__ import annotations

import pytest

from pagoda import LLM


@pytest.fixture(scope="session")
def smollm2_llm() -> LLM:
    # float32: the engine tests compare it with HF transformers token for token
    return LLM(None, quantization="none", num_gpu_blocks_override=512)
