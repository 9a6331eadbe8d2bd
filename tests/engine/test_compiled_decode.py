"""Compiled decode steps on CPU (-O1 and above, pagoda/runner/compilation.py): greedy tokens equal HF's
(near-tie rules of tests/oracle.py) while prompts arrive in chunks beside other requests'
decodes, decode batches shrink from five requests to one, and block tables grow from one block
to several; no step after startup compiles again. Under async scheduling (Qwen3 with an int8
KV cache) the compiled steps read the placeholder-filled inputs and give exactly the tokens of
the synchronous eager engine. At -O3 (slow) the graphs run from inductor's C++ wrapper, with
HF's tokens too. SmolLM2's GGUF (slow), compiled equal to eager bit for bit. Also the level
arithmetic of EngineConfig and the CLI flag."""

from __future__ import annotations

from typing import Any

import pytest
import torch._dynamo

from pagoda import LLM, SamplingParams
from pagoda.cli import build_parser
from pagoda.config import EngineConfig
from pagoda.engine_args import engine_kwargs
from tests.equivalence import assert_same_outputs
from tests.oracle import assert_outputs_match, hf_greedy

PROMPTS = [[(5 * i + 11 * j) % 900 + 7 for j in range(2 + 5 * i)] for i in range(5)]
MAX_TOKENS = [6, 9, 12, 16, 20]  # requests finish one by one: the last steps decode alone


SMALL = {"num_gpu_blocks_override": 64, "block_size": 4, "max_num_batched_tokens": 16}


def _compiled_llm(path: str, level: int = 2, **kwargs: Any) -> LLM:
    kwargs.setdefault("quantization", "none")
    return LLM(path, optimization_level=level, max_model_len=64, **SMALL, **kwargs)


# llama: llama3 rope, sharded checkpoint; qwen3: per-head q/k norm, here with an int8 KV cache
# and async scheduling (as on a GPU by default): slow, for the default suite's time (its inductor
# compile takes 40 s on a fresh machine); llama is its fast variant. Level 3: the graphs run from
# inductor's C++ wrapper (slow: compiling the wrappers takes about a minute more).
@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype", "level"),
    [
        ("llama", "auto", 2),
        pytest.param("qwen3", "int8", 2, marks=pytest.mark.slow),
        pytest.param("llama", "auto", 3, marks=pytest.mark.slow),
    ],
)
def test_compiled_decode_greedy_matches_hf(
    arch: str, kv_cache_dtype: str, level: int, tiny_model_dir: Any, tiny_hf_model: Any
) -> None:
    async_scheduling = kv_cache_dtype != "auto"
    llm = _compiled_llm(
        tiny_model_dir(arch),
        level,
        kv_cache_dtype=kv_cache_dtype,
        async_scheduling=async_scheduling,
    )
    assert llm.engine.async_scheduling == async_scheduling
    assert llm.engine.config.decode_cpp_wrapper == (level == 3)
    runner = llm.engine.executor.runner
    assert runner.compiled is not None
    _assert_no_module_guards(runner.compiled)
    compiled_batches: list[int] = []
    execute = runner.execute

    def spy(out: Any) -> Any:
        if out.scheduled and all(len(s.token_ids) == 1 for s in out.scheduled):
            compiled_batches.append(len(out.scheduled))
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)

    assert torch._dynamo.utils.counters["frames"]["ok"] == frames_before  # no recompiles
    assert 1 in compiled_batches and max(compiled_batches) >= 3, compiled_batches
    if kv_cache_dtype == "auto":
        hf = hf_greedy(tiny_hf_model(arch), PROMPTS, max(MAX_TOKENS))
        assert_outputs_match(outs, [(t[:n], lp[:n]) for n, (t, lp) in zip(MAX_TOKENS, hf)])
    else:  # a quantized cache is not HF's: compare with the same engine run eagerly, in sync
        eager = LLM(
            tiny_model_dir(arch),
            quantization="none",
            kv_cache_dtype=kv_cache_dtype,
            num_gpu_blocks_override=64,
            block_size=4,
            max_num_batched_tokens=16,
            max_model_len=64,
        )
        assert eager.engine.executor.runner.compiled is None
        ref = eager.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
        for out, r in zip(outs, ref):
            assert out.outputs[0].token_ids == r.outputs[0].token_ids


