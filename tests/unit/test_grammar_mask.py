"""The grammar pieces without a model: the bitmask applied to logits (runner/grammar_mask.py),
grammars checked before queueing, and matchers advanced and ended (engine/grammar.py) with the
SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pagoda.engine.grammar import GrammarCompiler, check_structured_outputs
from pagoda.runner.grammar_mask import apply_grammar_bitmask
from pagoda.structured_outputs import StructuredOutputsParams


def _bitmask(vocab: int, allowed: list[int]) -> bytes:
    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    return words.tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_bans_every_other_token_of_its_rows_only(dtype: torch.dtype) -> None:
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocab
    logits = torch.randn(3, vocab).to(dtype)
    before = logits.clone()
    allowed = [0, 31, 32, 63, 99]
    masks = {"b": [_bitmask(vocab, allowed)]}
    assert apply_grammar_bitmask(logits, ["a", "b", "c"], masks)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == allowed
    assert torch.equal(logits[1, allowed], before[1, allowed])
    assert not apply_grammar_bitmask(logits, ["a", "c"], masks)  # no row with a grammar


def test_a_short_bitmask_is_refused() -> None:
    with pytest.raises(ValueError, match="bitmask"):
        apply_grammar_bitmask(torch.zeros(1, 64), ["a"], {"a": [_bitmask(32, [0])]})


def test_a_sample_verifying_drafts_gets_one_mask_per_position() -> None:
    """Rows of a sample are its positions in order; a position without a mask (after a draft
    the grammar refused) is left alone."""
    vocab = 40
    logits = torch.zeros(5, vocab)
    masks = {"s": [_bitmask(vocab, [1]), _bitmask(vocab, [2, 3])], "t": [_bitmask(vocab, [39])]}
    assert apply_grammar_bitmask(logits, ["s", "t", "s", "s", "u"], masks)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[1], [39], [2, 3], list(range(vocab)), list(range(vocab))]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"regex": "(unclosed"}, "structured_outputs.regex is invalid"),
        ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
        ({"grammar": "start: missing"}, "structured_outputs.grammar"),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
    ],
)
def test_invalid_grammars_name_their_field(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_structured_outputs(StructuredOutputsParams(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json_object": True},
        {"regex": "[a-z]+@[a-z]+\\.com"},
        {"choice": ["a", "b c"]},
        {"grammar": 'start: "x" | "y"'},
        {"grammar": 'root ::= "x" | "y"'},
    ],
)
def test_valid_grammars_pass(fields: dict[str, Any]) -> None:
    check_structured_outputs(StructuredOutputsParams(**fields))


def test_compiled_once_per_key_and_advanced_to_its_end(smollm2_tokenizer: Any) -> None:
    compiler = GrammarCompiler(lambda: smollm2_tokenizer, 49152, [2])
    params = StructuredOutputsParams(choice=["yes", "no"])
    first = compiler.compile(params)
    assert compiler.compile(StructuredOutputsParams(choice=["yes", "no"])) is first
    matcher = first.result(timeout=60).deep_copy()
    ids = smollm2_tokenizer.encode("yes")
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    assert matcher.is_stopped()  # nothing can follow "yes": the engine finishes the sample
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    allowed = [t for t in range(49152) if mask[t // 32] >> (t % 32) & 1]
    assert allowed == [2]  # only EOS after "yes"
    compiler.shutdown()
