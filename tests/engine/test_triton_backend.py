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
from pagoda.kernels.fused_linear import MAX_ROWS
from pagoda.runner.cuda_graphs import capture_sizes
from tests.oracle import assert_outputs_match, hf_greedy

PROMPTS = [[(7 * i + 3 * j) % 1000 + 5 for j in range(3 + 4 * i)] for i in range(5)]
MAX_TOKENS = 10


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _few_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage-1 programs for ~16 (kv head, split) pairs a step instead of an H100's 264: the
    interpreter runs each program alone, so at 264 a tiny model's step launches up to 8 splits
    per head. Decode batches still span both paths: one request gets 8 splits (two stages), 4 get
    2, 8 get one (the direct path); the split arithmetic itself is tested on the kernels."""
    import pagoda.kernels.attention as attention

    monkeypatch.setattr(attention, "_TARGET_PROGRAMS", 16)


def _triton_llm(path: str, budget: int = 16, **kwargs: Any) -> LLM:
    return LLM(
        path,
        quantization="none",
        attention_backend="triton",
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_batched_tokens=budget,  # prompts arrive in chunks beside other requests' decodes
        max_model_len=32,  # 8 blocks a sequence: at most 8 decode splits (interpreter time)
        **kwargs,
    )


def _step_sizes(llm: LLM) -> list[int]:
    """The number of tokens of every step the runner executes from now on."""
    runner = llm.engine.executor.runner
    sizes: list[int] = []
    execute = runner.execute

    def spy(out: Any) -> Any:
        sizes.append(sum(len(s.token_ids) for s in out.scheduled))
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    return sizes


# llama (llama3 rope scaling) runs in the padded test below; qwen3 adds the per-head q/k norm.
# qwen2 adds q/k/v biases (in the fused projections' epilogue): slow only.
@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=pytest.mark.slow), "qwen3"])
def test_triton_backend_greedy_matches_hf(arch: str, tiny_model_dir: Any, tiny_hf_model: Any):
    # A 32-token budget: the first steps run the unfused layers (cuBLAS-sized), the later ones
    # (<= fused_linear.MAX_ROWS tokens) the fused layers.
    llm = _triton_llm(tiny_model_dir(arch), budget=32)
    assert llm.engine.executor.runner.kernel_backend == "triton"
    assert llm.engine.executor.runner.model.model.fused_max_rows == MAX_ROWS
    sizes = _step_sizes(llm)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], _greedy())
    assert max(sizes) > MAX_ROWS and min(sizes) <= MAX_ROWS, sizes
    expected = hf_greedy(tiny_hf_model(arch), PROMPTS, MAX_TOKENS)
    assert_outputs_match(outs, expected)


# Three requests decode as 4 rows; five (slow: the interpreter's time) as 8, then fewer.
@pytest.mark.parametrize("num_prompts", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_padded_decode_batches_match_hf(
    num_prompts: int, tiny_model_dir: Any, tiny_hf_model: Any
) -> None:
    # As on a GPU by default: async scheduling writes placeholder inputs into padded buffers.
    prompts = PROMPTS[:num_prompts]
    llm = _triton_llm(tiny_model_dir("llama"), max_num_seqs=8, async_scheduling=True)
    assert llm.engine.async_scheduling
    runner = llm.engine.executor.runner
    runner.decode_sizes = capture_sizes(8)  # 1, 2, 4, 8
    seen: list[int] = []
    execute = runner.execute

    def spy(out: Any) -> Any:
        if out.scheduled and all(len(s.token_ids) == 1 for s in out.scheduled):
            seen.append(len(out.scheduled))
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy())
    assert any(n not in runner.decode_sizes for n in seen), seen  # some steps were padded
    expected = hf_greedy(tiny_hf_model("llama"), prompts, MAX_TOKENS)
    assert_outputs_match(outs, expected)


# Slow for the default suite's time (22 s in the interpreter): the padded decode batches above
# and the tiny self-draft tests (tests/engine/test_spec_decode.py) are its fast variants.
@pytest.mark.slow
def test_verification_steps_as_padded_decode_batches(
    tiny_model_dir: Any, tiny_hf_model: Any
) -> None:
    """Speculative decoding on the triton backend, the draft being the target's own checkpoint:
    verification steps run as padded decode batches of one-token rows (a graph replay's eager
    reference), the draft's steps on the kernels too; every draft is accepted and the tokens
    are HF's."""
    folder = tiny_model_dir("llama")
    spec = {"model": folder, "num_speculative_tokens": 2}  # 3 rows a request: 3 and 6 padded
    llm = _triton_llm(folder, max_num_seqs=8, speculative_config=spec)
    runner = llm.engine.executor.runner
    runner.decode_sizes = capture_sizes(8)  # 1, 2, 4, 8
    verify_rows: list[int] = []
    execute = runner.execute

    def spy(out: Any) -> Any:
        if any(s.num_draft_tokens for s in out.scheduled):
            verify_rows.append(sum(len(s.token_ids) for s in out.scheduled))
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    prompts = PROMPTS[:2]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy())
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens == stats.spec_num_accepted_tokens > 0
    assert any(n not in runner.decode_sizes for n in verify_rows), verify_rows  # padded
    assert_outputs_match(outs, hf_greedy(tiny_hf_model("llama"), prompts, MAX_TOKENS))


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
    """A decode layer is seven launches: the input norm runs inside the q/k/v projection, the
    post-attention norm and SiLU-and-mul inside gate/up, the residual adds inside o and down;
    one launch normalizes q and k per head (Qwen3), rotates them and writes the KV cache. The
    forward adds three: the embedding, the gather of the angles (kept in the model dtype: no
    cast), the final norm. The graph adds the LM head and the argmax (straight from the
    model-dtype logits: no cast to float32), which a greedy batch samples: nothing is left to
    launch outside it."""
    record = _decode_launches().count_model(Path(tiny_model_dir(arch)))
    assert record["layer"] == {
        "triton._decode_stage1_kernel": 1,
        "triton._decode_stage2_kernel": 1,
        "triton._fused_linear_kernel": 4,
        "triton._rotary_write_kv_kernel": 1,
    }
    assert record["forward_launches"] == 7 * record["num_layers"] + 3
    assert record["graph_after_forward"] == {"aten.linear": 1, "aten.argmax": 1}
    assert record["outside_graph"] == {}


def test_latent_attention_on_the_triton_backend_matches_hf(
    tiny_model_dir: Any, tiny_hf_model: Any
) -> None:
    """DeepSeek-V3's latent cache on the triton kernels (pagoda/kernels/latent_attention.py):
    chunked prompts beside decodes, then decode batches padded to the CUDA-graph sizes (their
    padding rows' slot -1 written nowhere), under async scheduling."""
    llm = _triton_llm(tiny_model_dir("deepseek_v3"), max_num_seqs=8, async_scheduling=True)
    runner = llm.engine.executor.runner
    runner.decode_sizes = capture_sizes(8)  # 1, 2, 4, 8
    sizes = _step_sizes(llm)
    prompts = PROMPTS[:3]  # 3 decode rows: padded to 4
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], _greedy())
    assert max(sizes) > len(prompts), sizes  # prefill chunks ran
    assert sizes.count(3) >= MAX_TOKENS - 2, sizes  # 3-row decode steps, padded to 4
    attn = runner.model.model.layers[0].self_attn.attn
    assert type(attn).__name__ == "LatentAttention" and attn.backend == "triton"
    assert_outputs_match(outs, hf_greedy(tiny_hf_model("deepseek_v3"), prompts, MAX_TOKENS))