def _assert_no_module_guards(compiled: Any) -> None:
    """Both graphs (batch 1 and batch >= 2) compiled, neither guarding the model's modules
    (compilation.py: checking them cost 1.2 ms a step; torch.compile pops guard_filter_fn from
    its options, so the second graph once lost the filter)."""
    for dispatch in (compiled._one, compiled._many):
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(dispatch.fn.__code__)
        assert entries, dispatch.fn.__name__
        for entry in entries:
            assert "L['model']._modules" not in str(entry.guard_manager), dispatch.fn.__name__


def test_each_engine_keeps_its_own_graphs(tiny_model_dir: Any) -> None:
    """The graphs keep no guards on the model's modules (compilation.py), so two engines in one
    process must not share them: here the same checkpoint with float and with int8 weights
    (the same input shapes, other modules), compiled one after the other and decoding
    alternately; each gives the tokens of its own eager run. One request at a time
    (max_num_seqs=1): the batch-1 graph shows it, and each engine compiles only that one."""
    path = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    schemes = ("none", "int8")
    expected = {}
    for quantization in schemes:
        eager = LLM(path, quantization=quantization, max_model_len=64, **SMALL)
        expected[quantization] = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        del eager
    llms = {
        quantization: _compiled_llm(path, quantization=quantization, max_num_seqs=1)
        for quantization in schemes
    }
    for _ in range(2):
        for quantization, llm in llms.items():
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert got == expected[quantization], quantization


def test_compile_failure_names_the_way_out(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda.runner.compilation import CompiledDecode

    def fail(*args: Any) -> None:
        raise OSError("no C++ compiler")

    monkeypatch.setattr(CompiledDecode, "warm_up", fail)
    with pytest.raises(RuntimeError, match=r"OSError: no C\+\+ compiler.*-O0"):
        _compiled_llm(tiny_model_dir("llama"))


def test_optimization_levels() -> None:
    cpu = EngineConfig(device="cpu")
    assert cpu.level == 0 and not cpu.compile_decode and not cpu.use_cuda_graphs
    assert EngineConfig(device="cpu", optimization_level=1).compile_decode
    assert EngineConfig(device="cpu", optimization_level=3).level == 3
    assert EngineConfig(device="cpu", optimization_level=3).decode_cpp_wrapper
    assert not EngineConfig(device="cpu", optimization_level=2).decode_cpp_wrapper
    assert not EngineConfig(
        device="cpu", optimization_level=3, enforce_eager=True
    ).decode_cpp_wrapper
    forced = EngineConfig(device="cpu", optimization_level=2, enforce_eager=True)
    assert forced.level == 0 and not forced.compile_decode
    # compiled decode is the torch backend's: the triton interpreter path stays eager
    assert not EngineConfig(
        device="cpu", optimization_level=2, attention_backend="triton"
    ).compile_decode
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="optimization_level must be 0, 1, 2 or 3"):
            EngineConfig(optimization_level=bad)


