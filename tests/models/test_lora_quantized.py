"""A float LoRA adapter on the GGUF base kept quantized (SmolLM2's Q4_1 on pagoda's kernels)
stays within the quantized base's quality bound: scored against the float32 model of the same
weights with the same adapter, over the first FAST_TOKENS positions of the evaluation text, as
tests/models/test_quant_quality.py scores the base alone (top-1 agreement, perplexity)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, LoRARequest
from tests.lora_adapters import AdapterSpec, lora_scores, save_adapter_for_config
from tests.models.test_quant_quality import (
    ENGINE_ARGS,
    FAST_BOUNDS,
    FAST_TOKENS,
    Scores,
    compare,
    perplexity,
)

LORA_ARGS: dict[str, Any] = dict(enable_lora=True, max_loras=1, max_lora_rank=16)


@pytest.fixture(scope="module")
def adapter(smollm2_hf: Any, tmp_path_factory: pytest.TempPathFactory) -> LoRARequest:
    """A rank-16 all-linear adapter, small enough to keep the model fluent (std 0.03: B A
    moves each weight by about a tenth of its own size)."""
    folder = Path(tmp_path_factory.mktemp("smollm2-lora"))
    spec = AdapterSpec(rank=16, alpha=32, seed=7)
    return LoRARequest(
        "smol", 1, save_adapter_for_config(smollm2_hf.config, str(folder), spec, std=0.03)
    )


@pytest.fixture(scope="module")
def ids(smollm2_tokenizer: Any) -> list[int]:
    from tests.models.test_quant_quality import TEXT

    return list(smollm2_tokenizer(TEXT)["input_ids"][: FAST_TOKENS + 1])


@pytest.fixture(scope="module")
def float_scores(adapter: LoRARequest, ids: list[int]) -> Iterator[tuple[Scores, Scores]]:
    """The float32 model's scores without and with the adapter."""
    llm = LLM(None, quantization="none", **ENGINE_ARGS, **LORA_ARGS)
    yield lora_scores(llm, ids, None), lora_scores(llm, ids, adapter)
    del llm
    gc.collect()


def test_gguf_base_with_a_float_adapter_stays_within_the_gguf_bound(
    adapter: LoRARequest, ids: list[int], float_scores: tuple[Scores, Scores]
) -> None:
    base, tuned = float_scores
    shift, _ = compare(tuned, base)
    assert shift < 0.95, "the adapter should change the model's predictions"
    llm = LLM(None, quantization="gguf", **ENGINE_ARGS, **LORA_ARGS)
    agreement, ppl_change = compare(lora_scores(llm, ids, adapter), tuned)
    base_agreement, base_change = compare(lora_scores(llm, ids, None), base)
    print(
        f"\nSmolLM2 Q4_1 + adapter vs float32 + adapter: top-1 agreement {agreement:.4f}, "
        f"perplexity change {ppl_change:+.4%} (float32 + adapter perplexity "
        f"{perplexity(tuned[1]):.3f}; base alone {base_agreement:.4f} / {base_change:+.4%}; "
        f"the adapter moved float32's top-1 on {1 - shift:.2%} of positions)"
    )
    min_agreement, max_change = FAST_BOUNDS["gguf"]
    assert agreement >= min_agreement
    assert abs(ppl_change) <= max_change
