"""Speculative sampling with a draft model is exact at any temperature, shown on the engine's own
path: the draft samples its tokens from its processed q (runner/draft_sampling.py), the runner
verifies them by rejection sampling (runner/speculative.py, _verify_against_q), and the emitted
tokens are tested against the target's processed distribution p with a chi-square test.

For a known p and q the two models are tiny Llamas (different sizes, one vocabulary of 16) whose
embedding rows are all equal: every position then holds the same hidden state, so each model's
next-token distribution is one fixed vector whatever the context, and an exact engine emits
i.i.d. draws of p. Their LM heads are scaled up so p and q are far from uniform and from each
other (some drafts held, many not; top-k drops tokens from one and not the other). The same run
with the classic slip (after a rejection, draw from p instead of max(0, p - q)) patched into the
runner must fail the test, which shows it can tell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import pagoda.runner.speculative as speculative
from pagoda import LLM, SamplingParams
from pagoda.runner.draft_sampling import DraftSampler
from pagoda.runner.rejection_sampler import DraftLayout, VerifyOutput, rejection_sample
from pagoda.runner.sampler import Sampler
from tests.sampling_reference import metadata_from_rows
from tests.unit.test_rejection_sampler import chi2_sf

VOCAB = 16
TEMPERATURE = 0.7
TOP_K = 11  # 11 tokens left: 10 degrees of freedom (chi2_sf needs an even number)
NUM_REQUESTS = 64
MAX_TOKENS = 1700  # 64 x 1700 = 108,800 draws
PROMPT = [3, 1, 4, 1, 5]


def _constant_llama(path: Path, hidden: int, layers: int, seed: int) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(hidden).expand_as(embed))
        model.lm_head.weight.normal_(std=0.25)
    model.save_pretrained(path)
    return str(path)


def _next_token_probs(folder: str) -> torch.Tensor:
    """The model's one next-token distribution, processed as the requests' params process it:
    softmax(top-k(logits / temperature))."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE
    kth = logits.topk(TOP_K).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(dim=-1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("constant-pair")
    target = _constant_llama(root / "target", hidden=32, layers=2, seed=1)
    draft = _constant_llama(root / "draft", hidden=16, layers=1, seed=2)
    return target, draft


@pytest.fixture(scope="module")
def engine(pair: tuple[str, str]) -> Iterator[LLM]:
    target, draft = pair
    spec = {"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    yield LLM(
        target,
        speculative_config=spec,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=NUM_REQUESTS * 2048 // 16 + 16,
    )


def _draws(llm: LLM, max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, int, int]:
    """All emitted tokens of NUM_REQUESTS requests, and the drafts verified and accepted."""
    params = SamplingParams(
        temperature=TEMPERATURE, top_k=TOP_K, max_tokens=max_tokens, ignore_eos=True
    )
    before = llm.engine.stats()
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_REQUESTS, params, use_tqdm=False)
    after = llm.engine.stats()
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(tokens) == NUM_REQUESTS * max_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return torch.tensor(tokens), drafted, accepted


