"""Speculative decoding end to end: with drafts, the engine outputs exactly what it outputs
without them, greedy and seeded sampling alike, in mixed batches (rows with and without drafts),
with chunked prefill, forced preemption, stop tokens, max_tokens, logprobs and n > 1.

A tiny random model never repeats itself, so prompt lookup proposes little and it would accept
nothing: the verification is driven by an oracle proposer instead, which proposes the plain
run's own continuation with some drafts corrupted, so steps accept all, some and none of their
drafts. The real n-gram proposer is checked on the embedded SmolLM2 copying a passage.

Draft models: the target's own weights kept int4 ("model": "self"), another architecture (the
tiny Qwen2 drafting for the tiny Llama), and the target's own checkpoint as its draft, whose
drafts must all be accepted: any stale or misplaced KV in the draft's cache would show as a
rejection. The quantized self-draft of SmolLM2 (float target, its GGUF kept 4-bit) is checked
against the float engine.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.bench.copy_workload import copy_prompts
from pagoda.bench.spec_workloads import CHAT
from pagoda.outputs import RequestOutput
from tests.drafts import FixedDrafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SELF_INT4 = {"model": "self", "quantization": "int4", "num_speculative_tokens": 3}
PROMPTS = [
    [(7 * j + 3) % 900 + 5 for j in range(5)],
    [(11 * j + 2) % 900 + 5 for j in range(19)],  # prefilled in chunks beside decodes
    [(13 * j + 1) % 900 + 5 for j in range(9)],
]
MAX_TOKENS = 24


def _llm(folder: str, spec: dict[str, Any] | None, **kwargs: Any) -> LLM:
    args: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    args.update(kwargs)
    return LLM(folder, speculative_config=spec, **args)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def _tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


class OracleProposer(FixedDrafts):
    """Proposes each request's continuation from a plain run (truth[(prompt index, sample
    index)]: its output tokens), corrupting draft j of a proposal when (length + j) % 4 == 1,
    and proposing nothing to the prompts in `skip`: steps then accept every draft, a prefix, or
    none, and some rows of a batch have no drafts."""

    def __init__(self, truth: dict[tuple[int, int], list[int]]) -> None:
        self.truth = truth
        self.skip: set[int] = set()
        self.proposed = 0
        self.batch_sizes: list[int] = []

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        drafts = []
        self.batch_sizes.append(len(requests))
        for rid, tokens, allowed in requests:
            (i,) = [i for i, p in enumerate(PROMPTS) if list(tokens[: len(p)]) == p]
            sample = int(rid.split("#")[1]) if "#" in rid else 0
            truth, done = self.truth[(i, sample)], len(tokens) - len(PROMPTS[i])
            # A request that stopped inside its accepted drafts finished in the scheduler; the
            # runner's row holds its tokens past the stop until it is dropped next step.
            assert list(tokens[len(PROMPTS[i]) :])[: len(truth)] == truth[:done]
            if i in self.skip or allowed <= 0 or done >= len(truth):
                drafts.append([])
                continue
            draft = list(truth[done : done + min(3, allowed)])
            for j in range(len(draft)):
                if (len(tokens) + j) % 4 == 1:
                    draft[j] = (draft[j] + 1) % 1000
            self.proposed += len(draft)
            drafts.append(draft)
        return drafts


def _with_oracle(llm: LLM, plain: list[RequestOutput]) -> OracleProposer:
    truth = {(i, c.index): list(c.token_ids) for i, o in enumerate(plain) for c in o.outputs}
    oracle = OracleProposer(truth)
    runner = llm.engine.executor.runner
    assert runner.proposer is not None
    runner.proposer.proposer = oracle  # type: ignore[assignment]
    return oracle


@pytest.fixture(scope="module")
def folder(tiny_weights_dir: Any) -> str:
    return tiny_weights_dir("llama")


@pytest.fixture(scope="module")
def plain(folder: str) -> Iterator[LLM]:
    yield _llm(folder, None)


@pytest.fixture(scope="module")
def spec(folder: str) -> Iterator[LLM]:
    yield _llm(folder, NGRAM)


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    "processed": SamplingParams(
        temperature=0.8,
        seed=11,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 2.0, 17: -3.0},
        min_tokens=6,
        max_tokens=MAX_TOKENS,
    ),
    "n2_logprobs": SamplingParams(
        temperature=1.0, seed=3, n=2, logprobs=2, max_tokens=MAX_TOKENS, ignore_eos=True
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_change_nothing(case: str, plain: LLM, spec: LLM) -> None:
    params = CASES[case]
    expected = _run(plain, params)
    oracle = _with_oracle(spec, expected)
    oracle.skip = {2}  # the third prompt decodes without drafts
    before = spec.engine.stats()
    got = _run(spec, params)
    assert _tokens(got) == _tokens(expected)
    after = spec.engine.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    # Drafts cut by the token budget are proposed but never verified.
    assert oracle.proposed >= drafted > accepted > 0  # some drafts held, some did not
    _check_logprobs(params, got, expected)


def _check_logprobs(
    params: SamplingParams, got: list[RequestOutput], expected: list[RequestOutput]
) -> None:
    """The target's logprobs at each token, as without drafts (a 5-row step's matmuls round
    differently from 1-row ones: float32 noise, far below 1e-4)."""
    if params.logprobs is None:
        return
    for o_got, o_exp in zip(got, expected):
        for c_got, c_exp in zip(o_got.outputs, o_exp.outputs):
            assert c_got.logprobs is not None and c_exp.logprobs is not None
            for lp_got, lp_exp in zip(c_got.logprobs, c_exp.logprobs):
                assert lp_got.keys() == lp_exp.keys()
                for t in lp_got:
                    assert lp_got[t].logprob == pytest.approx(lp_exp[t].logprob, abs=1e-4)


def _scored(llm: LLM, outs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The target's logprobs at each token of `outs` (prompt logprobs of prompt + output), as
    RequestOutputs of the same shape, for _check_logprobs."""
    if params.logprobs is None:
        return outs
    scored = []
    for prompt, o in zip(PROMPTS, outs):
        for c in o.outputs:
            ids = prompt + list(c.token_ids)
            lp = SamplingParams(max_tokens=1, prompt_logprobs=params.logprobs)
            out = llm.generate([{"prompt_token_ids": ids}], lp, use_tqdm=False)[0]
            assert out.prompt_logprobs is not None
            c_scored = copy.copy(c)
            c_scored.logprobs = out.prompt_logprobs[len(prompt) :]
            scored.append((o, c_scored))
    result = []
    for o in outs:
        o_scored = copy.copy(o)
        o_scored.outputs = [c for owner, c in scored if owner is o]
        result.append(o_scored)
    return result


