"""LoRA adapters per request against HF transformers with PEFT (the strict float32 oracle):
a tiny random base with random adapters of two ranks (one all-linear, one q/v with rsLoRA),
each adapter alone and all of them mixed with base requests in one batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import AdapterSpec, peft_model, save_adapter
from tests.oracle import assert_outputs_match, hf_greedy

MAX_TOKENS = 12
PROMPTS = [
    [1, 450, 2232, 310],
    [1, 910, 338, 263, 1243, 29889, 306],
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
]
SPECS = {
    "wide": AdapterSpec(rank=8, alpha=16),
    "qv": AdapterSpec(rank=16, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True, seed=1),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Callable[[str], str], tmp_path_factory: Any) -> dict[str, Any]:
    base = tiny_model_dir("llama")
    out: dict[str, Any] = {"base": base}
    for i, (name, spec) in enumerate(SPECS.items()):
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        out[name] = LoRARequest(name, i + 1, save_adapter(base, str(folder), spec))
    return out


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Any], tiny_hf_model: Any) -> dict[str, Any]:
    base = adapters["base"]
    out = {"base": hf_greedy(tiny_hf_model("llama"), PROMPTS, MAX_TOKENS)}
    for name in SPECS:
        out[name] = hf_greedy(peft_model(base, adapters[name].lora_path), PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def llm(adapters: dict[str, Any]) -> LLM:
    return LLM(
        adapters["base"],
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_batched_tokens=16,  # prompts chunk, and chunks of several requests share steps
        num_gpu_blocks_override=128,
    )


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_adapters_change_the_output(expected: dict[str, Any]) -> None:
    """Not vacuous: each adapter's greedy tokens differ from the base model's."""
    for name in SPECS:
        assert [t for t, _ in expected[name]] != [t for t, _ in expected["base"]], name


@pytest.mark.parametrize("name", ["base", *SPECS])
def test_each_adapter_alone_matches_hf_peft(
    name: str, llm: LLM, adapters: dict[str, Any], expected: dict[str, Any]
) -> None:
    lora = None if name == "base" else adapters[name]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert_outputs_match(outputs, expected[name])


def test_adapters_mixed_in_one_batch_match_hf_peft(
    llm: LLM, adapters: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Every prompt under every adapter and none, interleaved in one generate call: steps
    hold rows of both adapters and of the base model."""
    names = ["base", *SPECS]
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            prompts.append({"prompt_token_ids": prompt})
            loras.append(None if name == "base" else adapters[name])
            want.append(expected[name][i])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert_outputs_match(outputs, want)


def test_unknown_target_and_rank_are_clear_errors(
    llm: LLM, adapters: dict[str, Any], tmp_path: Path
) -> None:
    big = save_adapter(adapters["base"], str(tmp_path / "big"), AdapterSpec(rank=32, alpha=32))
    with pytest.raises(ValueError, match="rank 32, above --max-lora-rank 16"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 9, big))
    with pytest.raises(ValueError, match="not found"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 10, "/nope"))
    # the engine goes on
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:1]]
    out = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapters["wide"])
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS


def test_a_streamed_request_runs_with_its_adapter(llm: LLM, adapters: dict[str, Any]) -> None:
    """generate_stream(lora_request=...) (bench latency --enable-lora streams B1 with it): the
    same greedy tokens as generate with that adapter, one prompt alone each time."""
    prompt = {"prompt_token_ids": PROMPTS[1]}
    for name in SPECS:
        streamed = [
            t
            for out in llm.generate_stream(prompt, GREEDY, lora_request=adapters[name])
            for t in out.outputs[0].token_ids
        ]
        whole = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[name])
        assert streamed == list(whole[0].outputs[0].token_ids), name
    with pytest.raises(ValueError, match="lora_request"):
        next(llm.generate_stream(prompt, GREEDY, lora_request="wide"))  # type: ignore[arg-type]
