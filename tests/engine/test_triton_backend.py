"""The triton kernel backend end to end on CPU, in Triton's interpreter: greedy tokens of the
tiny models equal HF's (near-tie rules of tests/oracle.py) with chunked prefills mixed with
decodes, and decode batches padded to the CUDA-graph sizes (the eager reference of a graph
replay), under async scheduling, give the same.
tests/gpu/ runs the same kernels compiled, with graphs captured."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.runner.cuda_graphs import capture_sizes
from tests.oracle import assert_outputs_match, hf_greedy

PROMPTS = [[(7 * i + 3 * j) % 1000 + 5 for j in range(3 + 4 * i)] for i in range(5)]
MAX_TOKENS = 10


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _triton_llm(path: str, **kwargs: Any) -> LLM:
    return LLM(
        path,
        quantization="none",
        attention_backend="triton",
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_batched_tokens=16,  # prompts arrive in chunks beside other requests' decodes
        max_model_len=32,  # 8 blocks a sequence: at most 8 decode splits (interpreter time)
        **kwargs,
    )


# llama (llama3 rope scaling) runs in the padded test below; qwen3 adds the per-head q/k norm.
# qwen2 differs from llama only in its q/k/v biases, which no Triton kernel sees: slow only.
@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_triton_backend_greedy_matches_hf(arch: str, tiny_model_dir: Any, tiny_hf_model: Any):
    llm = _triton_llm(tiny_model_dir(arch))
    assert llm.engine.runner.kernel_backend == "triton"
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], _greedy())
    expected = hf_greedy(tiny_hf_model(arch), PROMPTS, MAX_TOKENS)
    assert_outputs_match(outs, expected)


def test_padded_decode_batches_match_hf(tiny_model_dir: Any, tiny_hf_model: Any) -> None:
    # As on a GPU by default: async scheduling writes placeholder inputs into padded buffers.
    llm = _triton_llm(tiny_model_dir("llama"), max_num_seqs=8, async_scheduling=True)
    assert llm.engine.async_scheduling
    runner = llm.engine.runner
    runner.decode_sizes = capture_sizes(8)  # 1, 2, 4, 8: 5 requests decode as 8 rows, 3 as 4
    seen: list[int] = []
    execute = runner.execute

    def spy(out: Any) -> Any:
        if out.scheduled and all(len(s.token_ids) == 1 for s in out.scheduled):
            seen.append(len(out.scheduled))
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], _greedy())
    assert any(n not in runner.decode_sizes for n in seen), seen  # some steps were padded
    expected = hf_greedy(tiny_hf_model("llama"), PROMPTS, MAX_TOKENS)
    assert_outputs_match(outs, expected)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.config import EngineConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(device="cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(device="cpu", attention_backend="flash")
    config = EngineConfig(device="cpu")
    assert config.kernel_backend == "torch" and not config.use_cuda_graphs


def _decode_launches() -> Any:
    """benchmarks/decode_launches.py, which is a script, not a package module."""
    path = Path(__file__).parents[2] / "benchmarks" / "decode_launches.py"
    spec = importlib.util.spec_from_file_location("decode_launches", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_step_launches(arch: str, tiny_model_dir: Any) -> None:
    """A decode layer is ten launches: one of them normalizes q and k per head (Qwen3), rotates
    them and writes the KV cache. The forward adds three: the embedding, the gather of the angles
    (kept in the model dtype: no cast), the final norm; the LM head, its cast to float32 and
    greedy sampling follow it."""
    record = _decode_launches().count_model(Path(tiny_model_dir(arch)))
    assert record["layer"] == {
        "aten.linear": 4,
        "triton._decode_stage1_kernel": 1,
        "triton._decode_stage2_kernel": 1,
        "triton._rms_norm_kernel": 2,
        "triton._rotary_write_kv_kernel": 1,
        "triton._silu_and_mul_kernel": 1,
    }
    assert record["forward_launches"] == 10 * record["num_layers"] + 3
    assert record["outside_forward"] == {"aten.linear": 1, "aten.to": 1, "aten.argmax": 1}
