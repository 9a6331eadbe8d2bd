"""Beam search on top of LLM.generate: one engine pass per step over every live beam.

The search for each prompt follows HF transformers' `generate(num_beams=...)` (its
`_beam_search`), so both give the same hypotheses, in the same order, with the same scores:

- Each step asks for the top K = max(2, 1 + number of EOS ids) * beam_width logprobs of every
  live beam (prefix caching makes the shared history cheap) and keeps the K best continuations
  of the prompt by cumulative logprob.
- A continuation that ends in EOS (unless ignore_eos), or reaches max_tokens, is finished.
  Finished ones ranked among the beam_width best of the K become hypotheses, scored
  cum_logprob / generated_len ** length_penalty; the others are dropped. The beam_width best
  hypotheses are kept.
- The beam_width best unfinished continuations are the next step's live beams.
- The search ends at max_tokens, or earlier as BeamSearchParams.early_stopping says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagoda.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

# Generates one step for token-id prompts: LLM.generate without a progress bar.
GenerateFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


def _score(seq: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    return seq.cum_logprob / ((len(seq.tokens) - prompt_len) ** length_penalty)


def beam_search(
    generate: GenerateFn,
    eos_token_ids: frozenset[int],
    tokenizer: Any,
    prompts: list[list[int]],
    params: BeamSearchParams,
) -> list[BeamSearchOutput]:
    """tokenizer: decodes the finished sequences' text; None leaves text None."""
    width = params.beam_width
    eos = eos_token_ids
    num_candidates = _num_candidates(width, eos)
    step_params = SamplingParams(
        max_tokens=1, temperature=params.temperature, logprobs=num_candidates, detokenize=False
    )
    live = [[BeamSearchSequence(tokens=list(p), logprobs=[])] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]  # best first, <= width each
    for step in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = generate([beam.tokens for _, beam in flat], step_params)
        candidates = _continuations(flat, outs, len(prompts))
        is_last = step + 1 == params.max_tokens
        for i, cands in enumerate(candidates):
            if not cands:
                continue
            prompt_len = len(prompts[i])
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            live[i] = []
            for rank, seq in enumerate(cands[:num_candidates]):
                hit_eos = not params.ignore_eos and seq.tokens[-1] in eos
                if hit_eos or is_last:
                    if rank < width:
                        seq.finish_reason = "stop" if hit_eos else "length"
                        done[i].append(seq)
                elif len(live[i]) < width:
                    live[i].append(seq)
            done[i] = sorted(
                done[i], key=lambda s: _score(s, prompt_len, params.length_penalty), reverse=True
            )[:width]
            if _is_done(done[i], live[i], step + 1, prompt_len, params):
                live[i] = []
    return [_with_text(hypotheses, tokenizer) for hypotheses in done]


def _num_candidates(width: int, eos: frozenset[int]) -> int:
    """K, the continuations each step keeps per prompt: enough for width live beams if the
    best end in EOS."""
    per_beam = max(2, 1 + len(eos))
    if per_beam * width > MAX_LOGPROBS:
        raise ValueError(
            f"beam_width must be at most {MAX_LOGPROBS // per_beam} for this model: each step "
            f"reads the top {per_beam} * beam_width logprobs of every beam and the engine "
            f"returns at most {MAX_LOGPROBS}; got beam_width={width}"
        )
    return per_beam * width


def _continuations(
    flat: list[tuple[int, BeamSearchSequence]], outs: list[RequestOutput], num_prompts: int
) -> list[list[BeamSearchSequence]]:
    """Each live beam (prompt index, beam) extended by every token of its step's logprobs,
    grouped by prompt."""
    candidates: list[list[BeamSearchSequence]] = [[] for _ in range(num_prompts)]
    for (i, beam), out in zip(flat, outs):
        step_lps = out.outputs[0].logprobs
        assert step_lps is not None
        for token, lp in step_lps[0].items():
            candidates[i].append(
                BeamSearchSequence(
                    tokens=beam.tokens + [token],
                    logprobs=beam.logprobs + [step_lps[0]],
                    cum_logprob=beam.cum_logprob + lp.logprob,
                )
            )
    return candidates


def _with_text(hypotheses: list[BeamSearchSequence], tokenizer: Any) -> BeamSearchOutput:
    for seq in hypotheses:
        if tokenizer is not None:  # None with skip_tokenizer_init: text stays None
            seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
    return BeamSearchOutput(sequences=hypotheses)


def _is_done(
    done: list[BeamSearchSequence],
    live: list[BeamSearchSequence],
    generated_len: int,
    prompt_len: int,
    params: BeamSearchParams,
) -> bool:
    """Whether the search of one prompt ends after a step that left `generated_len` tokens in
    each live beam (HF's rules). It goes on until beam_width hypotheses are finished; then
    early_stopping=True ends it, and otherwise it ends once the best live beam cannot beat the
    worst hypothesis. A beam's cumulative logprob only falls as it grows, so with
    length_penalty <= 0 its current score is the best it can reach; with length_penalty > 0,
    "never" bounds it at max_tokens (exact) and False takes the current length (HF's heuristic,
    which may stop before a better hypothesis is found)."""
    if not live:
        return True
    if len(done) < params.beam_width:
        return False
    if params.early_stopping is True:
        return True
    penalty = params.length_penalty
    length = generated_len
    if params.early_stopping == "never" and penalty > 0.0:
        length = params.max_tokens
    best_possible = max(s.cum_logprob for s in live) / length**penalty
    return best_possible <= min(_score(s, prompt_len, penalty) for s in done)
