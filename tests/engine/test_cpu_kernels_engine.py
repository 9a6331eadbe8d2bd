"""SmolLM2's GGUF (kept Q4_1, its head int8 rows) on pagoda's CPU kernels (PAGODA_CPU_KERNELS=1):
every quantized layer carries the kernels' form, decode steps run on them and on the paged
decode attention, and greedy decoding gives the torch path's tokens on this prompt (the two
differ only in how activations are rounded: int8 per group of 32 against bf16)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu import built
from pagoda.layers.attention import Attention

pytestmark = pytest.mark.skipif(built() is None, reason="the CPU kernels cannot be built here")


def test_decode_on_the_cpu_kernels_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 228))}
    tokens = {}
    for enabled in ("0", "1"):
        monkeypatch.setenv("PAGODA_CPU_KERNELS", enabled)
        llm = LLM(None, num_gpu_blocks_override=64, max_model_len=512)
        modules = list(llm.engine.runner.model.modules())
        forms = {getattr(m, "cpu_form", None) for m in modules}
        assert ({"q4", "q8"} <= forms) == (enabled == "1"), forms
        attention = {m.cpu_kernel for m in modules if isinstance(m, Attention)}
        assert attention == {enabled == "1"}
        tokens[enabled] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        del llm
    assert tokens["1"] == tokens["0"]
