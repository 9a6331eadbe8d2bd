"""Tensor parallelism (layers/parallel.py, distributed/): two worker processes of one thread each,
over gloo, must give what one rank gives.

- Greedy and seeded sampling: the same tokens as tensor_parallel_size 1, with logprobs within
  LOGPROB_ATOL, in mixed batches under chunked prefill and preemption, on the tiny Llama, Qwen2
  and Qwen3 (kv heads split), on tiny Llamas with one kv head (replicated) and with three kv
  heads (2 + 1 groups, SmolLM2's split; SmolLM2 itself in float32 and as the GGUF: slow tests).
- Each rank holds half of the weights and half of the KV cache.
- A draft model on two ranks: each holds the whole draft and proposes the same drafts; with a
  grammar (drafts drawn without its mask there) the output stays exact.
- A rank killed mid-run ends generate() with an error naming it, not a hang.
- A script without a main guard gets one error naming the fix.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagoda import LLM, SamplingParams
from pagoda.distributed.workers import UNGUARDED_MESSAGE
from pagoda.kernels.paged_cache import kv_cache_bytes
from pagoda.layers.moe import Router, SparseMoE
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import TensorParallel
from pagoda.layers.quant_forms import stored_bytes
from pagoda.outputs import RequestOutput
from pagoda.runner.model_runner import ModelRunner
from pagoda.structured_outputs import StructuredOutputsParams
from tests.engine.test_scheduling_invariance import _params, _prompts
from tests.equivalence import assert_same_outputs

PROMPTS = _prompts(10, seed=3, shared_prefix=16)
PARAMS = _params(len(PROMPTS))
# Small steps and a small pool: prompts are prefilled in chunks, and requests are preempted.
ENGINE = dict(
    skip_tokenizer_init=True, max_num_batched_tokens=32, num_gpu_blocks_override=14, block_size=8
)


def _run(llm: LLM) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


def _run_both(
    folder: str, **extra: Any
) -> tuple[list[RequestOutput], list[RequestOutput], LLM, LLM]:
    """(TP=2 outputs, TP=1 outputs, the TP=1 engine, the TP=2 engine)."""
    one = LLM(folder, **ENGINE, **extra)
    want = _run(one)
    two = LLM(folder, tensor_parallel_size=2, **ENGINE, **extra)
    return _run(two), want, one, two


def _kv_bytes(llm: LLM) -> int:
    runner = llm.engine.executor.runner
    assert isinstance(runner, ModelRunner)
    return kv_cache_bytes(runner.kv_caches)


# Qwen2 (q/k/v biases, cut with their rows) runs on two ranks in the n-gram test below.
# Qwen3 is slow-marked for the default suite's time (Llama runs the same split).
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_tp2_equals_one_rank(tiny_weights_dir: Callable[[str], str], arch: str) -> None:
    got, want, one, llm = _run_both(tiny_weights_dir(arch))
    assert_same_outputs(got, want)
    assert llm.engine.stats().num_preemptions > 0  # the pool is small enough to preempt
    _assert_each_rank_holds_half(one, llm)
    llm.engine.shutdown()


def test_tp2_splits_a_mixtures_experts(tiny_weights_dir: Callable[[str], str]) -> None:
    """Expert parallelism: each of two ranks holds 4 of the 8 experts whole (not half of
    each), the router on both; the same outputs as one rank."""
    got, want, one, llm = _run_both(tiny_weights_dir("qwen3_moe"))
    assert_same_outputs(got, want)
    model: Any = one.engine.executor.runner.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    experts = sum(stored_bytes(e) for m in moes for e in m.experts)
    whole = [m for m in model.modules() if isinstance(m, (RMSNorm, Router))]
    replicated = sum(stored_bytes(m) for m in whole + [model.model.rotary_emb])
    rest = one.engine.model_config.weight_bytes - experts - replicated
    for rank in llm.engine.executor.memory():  # type: ignore[union-attr]
        assert rank["weight_bytes"] == rest // 2 + experts // 2 + replicated
    llm.engine.shutdown()


def test_tp2_splits_latent_attention_heads_and_experts(
    tiny_weights_dir: Callable[[str], str],
) -> None:
    """DeepSeek-V3's multi-head latent attention on two ranks: each holds 2 of the 4 heads (their
    rows of q_b_proj and kv_b_proj, their columns of o_proj), 4 of the 8 routed experts whole and
    half of the dense and shared MLPs; the latent projections, the router and the latent cache
    are whole on both. The same outputs as one rank."""
    got, want, one, llm = _run_both(tiny_weights_dir("deepseek_v3"))
    assert_same_outputs(got, want)
    model: Any = one.engine.executor.runner.model
    latent = [
        getattr(layer.self_attn, name)
        for layer in model.model.layers
        for name in ("q_a_proj", "kv_a_proj_with_mqa")
    ]
    whole = [m for m in model.modules() if isinstance(m, (RMSNorm, Router))] + latent
    replicated = sum(stored_bytes(m) for m in whole + [model.model.rotary_emb])
    for layer in model.model.layers:  # the router's correction bias: a parameter of its own
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, Router):
            replicated += sum(p.numel() * p.element_size() for p in gate.parameters())
    rest = one.engine.model_config.weight_bytes - replicated
    memory = llm.engine.executor.memory()  # type: ignore[union-attr]
    for rank in memory:
        assert rank["weight_bytes"] == rest // 2 + replicated
        assert rank["kv_cache_bytes"] == _kv_bytes(one)  # one latent row a token on each
    llm.engine.shutdown()


def _assert_each_rank_holds_half(one: LLM, two: LLM) -> None:
    """Every matrix and the KV cache are halved; the norms and the rotary table are whole on
    each rank."""
    memory = two.engine.executor.memory()  # type: ignore[union-attr]
    one_kv = _kv_bytes(one)
    model: Any = one.engine.executor.runner.model
    whole = [m for m in model.modules() if isinstance(m, RMSNorm)] + [model.model.rotary_emb]
    replicated = sum(stored_bytes(m) for m in whole)
    one_weights = one.engine.model_config.weight_bytes
    for rank in memory:
        assert rank["kv_cache_bytes"] == one_kv // 2
        assert rank["weight_bytes"] == (one_weights - replicated) // 2 + replicated


@pytest.mark.parametrize(
    "heads,kv_heads", [(4, 1), (6, 3)], ids=["one-kv-head-replicated", "3-groups-split-2+1"]
)
def test_tp2_small_configs(tmp_path: Path, heads: int, kv_heads: int) -> None:
    """One kv head: each rank keeps it (replicated), so each rank's KV cache is the whole one.
    Three kv heads (SmolLM2's case): ranks take 2 + 1 GQA groups, rank 0's cache twice rank 1's."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    got, want, one, llm = _run_both(str(tmp_path))
    assert_same_outputs(got, want)
    memory = llm.engine.executor.memory()  # type: ignore[union-attr]
    one_kv = _kv_bytes(one)
    want_kv = [one_kv, one_kv] if kv_heads == 1 else [one_kv * 2 // 3, one_kv // 3]
    assert [m["kv_cache_bytes"] for m in memory] == want_kv
    llm.engine.shutdown()


# The default suite checks TensorParallel.heads' ValueError directly (below); this one shows it
# reaches the caller from the ranks with its type and text.
@pytest.mark.slow
def test_a_size_the_heads_do_not_divide_is_a_value_error(
    tiny_weights_dir: Callable[[str], str],
) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(tiny_weights_dir("llama"), tensor_parallel_size=3, **ENGINE)


def test_heads_split_by_groups_or_refuse() -> None:
    """2 kv heads (4 query heads) over 3 ranks neither split nor replicate evenly: ValueError.
    3 kv heads over 2 ranks are 2 + 1 GQA groups; 1 kv head over 2 ranks is replicated."""
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be a multiple"):
        TensorParallel(0, 3).heads(4, 2)
    assert [TensorParallel(r, 2).heads(9, 3) for r in range(2)] == [
        ((0, 6), (0, 2)),
        ((6, 3), (2, 1)),
    ]
    assert [TensorParallel(r, 2).heads(4, 1) for r in range(2)] == [
        ((0, 2), (0, 1)),
        ((2, 2), (0, 1)),
    ]


def test_ngram_speculation_on_two_ranks(tiny_weights_dir: Callable[[str], str]) -> None:
    """Every rank proposes and verifies the same drafts (the same tokens, the same logits)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    got, want, _, llm = _run_both(tiny_weights_dir("qwen2"), speculative_config=spec)
    assert_same_outputs(got, want)
    assert llm.engine.stats().spec_num_drafts > 0
    llm.engine.shutdown()


def _spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.spec_num_drafts, stats.spec_num_accepted_tokens


def test_a_draft_model_on_two_ranks(tiny_weights_dir: Callable[[str], str]) -> None:
    """Each rank holds the whole draft (here the target's own checkpoint, with a cache of its
    own) and proposes what the others do: greedy and seeded rows give one rank's tokens with
    the same draft, through chunked prefill and preemption, and the greedy drafts, the
    target's own next tokens, are accepted."""
    folder = tiny_weights_dir("qwen2")
    spec = {"model": folder, "num_speculative_tokens": 3, "max_catch_up_ratio": None}
    got, want, one, two = _run_both(folder, speculative_config=spec)
    assert_same_outputs(got, want)
    drafted, accepted = _spec_counts(two)
    assert drafted > 0 and accepted > drafted // 2
    assert _spec_counts(one) == (drafted, accepted)
    two.engine.shutdown()


def test_a_quantized_self_draft_on_two_ranks(tiny_weights_dir: Callable[[str], str]) -> None:
    """The target's weights kept int4 as its draft: on one rank it runs on the target's KV
    cache; a rank's cache holds half the kv heads, so on two ranks the draft has its own.
    Greedy rows give the plain engine's tokens."""
    folder = tiny_weights_dir("llama")
    spec = {"model": "self", "quantization": "int4", "num_speculative_tokens": 2}
    spec["max_catch_up_ratio"] = None  # its own cache catches up on every prompt
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    want = LLM(folder, **ENGINE).generate(prompts, greedy, use_tqdm=False)
    two = LLM(folder, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    got = two.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    drafted, accepted = _spec_counts(two)
    assert drafted > accepted > 0
    two.engine.shutdown()


def test_a_draft_model_on_two_ranks_with_a_grammar(tiny_model_dir: Callable[[str], str]) -> None:
    """The grammars live in the engine's process: on the ranks a draft model draws its drafts
    without their masks, and verification keeps the output exact: greedy requests give the
    tokens of two ranks without the draft, seeded ones a text of the grammar."""
    folder = tiny_model_dir("llama")
    spec = {"model": "self", "quantization": "int4", "num_speculative_tokens": 3}
    grammar = StructuredOutputsParams(regex="[a-f]{5,40}")
    prompts = ["The letters", "Hello", "abc", "Once upon a time"]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=grammar)
    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=30, structured_outputs=grammar)
    plain = LLM(folder, tensor_parallel_size=2, num_gpu_blocks_override=512)
    want = plain.generate(prompts, greedy, use_tqdm=False)
    plain.engine.shutdown()
    two = LLM(
        folder,
        tensor_parallel_size=2,
        num_gpu_blocks_override=512,
        speculative_config={**spec, "max_catch_up_ratio": None},
    )
    got = two.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in [*got, *two.generate(prompts, seeded, use_tqdm=False)]:
        assert re.fullmatch("[a-f]{5,40}", o.outputs[0].text), o.outputs[0].text
    assert _spec_counts(two)[0] > 0
    two.engine.shutdown()


def kill_rank_1_mid_run(llm: LLM, match: str) -> None:
    """SIGKILL worker rank 1 two seconds into a long run: generate() must raise RuntimeError
    matching `match` within a minute (no hang)."""
    rank1 = llm.engine.executor.procs[1]  # type: ignore[union-attr]
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(4)]
    killer = threading.Timer(2.0, os.kill, (rank1.pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match=match):
        for _ in range(1000):  # far longer than 2 s: the kill lands mid-run
            llm.generate(prompts, params, use_tqdm=False)
    assert time.monotonic() - start < 60


# The default suite kills a rank under `pagoda serve` instead (tests/server/test_lifecycle.py).
@pytest.mark.slow
def test_a_killed_rank_fails_loudly(tiny_weights_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_weights_dir("llama"), tensor_parallel_size=2, skip_tokenizer_init=True)
    kill_rank_1_mid_run(llm, "rank 1 .* died with exit code -9")
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.engine.check_health()
    llm.engine.shutdown()


def assert_smollm2_float32_equals_one_process(smollm2_llm: LLM, **parallel: int) -> None:
    """SmolLM2 in float32 with `parallel` (e.g. tensor_parallel_size=2) gives one process's
    greedy tokens and logprobs (smollm2_llm: float32, one process)."""
    prompts = ["The capital of France is", "Write a haiku about rain.", "def fib(n):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    want = smollm2_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(quantization="none", num_gpu_blocks_override=64, **parallel)
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), want)
    llm.engine.shutdown()


