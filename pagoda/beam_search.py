"""Beam search on top of LLM.generate: one engine pass per step over every live beam.

Each step asks for the top 2 * beam_width logprobs of every live beam (prefix caching makes the
shared history cheap), then keeps the beam_width best continuations per prompt by cumulative
logprob. A continuation that emits EOS is set aside as a finished hypothesis scored
cum_logprob / generated_len ** length_penalty (as HF transformers does); the search for a
prompt ends when max_tokens is reached or no live beam can beat the worst kept hypothesis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.outputs import BeamSearchOutput, BeamSearchSequence
from pagoda.sampling import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagoda.llm import LLM


def _score(seq: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    return seq.cum_logprob / ((len(seq.tokens) - prompt_len) ** length_penalty)


def beam_search(
    llm: LLM, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    width = params.beam_width
    eos = llm.engine.eos_token_ids
    step_params = SamplingParams(
        max_tokens=1, temperature=params.temperature, logprobs=2 * width, detokenize=False
    )
    live = [[BeamSearchSequence(tokens=list(p), logprobs=[])] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outs = llm.generate(
            [{"prompt_token_ids": beam.tokens} for _, beam in flat], step_params, use_tqdm=False
        )
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
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
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            live[i] = []
            for rank, seq in enumerate(cands[: 2 * width]):
                if not params.ignore_eos and seq.tokens[-1] in eos:
                    if rank < width:
                        seq.finish_reason = "stop"
                        done[i].append(seq)
                    continue
                live[i].append(seq)
                if len(live[i]) == width:
                    break
            done[i] = sorted(
                done[i],
                key=lambda s: _score(s, len(prompts[i]), params.length_penalty),
                reverse=True,
            )[:width]
            if _is_done(done[i], live[i], len(prompts[i]), params):
                live[i] = []
    results = []
    for i, prompt in enumerate(prompts):
        for seq in live[i]:
            seq.finish_reason = "length"
        ranked = sorted(
            done[i] + live[i],
            key=lambda s: _score(s, len(prompt), params.length_penalty),
            reverse=True,
        )[:width]
        for seq in ranked:
            if llm.tokenizer is not None:  # None with skip_tokenizer_init: text stays None
                seq.text = llm.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        results.append(BeamSearchOutput(sequences=ranked))
    return results


def _is_done(
    done: list[BeamSearchSequence],
    live: list[BeamSearchSequence],
    prompt_len: int,
    params: BeamSearchParams,
) -> bool:
    """HF's early_stopping=False heuristic: stop once width hypotheses are kept and the best
    live beam, normalized at its current length, cannot beat the worst of them."""
    if len(done) < params.beam_width or not live:
        return not live
    worst = min(_score(s, prompt_len, params.length_penalty) for s in done)
    best_live = max(_score(s, prompt_len, params.length_penalty) for s in live)
    return best_live <= worst