def test_preemption_and_stops(folder: str) -> None:
    """A pool too small for all three requests preempts; a stop token inside accepted drafts
    ends the request there; max_tokens is never passed."""
    small = {"num_gpu_blocks_override": 12}
    plain = _llm(folder, None, **small)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = _run(plain, greedy)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 9 and t not in first[:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        greedy,
    ]
    expected = _run(plain, params)
    assert plain.engine.stats().num_preemptions > 0
    spec = _llm(folder, NGRAM, **small)
    oracle = _with_oracle(spec, expected)
    got = _run(spec, params)
    assert _tokens(got) == _tokens(expected)
    assert spec.engine.stats().num_preemptions > 0 and oracle.proposed > 0
    assert got[0].outputs[0].token_ids[-1] == stop and got[0].outputs[0].finish_reason == "stop"
    assert len(got[0].outputs[0].token_ids) >= 10
    assert len(got[1].outputs[0].token_ids) == 7


def test_no_proposals_in_large_batches(folder: str, plain: LLM) -> None:
    """disable_by_batch_size: while more requests run than that, nothing is proposed; the
    last request left alone speculates again."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 14, MAX_TOKENS)
    ]
    expected = _run(plain, params)
    spec = _llm(folder, {**NGRAM, "disable_by_batch_size": 1})
    oracle = _with_oracle(spec, expected)
    assert _tokens(_run(spec, params)) == _tokens(expected)
    assert oracle.batch_sizes and set(oracle.batch_sizes) == {1} and oracle.proposed > 0


def test_config_errors(folder: str) -> None:
    with pytest.raises(ValueError, match="async scheduling"):
        _llm(folder, NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _llm(folder, {"method": "ngram"})
    with pytest.raises(ValueError, match="needs a quantization"):
        _llm(folder, {"model": "self", "num_speculative_tokens": 2})


COPY_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and watched the ships pass safely along the rocky coast."
)


def test_ngram_on_smollm2_accepts_copied_text(smollm2_path: str, smollm2_llm: LLM) -> None:
    """The real proposer: SmolLM2 (float32) asked to repeat a passage; greedy output equals the
    plain run's, and most of it comes from accepted drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}]
    expected = smollm2_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(
        smollm2_path,
        quantization="none",
        max_model_len=512,
        num_gpu_blocks_override=64,
        speculative_config=NGRAM,
    )
    got = spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    stats = spec.engine.stats()
    print(f"\nngram on SmolLM2 copying: {len(got.token_ids)} tokens, {stats}")
    assert stats.spec_num_accepted_tokens >= len(got.token_ids) // 2, stats