@pytest.mark.slow
def test_smollm2_float32_tp2_equals_one_rank(smollm2_llm: LLM) -> None:
    # SmolLM2: 9 query heads, 3 kv heads, so the ranks hold 2 + 1 GQA groups (6 + 3 heads).
    assert_smollm2_float32_equals_one_process(smollm2_llm, tensor_parallel_size=2)


def assert_gguf_keeps_one_rank_s_quality(
    smollm2_path: str, smollm2_tokenizer: Any, own_bits: bool, **parallel: int
) -> None:
    """The GGUF under `parallel` (e.g. tensor_parallel_size=2), against one rank and, with
    `own_bits`, itself.

    - Its own bits: greedy outputs with logprobs, each prompt alone, all in one call, and in
      8-token chunks on a second engine: equal bit for bit (every row's arithmetic on a rank is
      its own, docs/determinism.md).
    - One rank's quality: scoring the first 512 positions of tests/data/eval_text.txt (prompt
      logprobs), the next-token choice agrees with one rank's at >= 95% of positions and the
      perplexity is within 1%. The reason for the bound: a rank sums its share of a
      row-parallel input (context parallelism: of a row's keys), and on this path every matmul
      rounds its input to int8, which amplifies any last-bit change: scaling one layer's o_proj
      output by (1 + 2^-22) on one rank moves the log-probs by 0.03 (median) and flips 15 of
      the 512 choices (measured, as TP and CP flip 18, perplexity within 0.6%); a wrong shard
      or a lost sum falls far below.
    """
    from tests.models.test_quant_quality import TEXT, compare, score

    ids = smollm2_tokenizer(TEXT)["input_ids"][:513]
    prompts = [
        "The capital of France is",
        "Write a haiku about rain.",
        "1, 2, 3, 4,",
        "def fib(n):",
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    one = LLM(smollm2_path, num_gpu_blocks_override=64)
    reference = score(one, ids)
    del one
    llm = LLM(smollm2_path, num_gpu_blocks_override=64, **parallel)
    agreement, ppl_change = compare(score(llm, ids), reference)
    print(f"\n{parallel}: top-1 agreement {agreement:.4f}, perplexity change {ppl_change:+.4%}")
    assert agreement >= 0.95 and abs(ppl_change) <= 0.01
    if not own_bits:
        llm.engine.shutdown()
        return
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), alone, atol=0.0)
    llm.engine.shutdown()
    chunked = LLM(smollm2_path, num_gpu_blocks_override=64, max_num_batched_tokens=8, **parallel)
    assert_same_outputs(chunked.generate(prompts, params, use_tqdm=False), alone, atol=0.0)
    chunked.engine.shutdown()


