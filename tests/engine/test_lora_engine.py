"""LoRA with the rest of the engine: requests of two adapters and of none in the same steps,
against the same requests under another schedule (one adapter slot: max_loras=1), on two
tensor-parallel ranks, with n-gram speculation and with compiled decode steps; structured
outputs under an adapter; prefix caching that never shares KV blocks between adapters."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.outputs import RequestOutput
from pagoda.structured_outputs import StructuredOutputsParams
from tests.engine.test_scheduling_invariance import _params, _prompts
from tests.equivalence import assert_same_outputs
from tests.lora_adapters import AdapterSpec, save_adapter

PROMPTS = _prompts(9, seed=5, shared_prefix=16)
PARAMS = _params(len(PROMPTS))
# Small steps and a small pool: prompts chunk, steps mix adapters, requests are preempted.
ENGINE: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    max_num_batched_tokens=32,
    num_gpu_blocks_override=20,
    block_size=8,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
)


@pytest.fixture(scope="module")
def base(tiny_weights_dir: Callable[[str], str]) -> str:
    return tiny_weights_dir("llama")


@pytest.fixture(scope="module")
def loras(base: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest | None]:
    """Per prompt: none, adapter 1 (all linear, rank 8), adapter 2 (q/v/o, rank 4), in turn."""
    specs = [
        AdapterSpec(rank=8, alpha=16, seed=11),
        AdapterSpec(rank=4, alpha=4, targets=("q_proj", "v_proj", "o_proj"), seed=12),
    ]
    adapters: list[LoRARequest | None] = [None]
    for i, spec in enumerate(specs):
        folder = str(tmp_path_factory.mktemp(f"lora{i}"))
        adapters.append(LoRARequest(f"a{i + 1}", i + 1, save_adapter(base, folder, spec)))
    return [adapters[i % 3] for i in range(len(PROMPTS))]


def _run(llm: LLM, loras: list[LoRARequest | None]) -> list[RequestOutput]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)


@pytest.fixture(scope="module")
def reference(base: str, loras: list[LoRARequest | None]) -> list[RequestOutput]:
    return _run(LLM(base, **ENGINE), loras)


def test_adapters_change_the_outputs(
    base: str, loras: list[LoRARequest | None], reference: list[RequestOutput]
) -> None:
    plain = _run(LLM(base, **{**ENGINE, "enable_lora": False}), [None] * len(PROMPTS))
    for i, lora in enumerate(loras):
        same = plain[i].outputs[0].token_ids == reference[i].outputs[0].token_ids
        assert same == (lora is None), (i, lora)


def test_one_slot_serves_the_adapters_in_turn(
    base: str, loras: list[LoRARequest | None], reference: list[RequestOutput]
) -> None:
    """max_loras=1: the scheduler runs one adapter's requests at a time (the base model's
    beside them) and the slot is reloaded as adapters take turns; outputs are unchanged."""
    llm = LLM(base, **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1})
    assert_same_outputs(_run(llm, loras), reference)
    table = llm.engine.executor.runner.lora
    assert table is not None and len(table.slot_ids) == 1


def test_tp2_with_adapters_equals_one_rank(
    base: str, loras: list[LoRARequest | None], reference: list[RequestOutput]
) -> None:
    llm = LLM(base, tensor_parallel_size=2, **ENGINE)
    assert_same_outputs(_run(llm, loras), reference)
    llm.engine.shutdown()


def test_ngram_speculation_with_adapters(
    base: str, loras: list[LoRARequest | None], reference: list[RequestOutput]
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(base, speculative_config=spec, **ENGINE)
    assert_same_outputs(_run(llm, loras), reference)
    assert llm.engine.stats().spec_num_drafts > 0


def test_compiled_decode_with_adapters(
    base: str, loras: list[LoRARequest | None], reference: list[RequestOutput]
) -> None:
    llm = LLM(base, optimization_level=1, **ENGINE)
    assert llm.engine.executor.runner.compiled is not None
    assert_same_outputs(_run(llm, loras), reference)


def test_structured_outputs_under_an_adapter(
    tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tiny_model_dir("llama")
    path = save_adapter(folder, str(tmp_path_factory.mktemp("so")), AdapterSpec(rank=8, alpha=16))
    llm = LLM(folder, enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=64)
    # a regex: the tiny random model would fill a JSON schema's whitespace until max_tokens
    regex = r'\{"n": [0-9]{1,3}\}'
    params = SamplingParams(
        max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    lora = LoRARequest("so", 1, path)
    out = llm.generate("A JSON object:", params, use_tqdm=False, lora_request=lora)[0]
    assert isinstance(json.loads(out.outputs[0].text)["n"], int)


def test_prefix_cache_is_never_shared_between_adapters(
    base: str, loras: list[LoRARequest | None]
) -> None:
    llm = LLM(base, **ENGINE)
    adapters = [lora for lora in loras[:3]]  # none, a1, a2
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    full_blocks = (len(PROMPTS[0]) - 1) // 8 * 8
    assert [cached(lora) for lora in adapters] == [0, 0, 0]  # each computes its own blocks
    assert [cached(lora) for lora in adapters] == [full_blocks] * 3  # and hits only its own
