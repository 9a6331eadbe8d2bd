"""Model-level quality of every weight and KV scheme against the float32 model of the same weights.

Over the fixed English text in tests/data/eval_text.txt (3,119 SmolLM2 tokens, written for this
suite) each scheme scores every position once (prompt logprobs): top-1 agreement is how often its
most likely next token equals float32's, perplexity is exp(mean -log p(actual next token)).

Bounds (issue 5): int8 and KV int8: agreement >= 98%, perplexity within 1%; int4, GGUF Q4 kept
native, fp8: >= 90%, within 5% (GGUF's float32 reference is the dequantized file, so only the
kernels' bf16 activations and the int8 rows of its Q8_0 embedding differ there).
The measured figures print with -s and are quoted in benchmarks/README.md.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams

TEXT = (Path(__file__).parent.parent / "data" / "eval_text.txt").read_text()

# scheme -> (engine kwargs, min top-1 agreement, max relative perplexity change)
SCHEMES: dict[str, tuple[dict[str, Any], float, float]] = {
    "gguf": ({"quantization": "gguf"}, 0.90, 0.05),
    "int8": ({"quantization": "int8"}, 0.98, 0.01),
    "int4": ({"quantization": "int4"}, 0.90, 0.05),
    "fp8": ({"quantization": "fp8"}, 0.90, 0.05),
    "kv-int8": ({"quantization": "none", "kv_cache_dtype": "int8"}, 0.98, 0.01),
    "kv-fp8": ({"quantization": "none", "kv_cache_dtype": "fp8"}, 0.90, 0.05),
}


def score(llm: LLM, ids: list[int]) -> tuple[list[int], list[float]]:
    """(most likely next token, log p(actual next token)) at every position after the first."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    top1: list[int] = []
    actual: list[float] = []
    for pos, token in zip(out.prompt_logprobs[1:], ids[1:]):
        assert pos is not None
        top1.append(next(t for t, lp in pos.items() if lp.rank == 1))
        actual.append(pos[token].logprob)
    return top1, actual


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def compare(
    make: Callable[..., LLM], ids: list[int], reference: tuple[list[int], list[float]], kwargs: dict
) -> tuple[float, float]:
    llm = make(**kwargs)
    top1, logprobs = score(llm, ids)
    del llm
    gc.collect()
    agreement = sum(a == b for a, b in zip(top1, reference[0])) / len(top1)
    ppl, ref_ppl = perplexity(logprobs), perplexity(reference[1])
    return agreement, (ppl - ref_ppl) / ref_ppl


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_tokenizer: Any) -> list[int]:
    ids = smollm2_tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 2000
    return ids


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_ids: list[int]) -> tuple[list[int], list[float]]:
    llm = LLM(None, quantization="none", max_num_batched_tokens=4096)
    ref = score(llm, smollm2_ids)
    del llm
    gc.collect()
    return ref


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_smollm2_scheme_against_float32(
    scheme: str, smollm2_ids: list[int], smollm2_reference: tuple[list[int], list[float]]
) -> None:
    kwargs, min_agreement, max_ppl_change = SCHEMES[scheme]

    def make(**kw: Any) -> LLM:
        return LLM(None, max_num_batched_tokens=4096, **kw)

    agreement, ppl_change = compare(make, smollm2_ids, smollm2_reference, kwargs)
    print(
        f"\nSmolLM2 {scheme}: top-1 agreement {agreement:.4f}, perplexity change "
        f"{ppl_change:+.4%} (float32 perplexity {perplexity(smollm2_reference[1]):.3f})"
    )
    assert agreement >= min_agreement
    assert abs(ppl_change) <= max_ppl_change


@pytest.mark.parametrize("scheme", ["int8", "int4", "kv-int8"])
def test_tiny_random_model_scheme_against_float32(
    scheme: str, tiny_model_dir: Callable[[str], str], smollm2_ids: list[int]
) -> None:
    """A random-weight model has no near-ties structure to lean on: its bounds are looser and
    stated here; the point is that each scheme runs end to end on an HF folder."""
    folder = tiny_model_dir("qwen2")
    ids = smollm2_ids[:1000]  # the tiny model's context is 1024
    reference = score(LLM(folder, quantization="none"), ids)
    kwargs = dict(SCHEMES[scheme][0])

    def make(**kw: Any) -> LLM:
        return LLM(folder, **kw)

    agreement, ppl_change = compare(make, ids, reference, kwargs)
    print(f"\ntiny qwen2 {scheme}: agreement {agreement:.4f}, perplexity change {ppl_change:+.4%}")
    # Measured: int8 0.954, kv-int8 0.979; int4 0.473 (4-bit noise on random Gaussian weights
    # against a nearly flat next-token distribution), its perplexity within 2.4%.
    assert agreement >= {"int4": 0.40}.get(scheme, 0.95)
    assert abs(ppl_change) <= {"int4": 0.05}.get(scheme, 0.02)


def test_greedy_generation_stays_fluent() -> None:
    """Fixed prompts: the first 8 greedy tokens of each scheme against float32. The count is
    printed; at least 3 of 4 prompts must agree on all 8 (measured: gguf 3, int8 3)."""
    prompts = [
        "The capital of France is",
        "Water boils at a temperature of",
        "Once upon a time, in a small village,",
        "The three primary colors are",
    ]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(**kw: Any) -> list[list[int]]:
        llm = LLM(None, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
        return [o.outputs[0].token_ids for o in outs]

    reference = run(quantization="none")
    for name, kw in [
        ("gguf", {"quantization": "gguf"}),
        ("int8", {"quantization": "int8"}),
        ("int4", {"quantization": "int4"}),
        ("kv-int8", {"kv_cache_dtype": "int8"}),
    ]:
        got = run(**kw)
        same = sum(a == b for a, b in zip(got, reference))
        print(f"\n{name}: {same}/4 prompts with the same first 8 tokens as float32")
        assert same >= 3