def _p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `tokens` to `probs`; tokens of probability 0 never occur."""
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "a token top-k removed was emitted"
    expected = probs[support].double() * tokens.shape[0]
    assert expected.min() >= 50
    statistic = float(((observed[support] - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(support.sum()) - 1)


def test_draft_model_sampling_is_distribution_exact(pair: tuple[str, str], engine: LLM) -> None:
    target_p, draft_q = (_next_token_probs(folder) for folder in pair)
    overlap = float(torch.minimum(target_p, draft_q).sum())
    assert 0.2 < overlap < 0.9, f"p and q must differ, yet overlap: {overlap:.3f}"
    # q's support is not p's: some drafts have p(x) = 0 (always rejected)
    assert bool(((draft_q > 0) & (target_p == 0)).any())
    torch.manual_seed(20261129)
    tokens, drafted, accepted = _draws(engine)
    print(
        f"\n{tokens.numel()} draws; {accepted} of {drafted} drafts accepted; overlap {overlap:.3f}"
    )
    # Each draft holds with probability sum_x min(p(x), q(x)) = overlap (one-hot drafts would
    # hold with sum_x p(x) q(x)), and draft i is verified only after drafts 0..i-1 held:
    # k = 3 drafts keep a + a^2 + a^3 of 3 on average. ~20k verifications put the rate within
    # 0.004 (one standard deviation) of that; the last steps' drafts cut by max_tokens, less.
    expected = sum(overlap**i for i in (1, 2, 3)) / 3
    one_hot = sum(float((target_p * draft_q).sum()) ** i for i in (1, 2, 3)) / 3
    assert accepted / drafted == pytest.approx(expected, abs=0.015)
    assert expected > one_hot + 0.05
    p_value = _p_value(tokens, target_p)
    print(f"acceptance {accepted / drafted:.4f} (expected {expected:.4f}); p = {p_value:.3g}")
    assert p_value > 0.01


def _resample_from_p(
    p: torch.Tensor, d: torch.Tensor, lay: DraftLayout, *args: Any, **kwargs: Any
) -> VerifyOutput:
    """The classic slip: at the first rejection, draw the token from p, not max(0, p - q)."""
    right = rejection_sample(p, d, lay, *args, **kwargs)
    fresh = torch.multinomial(p, 1).squeeze(1)[lay.target_index]  # (R, max_k + 1)
    cols = torch.arange(lay.max_k + 1, device=p.device)
    num_accepted = right.num_accepted.unsqueeze(1)
    at_rejection = (cols == num_accepted) & (num_accepted < lay.num_drafts.unsqueeze(1))
    return VerifyOutput(torch.where(at_rejection, fresh, right.token_ids), right.num_accepted)


def test_chi_square_catches_a_wrong_verifier_in_the_engine(
    pair: tuple[str, str], engine: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong: Callable[..., VerifyOutput] = _resample_from_p
    monkeypatch.setattr(speculative, "rejection_sample", wrong)
    torch.manual_seed(20261129)
    tokens, _, _ = _draws(engine, MAX_TOKENS // 4)
    p_value = _p_value(tokens, _next_token_probs(pair[0]))
    print(f"\nresampling from p: p = {p_value:.3g}")
    assert p_value < 1e-6, f"p = {p_value:.3g}: the test cannot tell this verifier is wrong"


def test_drafts_are_draws_of_the_processed_q(
    tiny_weights_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's q at each draft is its logits processed as the target processes that
    position (the reference builds the sampler's inputs the plain way, from token lists):
    logit bias, min_tokens' bans at num_outputs + j outputs, penalties counting the drafts
    before it, temperature, top-k/p, min-p. A greedy request keeps no q (one-hot drafts)."""
    captured: list[tuple[torch.Tensor, list[tuple[list[int], list[int]]], list[Any]]] = []
    sample = DraftSampler._sample

    def spy(self: DraftSampler, logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
        before = [self._proposals[r.request_id].tokens[:j] if j else [] for r, j in rows]
        seen = [
            (list(r.prompt_token_ids), list(r.output_token_ids) + d)
            for (r, _), d in zip(rows, before)
        ]
        tokens = sample(self, logits, rows)
        q = [self._proposals[r.request_id].probs[-1] for r, _ in rows]
        captured.append((logits.float().clone(), seen, q))
        return tokens

    monkeypatch.setattr(DraftSampler, "_sample", spy)
    llm = LLM(
        tiny_weights_dir("llama"),
        speculative_config={"model": "self", "quantization": "int4", "num_speculative_tokens": 3},
        skip_tokenizer_init=True,
        max_model_len=64,
        num_gpu_blocks_override=64,
        block_size=4,
    )
    eos = llm.engine.executor.runner.eos_token_ids
    params = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 2.0, 17: -3.0},
        min_tokens=6, stop_token_ids=[42], max_tokens=20, ignore_eos=True, seed=3,
    )  # fmt: skip
    llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT * 3}], params)
    assert len(captured) > 4
    vocab = captured[0][0].shape[1]
    for logits, seen, q in captured:
        prompts, outputs = [p for p, _ in seen], [o for _, o in seen]
        banned = [[*eos, 42] if len(o) < params.min_tokens else [] for o in outputs]
        meta = metadata_from_rows([params] * len(seen), outputs, prompts, {}, banned, vocab, "cpu")
        processed, own = Sampler.process(logits, meta)
        expected = Sampler.probabilities(processed, meta, own)
        torch.testing.assert_close(torch.stack(q), expected, rtol=1e-5, atol=1e-7)
    assert any(len(o) < params.min_tokens for _, seen, _ in captured for _, o in seen)

    captured.clear()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], greedy)
    assert captured and all(p is None for _, _, q in captured for p in q)