# its fast variant: tests/unit/test_cpu_kernels.py (the attention gives a request the same bits
# in any batch; the matmuls are row-wise by construction)
@pytest.mark.slow
def test_ngram_on_the_smollm2_gguf_at_o2_keeps_the_plain_bits(
    smollm2_path: str, smollm2_o2_llm: LLM
) -> None:
    """SmolLM2's GGUF at -O2 (the copy benchmark's engine): pure verification steps run as
    compiled one-token rows on the CPU kernels, which give a row the same bits in any batch, so
    the greedy tokens and their log-probs equal the plain engine's exactly; before the attention
    split requests by their own length, a near-tie flipped a token of the copy workload."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    ngram = LLM(
        smollm2_path,
        optimization_level=2,
        max_model_len=512,
        num_gpu_blocks_override=256,
        speculative_config=NGRAM,
    )
    assert ngram.engine.executor.runner.compiled is not None
    # the copy benchmark's second passage: its log-probs parted from position 34 before
    prompt = [{"prompt_token_ids": copy_prompts(ngram.get_tokenizer(), 2)[1]}]
    got = ngram.generate(prompt, params)[0].outputs[0]
    assert ngram.engine.stats().spec_num_accepted_tokens >= 16
    del ngram
    plain = smollm2_o2_llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == plain.token_ids
    assert got.logprobs is not None and plain.logprobs is not None
    for lp_got, lp_plain in zip(got.logprobs, plain.logprobs):
        assert {t: p.logprob for t, p in lp_got.items()} == {
            t: p.logprob for t, p in lp_plain.items()
        }


# ---- draft models ----------------------------------------------------------------------------
def _spec_counts(llm: LLM, run: Any) -> tuple[Any, int, int]:
    """run(), and the draft tokens it verified and accepted."""
    before = llm.engine.stats()
    result = run()
    after = llm.engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    return result, drafted, after.spec_num_accepted_tokens - before.spec_num_accepted_tokens


@pytest.fixture(scope="module")
def self_draft(folder: str) -> Iterator[LLM]:
    yield _llm(folder, SELF_INT4)


@pytest.mark.parametrize("case", list(CASES))
def test_self_draft(case: str, plain: LLM, self_draft: LLM) -> None:
    """The target's weights kept int4 as its draft. Greedy: the plain run's tokens and
    logprobs, the drafts partly accepted. Random rows sample their drafts from the draft's
    processed q and are verified against it (runner/draft_sampling.py; exactness:
    test_spec_sampling.py), so their tokens are other draws of the same distribution: seeded
    requests give the same tokens again, and their logprobs are the target's at the tokens
    they emit. (Not the same tokens alone as in a batch: a step's token budget may cut a
    request's drafts, whose draws its generator has made, so its stream depends on the steps
    that verified drafts; runner/draft_sampling.py.)"""
    params = CASES[case]
    expected = _run(plain, params)
    got, drafted, accepted = _spec_counts(self_draft, lambda: _run(self_draft, params))
    assert drafted > 0 and accepted > 0
    if case == "greedy":
        assert _tokens(got) == _tokens(expected)
        _check_logprobs(params, got, expected)
        assert drafted > accepted
    else:
        assert _tokens(got) != _tokens(expected)
        assert _tokens(_run(self_draft, params)) == _tokens(got)
        _check_logprobs(params, got, _scored(plain, got, params))
    # the draft runs on the target's KV cache: it never catches up on a prompt
    runner = self_draft.engine.executor.runner
    assert runner.draft_step is not None and runner.draft_step.kv_caches is runner.kv_caches
    proposer = runner.proposer.proposer  # type: ignore[union-attr]
    assert proposer.num_catch_up_tokens == proposer.num_proposals > 0
    if case == "greedy":
        assert drafted > accepted > 0


def test_a_bfloat16_target_with_its_gguf_self_draft(
    smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's float-output-at-4-bit-speed row on SmolLM2: the target in bfloat16 (-q none)
    with its GGUF kept Q4_1 as the draft. With PAGODA_CPU_HALF_KERNELS=1 (the CPU kernels'
    float16 form computes each row alone, layers/quant_forms.keep_cpu_float16) greedy tokens
    equal the bfloat16 engine's, its prompts batched there and alone here. Without it torch's
    bf16 GEMMs block rows by the batch, and a position verified among drafts, or decoded in a
    batch of 8, gets other bits than alone: 6 of these 8 answers differed without the switch on
    the AVX-512 machine."""
    monkeypatch.setenv("PAGODA_CPU_HALF_KERNELS", "1")
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    chats: list[Any] = [[{"role": "user", "content": q}] for q in CHAT[:8]]
    common: dict[str, Any] = dict(quantization="none", dtype="bfloat16", max_model_len=512)
    plain = LLM(smollm2_path, **common)
    expected = [o.outputs[0].token_ids for o in plain.chat(chats, params, use_tqdm=False)]
    del plain
    spec = {"model": "self", "quantization": "gguf", "num_speculative_tokens": 4}
    llm = LLM(smollm2_path, speculative_config=spec, **common)
    run = lambda: [llm.chat([c], params, use_tqdm=False)[0].outputs[0] for c in chats]  # noqa: E731
    got, drafted, accepted = _spec_counts(llm, run)
    assert accepted > drafted // 2
    assert [o.token_ids for o in got] == expected
    layer = llm.engine.executor.runner.model.model.layers[0]  # type: ignore[union-attr]
    assert layer.mlp.down_proj.kernel == "cpu_bf16"


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_own_checkpoint_as_draft_is_always_accepted(folder: str, num_blocks: int) -> None:
    """The draft is the target's checkpoint, with a KV cache of its own: each of its greedy
    drafts is the target's next token, so every one is accepted, through chunked prefill, a
    batch of three and (12 blocks) preemption and prefix-cache hits, only if the draft's KV is
    right at every position."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = _run(_llm(folder, None, num_gpu_blocks_override=num_blocks), params)
    # every catch-up, however long (a preempted request feeds its whole context again)
    spec = {"model": folder, "num_speculative_tokens": 3, "max_catch_up_ratio": None}
    llm = _llm(folder, spec, num_gpu_blocks_override=num_blocks)
    got, drafted, accepted = _spec_counts(llm, lambda: _run(llm, params))
    assert _tokens(got) == _tokens(expected)
    assert drafted == accepted > MAX_TOKENS
    runner = llm.engine.executor.runner
    assert runner.draft_step is not None and runner.draft_step.kv_caches is not runner.kv_caches
    stats = llm.engine.stats()
    assert (stats.num_preemptions > 0) == (num_blocks == 12)


@pytest.mark.parametrize("ratio, drafts", [("auto", False), (None, True)])
def test_no_catch_up_for_a_request_near_its_end(folder: str, ratio: Any, drafts: bool) -> None:
    """Two requests are more than disable_by_batch_size; when the first finishes, the second
    has about 40 tokens to feed the draft and 4 left to produce: the default max_catch_up_ratio
    ("auto": 2 on CPU) passes it over, None catches it up. The tokens are the same either way."""
    spec = {"model": folder, "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 24)]
    expected = _llm(folder, None).generate(prompts, params, use_tqdm=False)
    llm = _llm(folder, {**spec, "max_catch_up_ratio": ratio})
    got, drafted, accepted = _spec_counts(
        llm, lambda: llm.generate(prompts, params, use_tqdm=False)
    )
    assert _tokens(got) == _tokens(expected)
    assert (drafted > 0) == drafts and accepted == drafted


def test_draft_of_another_architecture(folder: str, plain: LLM, tiny_weights_dir: Any) -> None:
    """A Qwen2 (2 layers) drafting for the Llama (3 layers): its own cache shapes; its random
    drafts are rejected, so backoff soon stops proposing."""
    params = CASES["greedy"]
    expected = _run(plain, params)
    spec = {"model": tiny_weights_dir("qwen2"), "num_speculative_tokens": 3}
    llm = _llm(folder, spec)
    got, drafted, accepted = _spec_counts(llm, lambda: _run(llm, params))
    assert _tokens(got) == _tokens(expected)
    assert accepted == 0 and 0 < drafted < len(PROMPTS) * MAX_TOKENS


def _tiny_llama(path: Path, **overrides: Any) -> str:
    values: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        max_position_embeddings=1024,
    )
    values.update(overrides)
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(path)
    return str(path)


def test_draft_model_errors(folder: str, tmp_path: Path) -> None:
    """A draft must share the target's vocabulary and reach its max_model_len."""
    other_vocab = _tiny_llama(tmp_path / "vocab", vocab_size=1000)
    with pytest.raises(ValueError, match="draft model's vocabulary has 1000 tokens"):
        _llm(folder, {"model": other_vocab, "num_speculative_tokens": 2})
    short = _tiny_llama(tmp_path / "short", max_position_embeddings=32)
    with pytest.raises(ValueError, match="the draft model.*max_model_len=64"):
        _llm(folder, {"model": short, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="the draft model.*does not exist"):
        _llm(folder, {"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})


def test_draft_tokenizer_must_match(tiny_model_dir: Any, tmp_path: Path) -> None:
    """Same vocabulary size, one token spelled differently: rejected at load."""
    target = tiny_model_dir("llama")
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    tokenizer = AutoTokenizer.from_pretrained(draft)
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(["<draft-only>"])
    tokenizer.save_pretrained(draft)
    assert len(tokenizer.get_vocab()) == len(vocab) + 1
    spec = {"model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        LLM(target, speculative_config=spec, max_model_len=64, num_gpu_blocks_override=16)


# Slow for the default suite's time (33 s on a fresh machine): the tiny self-draft tests above are
# its fast variant; benchmarks/README quotes SmolLM2's self-draft figures.
@pytest.mark.slow
def test_quantized_self_draft_on_smollm2(smollm2_path: str, smollm2_llm: LLM) -> None:
    """SmolLM2: float32 target, its GGUF kept Q4_1 as the draft. Greedy output equals the
    float engine's; most tokens come from accepted drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages = [{"role": "user", "content": "Name three uses of a lighthouse."}]
    expected = smollm2_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    spec = {"model": "self", "quantization": "gguf", "num_speculative_tokens": 4}
    llm = LLM(smollm2_path, quantization="none", max_model_len=512, speculative_config=spec)
    run = lambda: llm.chat(messages, params, use_tqdm=False)[0].outputs[0]  # noqa: E731
    got, drafted, accepted = _spec_counts(llm, run)
    assert got.token_ids == expected.token_ids
    print(f"\nSmolLM2 self-draft: {len(got.token_ids)} tokens, {accepted} of {drafted} accepted")
    assert accepted >= len(got.token_ids) // 2
