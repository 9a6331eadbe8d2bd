"""The one oracle every model and fast-path test compares pagoda with: HF transformers.

- `hf_greedy`: greedy tokens and per-step log-probabilities from HF, each prompt run alone
  (no padding), with HF's own KV cache. It always runs exactly max_tokens steps, as a pagoda
  request with ignore_eos and max_tokens does, so its finish reason is "length".
- `assert_greedy_matches`: the greedy outputs of one test's prompts against the oracle's (HF's,
  or for bf16 fast paths a pagoda reference run, `logprob_table`); `assert_outputs_match` takes
  LLM.generate's outputs. Tests call one of them, also for a single prompt: each applies
  `assert_greedy_match` to every prompt, then the tie budget (rule 5).
  `assert_greedy_match` checks one prompt, where `lp[s, t]` is the oracle's log-prob of token t
  at step s and `want`, `got` are the oracle's and pagoda's tokens:
  1. At each step s of the common length, got == want; with pagoda's log-probs given, pagoda's
     log-prob of its token is within `logprob_atol` of lp[s, got].
  2. At the first step s where got != want, the difference is accepted only as a near tie:
     lp[s, want] - lp[s, got] < tie_gap (the two chosen tokens, whatever their ranks). Steps after
     s are then not compared: they follow another prefix. An accepted tie is printed (`pytest -s`
     shows it) and s is returned; None when every compared token is equal.
  3. A tie needs at least MIN_EQUAL_TOKENS (8) equal tokens before it: the first 8 tokens
     (steps 0..7) agree, so a tie at s < 8 fails and the earliest accepted tie is at s == 8.
  4. Always, also after an accepted tie: pagoda gives as many tokens as the oracle, and pagoda's
     finish reason, where given, equals the expected one ("length" by default).
  5. (`assert_greedy_matches`) At most 1 in 5 prompts of a test may end at a tie: the test fails
     when 5 * ties > prompts, so a test of fewer than 5 prompts allows none.
  `tie_gap` defaults to TIE_GAP (1e-3), float32 rounding; bf16 paths pass BF16_TIE_GAP, whose
  reason is stated where it is defined.
- `hf_logits` / `assert_logits_close`: full-prompt logits, compared elementwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.outputs import RequestOutput, SampleLogprobs

TIE_GAP = 1e-3
# bf16 paths: logits rounded to bf16 step by 0.125 at |logit| in [16, 32), so an fp32-level
# difference between two bf16 computations (another kernel, fused code, accumulation order) that
# flips one rounding moves the gap of two logits by 0.125, and one on each of them by 0.25.
BF16_TIE_GAP = 0.25
MIN_EQUAL_TOKENS = 8
PROMPTS_PER_TIE = 5  # a test may end at most 1 in 5 prompts at a tie

# (token ids, (len(token ids), vocab) log-probs) of one prompt, as hf_greedy gives them.
Expected = tuple[Sequence[int], torch.Tensor]


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompt_ids_list: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (max_tokens greedy token ids, (max_tokens, vocab) float32 log-probs)."""
    device = next(model.parameters()).device
    results = []
    for prompt_ids in prompt_ids_list:
        input_ids = torch.tensor([list(prompt_ids)], device=device)
        past = None
        tokens: list[int] = []
        steps: list[torch.Tensor] = []
        for _ in range(max_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()
            token = int(logprobs.argmax())
            tokens.append(token)
            steps.append(logprobs)
            input_ids = torch.tensor([[token]], device=device)
        results.append((tokens, torch.stack(steps)))
    return results


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """(len(prompt_ids), vocab) float32 logits of one prompt."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=False)
    return out.logits[0].float().cpu()


def assert_logits_close(
    pagoda_logits: torch.Tensor, hf_logits: torch.Tensor, atol: float, what: str = "logits"
) -> None:
    pagoda_logits = pagoda_logits.float().cpu()
    assert pagoda_logits.shape == hf_logits.shape, (
        f"{what}: shape {tuple(pagoda_logits.shape)} != HF {tuple(hf_logits.shape)}"
    )
    err = (pagoda_logits - hf_logits).abs()
    worst = int(err.argmax())
    row, col = divmod(worst, hf_logits.shape[-1])
    assert err.max() <= atol, (
        f"{what}: max |pagoda - HF| = {err.max():.3e} > {atol:.1e} at row {row}, token {col} "
        f"(pagoda {pagoda_logits[row, col]:.6f}, HF {hf_logits[row, col]:.6f})"
    )


def logprob_table(logprobs: SampleLogprobs, vocab_size: int) -> torch.Tensor:
    """(len(logprobs), vocab_size) float32 table of a pagoda reference run's top-k log-probs,
    -inf elsewhere: a token outside the reference's top k is never within a tie gap."""
    table = torch.full((len(logprobs), vocab_size), float("-inf"))
    for step, entry in enumerate(logprobs):
        for token, lp in entry.items():
            table[step, token] = lp.logprob
    return table


def assert_greedy_match(
    pagoda_tokens: Sequence[int],
    hf_tokens: Sequence[int],
    hf_step_logprobs: torch.Tensor,
    pagoda_logprobs: Sequence[float] | None = None,
    *,
    finish_reason: str | None = None,
    expected_finish_reason: str = "length",
    tie_gap: float = TIE_GAP,
    logprob_atol: float = 1e-3,
    what: str = "greedy tokens",
) -> int | None:
    """Rules 1-4 of the module doc for one prompt. `pagoda_logprobs`: pagoda's log-prob of each
    of its tokens; `finish_reason`: pagoda's. Returns the step of an accepted tie, or None."""
    pagoda_tokens, hf_tokens = list(pagoda_tokens), list(hf_tokens)
    assert hf_step_logprobs.shape[0] == len(hf_tokens), "one row of oracle log-probs per token"
    if pagoda_logprobs is not None:
        assert len(pagoda_logprobs) == len(pagoda_tokens), "one pagoda log-prob per token"
    both = f"\n  pagoda: {pagoda_tokens}\n  oracle: {hf_tokens}"
    tie_step = None
    for step, (got, want) in enumerate(zip(pagoda_tokens, hf_tokens)):
        if got != want:
            _check_tie(step, got, want, hf_step_logprobs[step], tie_gap, what, both)
            tie_step = step
        if pagoda_logprobs is not None:
            hf_lp = float(hf_step_logprobs[step, got])
            assert abs(pagoda_logprobs[step] - hf_lp) <= logprob_atol, (
                f"{what}: log-prob of token {got} at step {step}: pagoda "
                f"{pagoda_logprobs[step]:.6f}, oracle {hf_lp:.6f} (atol {logprob_atol})"
            )
        if tie_step is not None:
            break
    assert len(pagoda_tokens) == len(hf_tokens), (
        f"{what}: pagoda produced {len(pagoda_tokens)} tokens, the oracle {len(hf_tokens)}{both}"
    )
    if finish_reason is not None:
        assert finish_reason == expected_finish_reason, (
            f"{what}: finish reason {finish_reason!r}, expected {expected_finish_reason!r}"
        )
    return tie_step


def _check_tie(
    step: int,
    got: int,
    want: int,
    step_logprobs: torch.Tensor,
    tie_gap: float,
    what: str,
    both: str,
) -> None:
    """Rules 2 and 3 at the first differing step; prints the accepted tie."""
    lp_want, lp_got = float(step_logprobs[want]), float(step_logprobs[got])
    gap = lp_want - lp_got
    rank = int((step_logprobs > lp_got).sum()) + 1
    seen = (
        f"step {step}: pagoda {got} (oracle log-prob {lp_got:.6f}, rank {rank}), "
        f"oracle {want} ({lp_want:.6f}), gap {gap:.3e}"
    )
    assert gap < tie_gap, f"{what}: tokens differ at {seen}, not a near tie (< {tie_gap:.1e}){both}"
    assert step >= MIN_EQUAL_TOKENS, (
        f"{what}: near tie at {seen} after only {step} equal tokens "
        f"(a tie needs at least {MIN_EQUAL_TOKENS}){both}"
    )
    print(f"oracle: near tie accepted, {what}, {seen} < {tie_gap:.1e}")


def assert_greedy_matches(
    pagoda_tokens: Sequence[Sequence[int]],
    expected: Sequence[Expected],
    pagoda_logprobs: Sequence[Sequence[float]] | None = None,
    *,
    finish_reasons: Sequence[str | None] | None = None,
    expected_finish_reason: str = "length",
    tie_gap: float = TIE_GAP,
    logprob_atol: float = 1e-3,
) -> list[int | None]:
    """All rules of the module doc for one test's prompts, in order: `expected[i]` is prompt i's
    (oracle tokens, log-probs); `pagoda_logprobs[i]` and `finish_reasons[i]` are pagoda's.
    Prints the number of ties; returns each prompt's tie step (None: all equal)."""
    assert len(pagoda_tokens) == len(expected), (
        f"{len(pagoda_tokens)} pagoda outputs for {len(expected)} prompts"
    )
    for given in (pagoda_logprobs, finish_reasons):
        assert given is None or len(given) == len(expected), "one entry per prompt"
    ties = []
    for i, (tokens, (hf_tokens, hf_step_logprobs)) in enumerate(zip(pagoda_tokens, expected)):
        ties.append(
            assert_greedy_match(
                tokens,
                hf_tokens,
                hf_step_logprobs,
                None if pagoda_logprobs is None else pagoda_logprobs[i],
                finish_reason=None if finish_reasons is None else finish_reasons[i],
                expected_finish_reason=expected_finish_reason,
                tie_gap=tie_gap,
                logprob_atol=logprob_atol,
                what=f"prompt {i}",
            )
        )
    num_ties = sum(step is not None for step in ties)
    print(f"oracle: {num_ties} of {len(ties)} prompts ended at a near tie (tie gap {tie_gap:.1e})")
    assert num_ties * PROMPTS_PER_TIE <= len(ties), (
        f"{num_ties} of {len(ties)} prompts ended at a near tie, at steps {ties}: more than "
        f"1 in {PROMPTS_PER_TIE}"
    )
    return ties


def assert_outputs_match(
    outputs: Sequence[RequestOutput], expected: Sequence[Expected], tie_gap: float = TIE_GAP
) -> list[int | None]:
    """`assert_greedy_matches` on the first completion of each of LLM.generate's (or chat's)
    outputs: tokens and finish reasons."""
    completions = [out.outputs[0] for out in outputs]
    return assert_greedy_matches(
        [c.token_ids for c in completions],
        expected,
        finish_reasons=[c.finish_reason for c in completions],
        tie_gap=tie_gap,
    )