def test_cli_optimization_flag() -> None:
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "-O2"]))["optimization_level"] == 2
    long_form = parser.parse_args(["generate", "--optimization-level", "0"])
    assert engine_kwargs(long_form)["optimization_level"] == 0
    assert "optimization_level" not in engine_kwargs(parser.parse_args(["generate"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "-O5"])


@pytest.mark.slow
def test_compiled_smollm2_gguf_equals_eager_bit_for_bit(
    smollm2_path: str, smollm2_o2_llm: LLM
) -> None:
    """SmolLM2's Q4_1 GGUF (the B1 benchmark's model): compiled decode steps and eager ones call
    the same CPU kernels for every op that rounds (matmuls, attention, norms, activation,
    rotary: kernels/cpu), so their greedy tokens and every log-prob are equal, not merely close
    (with inductor's own fused norms a last-bit difference flipped int8 codes downstream, and
    the log-probs moved by up to 0.27)."""
    prompts = [[(13 * i + 7 * j) % 40000 + 100 for j in range(8 + 40 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
    batch = [{"prompt_token_ids": ids} for ids in prompts]
    # alone (batch-1 graph), then together (batch >= 2 graph); eager the same way
    eager_llm = LLM(smollm2_path, num_gpu_blocks_override=256)
    eager = eager_llm.generate(batch[:1], params) + eager_llm.generate(batch, params)
    del eager_llm
    compiled_llm = smollm2_o2_llm  # -O2, the same pool
    compiled = compiled_llm.generate(batch[:1], params) + compiled_llm.generate(batch, params)
    assert_same_outputs(compiled, eager, atol=0.0)


def test_compiled_draft_model_steps(tiny_weights_dir: Any) -> None:
    """-O2 with a draft model: the draft's one-token steps run compiled too (its own graphs,
    compiled at startup); the target's own checkpoint as draft is accepted at every draft, and
    the tokens are the eager engine's."""
    folder = tiny_weights_dir("llama")
    spec = {"model": folder, "num_speculative_tokens": 3}
    llm = _compiled_llm(folder, skip_tokenizer_init=True, speculative_config=spec)
    draft_step = llm.engine.executor.runner.draft_step
    assert draft_step is not None and draft_step.compiled is not None
    inner, draft_batches = draft_step.compiled, []

    def spy(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> torch.Tensor:
        draft_batches.append(ids.shape[0])
        return inner(ids, pos, ctx)

    draft_step.compiled = spy  # type: ignore[assignment]
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames_before  # no recompiles
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens == stats.spec_num_accepted_tokens > 0
    assert 1 in draft_batches and max(draft_batches) >= 2, draft_batches
    eager = LLM(folder, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=64)
    ref = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]


def test_compiled_bfloat16_steps_equal_eager_bit_for_bit(
    tiny_weights_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half model (bfloat16, its linears on the CPU kernels' float16 form with
    PAGODA_CPU_HALF_KERNELS=1): its norms, SiLU-and-mul and rotary run pagoda_cpu's half row ops
    in eager and compiled steps alike, so -O2 gives -O0's tokens and log-probs bit for bit,
    prompts alone and batched; with the target's own checkpoint drafting, every draft is
    accepted (a verified row has the bits it has decoded alone). With inductor fusing those ops
    in each graph its own way, SmolLM2 in bfloat16 at -O2 gave 4 of 8 chat answers other tokens
    batched than alone."""
    monkeypatch.setenv("PAGODA_CPU_HALF_KERNELS", "1")
    folder = tiny_weights_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    batch = [{"prompt_token_ids": ids} for ids in PROMPTS]
    common: dict[str, Any] = dict(dtype="bfloat16", skip_tokenizer_init=True)

    def run(llm: LLM) -> list[Any]:
        return llm.generate(batch[:1], params, use_tqdm=False) + llm.generate(
            batch, params, use_tqdm=False
        )

    eager = run(_compiled_llm(folder, 0, **common))
    compiled = _compiled_llm(folder, **common)
    layer = compiled.engine.executor.runner.model.model.layers[0]  # type: ignore[union-attr]
    assert layer.mlp.down_proj.kernel == "cpu_bf16" and layer.input_layernorm.cpu_kernel
    assert_same_outputs(run(compiled), eager, atol=0.0)
    del compiled
    spec = {"model": folder, "num_speculative_tokens": 3, "max_catch_up_ratio": None}
    drafted = _compiled_llm(folder, speculative_config=spec, **common)
    assert_same_outputs(run(drafted), eager, atol=0.0)
    stats = drafted.engine.stats()
    assert stats.spec_num_draft_tokens == stats.spec_num_accepted_tokens > 0
