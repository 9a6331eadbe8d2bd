"""SmolLM2's GGUF (kept Q4_1, its head int8 rows) on pagoda's CPU kernels (PAGODA_CPU_KERNELS=1):
every quantized layer holds the kernels' form and no other, every step runs on them (decode
steps on the paged decode attention too), the weights take the memory torch's forms take, and
greedy decoding gives the torch path's tokens on this prompt (the two differ only in how
activations are rounded: int8 per group of 32 against bf16)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu import built
from pagoda.layers.attention import Attention
from pagoda.layers.quant_forms import stored_bytes

pytestmark = pytest.mark.skipif(built() is None, reason="the CPU kernels cannot be built here")


def test_decode_on_the_cpu_kernels_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 228))}
    tokens, weight_bytes = {}, {}
    for enabled in ("0", "1"):
        monkeypatch.setenv("PAGODA_CPU_KERNELS", enabled)
        llm = LLM(None, num_gpu_blocks_override=64, max_model_len=512)
        modules = list(llm.engine.executor.runner.model.modules())
        forms = {getattr(m, "kernel", None) for m in modules} - {None, "float"}
        assert forms == ({"cpu_q4", "cpu_q8"} if enabled == "1" else {"int4", "int8"}), forms
        weight_bytes[enabled] = stored_bytes(llm.engine.executor.runner.model)
        attention = {m.cpu_kernel for m in modules if isinstance(m, Attention)}
        assert attention == {enabled == "1"}
        tokens[enabled] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        del llm
    assert tokens["1"] == tokens["0"]
    # one form a layer: the same codes, fp16 scale and offset pairs as torch's bf16 ones, the
    # head's row scales in float32 (torch's: bf16), 98 KB more
    assert weight_bytes["1"] <= weight_bytes["0"] + 2 * 49152 * 2