@pytest.mark.slow
def test_smollm2_gguf_tp2_keeps_one_rank_s_quality_and_its_own_bits(
    smollm2_path: str, smollm2_tokenizer: Any
) -> None:
    assert_gguf_keeps_one_rank_s_quality(
        smollm2_path, smollm2_tokenizer, own_bits=True, tensor_parallel_size=2
    )


def test_a_script_without_a_main_guard_gets_one_sentence(
    tiny_weights_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """A user's script creating LLM(tensor_parallel_size=2) at module level: each spawned rank
    imports it again; the rank exits at once and the engine raises one error naming the fix,
    not the ranks' tracebacks ("bootstrapping phase")."""
    script = tmp_path / "script.py"
    script.write_text(
        "from pagoda import LLM\n"
        f"llm = LLM({tiny_weights_dir('llama')!r}, tensor_parallel_size=2,"
        " skip_tokenizer_init=True)\n"
        "print('generated', llm.generate([{'prompt_token_ids': [1, 2, 3]}])[0].outputs[0].token_ids)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"RuntimeError: {UNGUARDED_MESSAGE}"
    assert 'if __name__ == "__main__":' in last and "bootstrapping" not in done.stderr
    assert "generated" not in done.stdout
    guarded = script.read_text().replace("llm = ", "if __name__ == '__main__':\n    llm = ")
    guarded = guarded.replace("print(", "    print(")
    script.write_text(guarded)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "generated [" in done.stdout


def test_tp2_embeddings_equal_one_rank_s(tiny_weights_dir: Callable[[str], str]) -> None:
    """--runner pooling on two ranks (the vectors come from rank 0, whose hidden states the
    all-reduces made whole): each vector equals one rank's within float32 rounding, since the
    all-reduce adds the ranks' partial products in another order (measured 2e-7 on unit
    vectors)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = LLM(tiny_weights_dir("llama"), runner="pooling", **ENGINE).embed(prompts, use_tqdm=False)
    two = LLM(tiny_weights_dir("llama"), runner="pooling", tensor_parallel_size=2, **ENGINE)
    got = two.embed(prompts, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert torch.allclose(
            torch.tensor(g.outputs.embedding), torch.tensor(w.outputs.embedding), rtol=0, atol=1e-6
        )
