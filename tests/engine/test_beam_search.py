"""LLM.beam_search against HF transformers' generate(num_beams=...) on the same tiny random
Llama: the same hypotheses, in the same order, with the same scores, for hypotheses that end
in EOS, every early_stopping value and several length penalties."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, BeamSearchParams

PROMPT = [18205, 15730, 14606, 17183, 8635, 2140, 18079, 560]
# The tiny model's own EOS (2, also SmolLM2's tokenizer's) is never among the best continuations,
# so the model under test declares 38100 an EOS token too: HF's beams on PROMPT emit it early and
# often. Both engines then stop on {38100, 2}. The prompt and token were picked by running HF's
# beam search so that the cases below tell the early_stopping values apart (checked by
# test_the_cases_tell_early_stopping_values_apart).
EOS = 38100
EOS_IDS = [EOS, 2]

Hypotheses = list[tuple[list[int], float]]  # (prompt + generated tokens, score), best first


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir: Callable[[str], str], tmp_path_factory: Any) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-eos") / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = EOS
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def llm(eos_model_dir: str) -> LLM:
    llm = LLM(eos_model_dir, num_gpu_blocks_override=256)
    assert llm.engine.eos_token_ids == frozenset(EOS_IDS)
    return llm


@pytest.fixture(scope="module")
def hf_beams(
    tiny_hf_model: Callable[[str], torch.nn.Module],
) -> Callable[..., Hypotheses]:
    hf = tiny_hf_model("llama")  # the same weights as eos_model_dir

    @functools.cache
    def run(width: int, max_tokens: int, length_penalty: float, early_stopping: Any) -> Hypotheses:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([PROMPT]),
                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                max_new_tokens=max_tokens,
                early_stopping=early_stopping,
                length_penalty=length_penalty,
                eos_token_id=EOS_IDS,
                pad_token_id=2,
                return_dict_in_generate=True,
                output_scores=True,
            )
        hypotheses = []
        for seq, score, beam_indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
            generated = int((beam_indices != -1).sum())  # the rest is padding
            hypotheses.append((seq[: len(PROMPT) + generated].tolist(), float(score)))
        return hypotheses

    return run


def pagoda_beams(
    llm: LLM, width: int, max_tokens: int, length_penalty: float, early_stopping: Any
) -> Hypotheses:
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    (result,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    hypotheses = []
    for s in result.sequences:
        generated = len(s.tokens) - len(PROMPT)
        ends_in_eos = s.tokens[-1] in EOS_IDS
        assert s.finish_reason == ("stop" if ends_in_eos else "length"), s
        assert ends_in_eos or generated == max_tokens
        hypotheses.append((s.tokens, s.cum_logprob / generated**length_penalty))
    return hypotheses


# (beam_width, max_tokens, length_penalty, early_stopping)
CASES = [
    *[(3, 10, 1.0, es) for es in (True, False, "never")],
    *[(3, 10, 2.0, es) for es in (True, False, "never")],
    (3, 10, 0.0, False),
    (3, 10, 0.5, True),
    (3, 10, -1.0, "never"),
    (4, 10, 1.0, "never"),
    (2, 10, 1.5, False),
]


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty", "early_stopping"), CASES)
def test_beam_search_matches_hf(
    llm: LLM,
    hf_beams: Callable[..., Hypotheses],
    width: int,
    max_tokens: int,
    length_penalty: float,
    early_stopping: Any,
) -> None:
    expected = hf_beams(width, max_tokens, length_penalty, early_stopping)
    got = pagoda_beams(llm, width, max_tokens, length_penalty, early_stopping)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, score), (_, hf_score) in zip(got, expected):
        assert score == pytest.approx(hf_score, rel=1e-4, abs=1e-4)


def test_the_cases_tell_early_stopping_values_apart(hf_beams: Callable[..., Hypotheses]) -> None:
    """Guards the cases above: with other weights they might no longer exercise EOS nor tell
    True, False and "never" apart (then pick another prompt and EOS token)."""
    lp2 = {es: hf_beams(3, 10, 2.0, es) for es in (True, False, "never")}
    assert lp2[True] != lp2[False]  # True stops at beam_width hypotheses; False goes on
    lp1 = {es: hf_beams(3, 10, 1.0, es) for es in (True, False, "never")}
    assert lp1[False] != lp1["never"]  # "never" searches on where False's heuristic stops
    for hypotheses in (*lp1.values(), *lp2.values()):
        assert any(tokens[-1] == EOS for tokens, _ in hypotheses)
    assert any(len(tokens) == len(PROMPT) + 10 for tokens, _ in lp2[False] + lp1["never"])


def test_ignore_eos_generates_max_tokens(llm: LLM, hf_beams: Callable[..., Hypotheses]) -> None:
    """With ignore_eos an EOS token is an ordinary token (vLLM's meaning): every hypothesis has
    max_tokens tokens and none stops early."""
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    (result,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    assert len(result.sequences) == 3
    assert all(len(s.tokens) == len(PROMPT) + 6 for s in result.sequences)
    assert all(s.finish_reason == "length" for s in result.sequences)
    assert any(EOS in s.tokens[len(PROMPT) :] for s in result.sequences)


def test_ignore_eos_matches_hf_when_eos_is_never_likely(
    tiny_model_dir: Callable[[str], str], tiny_hf_model: Callable[[str], torch.nn.Module]
) -> None:
    """On the tiny model with its own EOS (never among the best continuations), ignore_eos
    equals HF with EOS banned until max_new_tokens."""
    llm = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=256)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    (result,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    with torch.no_grad():
        expected = tiny_hf_model("llama").generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            max_new_tokens=6,
            min_new_tokens=6,
            early_stopping=params.early_stopping,
            length_penalty=params.length_penalty,
        )
    assert [s.tokens for s in result.sequences] == [row.tolist() for row in expected]


def test_beam_search_batches_prompts_independently(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=6, early_stopping="never")
    other = [5, 6, 7, 8, 9]
    both = llm.beam_search([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}], params)
    alone = [llm.beam_search([{"prompt_token_ids": p}], params)[0] for p in (PROMPT, other)]
    assert [[s.tokens for s in r.sequences] for r in both] == [
        [s.tokens for s in r.sequences] for r in alone
    ]


def test_beam_width_beyond_the_logprobs_cap_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="beam_width must be at most 6"):
        llm.beam_search(
            [{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=7, max_tokens=2)
        )
