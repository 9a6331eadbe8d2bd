"""SmolLM2's GGUF (kept Q4_1, its head int8 rows) on pagoda's CPU kernels (PAGODA_CPU_KERNELS=1):
every quantized layer holds the kernels' form and no other, every step runs on them (decode
steps on the paged decode attention too), the weights take the memory torch's forms take, and
the kernels' decoding, teacher-forced to the torch path's greedy tokens (tests/oracle.py, rule
6), gives the torch path's log-probs and top-1 tokens within what the two paths' rounding
allows: they differ in how activations are rounded (int8 per group of 32 against bf16), and the
torch path's logits are bf16."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu import built
from pagoda.layers.attention import Attention
from pagoda.layers.quant_forms import stored_bytes
from tests.oracle import BF16_LOGPROB_ATOL, assert_forced_match, expected_from, forced_logprobs

pytestmark = pytest.mark.skipif(built() is None, reason="the CPU kernels cannot be built here")

TEXTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "import numpy as np\n",
    "The quick brown fox",
    "In 1969, astronauts",
    "A list of prime numbers: 2, 3, 5,",
]
STEPS = 48
TOP = 5
# The torch path's log-probs are bf16 logits less their log-sum-exp: BF16_LOGPROB_ATOL (0.25) of
# rounding on its side. The kernels' int8 activations (a step of max|x| / 127 in each group of
# 32, where bf16 rounds each value to 8 bits) move a log-prob as far again: against HF's float32
# on these prompts, forced, at most 0.375 on the kernels and 0.179 on the torch path (AVX2, Zen
# 3). Measured here between the two: at most 0.341.
LOGPROB_ATOL = 2 * BF16_LOGPROB_ATOL
# A gap of two log-probs takes the errors of both: twice the kernels' worst against float32
# above. Measured here: gaps of 0 to 0.5 at 21 of 528 steps, in multiples of 1/16 (the torch
# path's bf16 logits).
TIE_GAP = 0.75


def _llm(monkeypatch: pytest.MonkeyPatch, enabled: str) -> LLM:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", enabled)
    llm = LLM(None, num_gpu_blocks_override=64, max_model_len=512)
    modules = list(llm.engine.executor.runner.model.modules())
    forms = {getattr(m, "kernel", None) for m in modules} - {None, "float"}
    assert forms == ({"cpu_q4", "cpu_q8"} if enabled == "1" else {"int4", "int8"}), forms
    attention = {m.cpu_kernel for m in modules if isinstance(m, Attention)}
    assert attention == {enabled == "1"}
    return llm


def test_decode_on_the_cpu_kernels_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_path = _llm(monkeypatch, "0")
    tokenizer = torch_path.get_tokenizer()
    # the text prompts and 128 tokens of no language
    prompts = [tokenizer.encode(t) for t in TEXTS] + [list(range(100, 228))]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP)
    batch = [{"prompt_token_ids": p} for p in prompts]
    reference = torch_path.generate(batch, params, use_tqdm=False)
    vocab_size = len(tokenizer)
    torch_bytes = stored_bytes(torch_path.engine.executor.runner.model)
    del torch_path

    kernels = _llm(monkeypatch, "1")
    forced = [o.outputs[0].token_ids for o in reference]
    outs = forced_logprobs(kernels, prompts, forced, TOP)
    assert_forced_match(
        outs, expected_from(reference, vocab_size), tie_gap=TIE_GAP, logprob_atol=LOGPROB_ATOL
    )
    # one form a layer: the same codes, fp16 scale and offset pairs as torch's bf16 ones, the
    # head's row scales in float32 (torch's: bf16), 98 KB more
    assert stored_bytes(kernels.engine.executor.runner.model) <= torch_bytes + 2 * 49152 * 2
