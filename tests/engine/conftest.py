"""Engine fixtures: one SmolLM2 engine per session (loading takes a few seconds)."""

from __future__ import annotations

import pytest

from pagoda import LLM


@pytest.fixture(scope="session")
def smollm2_llm() -> LLM:
    return LLM(None, num_gpu_blocks_override=512)
