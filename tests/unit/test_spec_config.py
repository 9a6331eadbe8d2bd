"""SpeculativeConfig: vLLM's --speculative-config fields, defaults and errors (plain data)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagoda.model_config import QUANTIZATION_METHODS
from pagoda.speculative_config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DEFAULT_MAX_BACKOFF_STEPS,
    DEFAULT_PROMPT_LOOKUP,
    SPEC_METHODS,
    SpeculativeConfig,
)

parse = SpeculativeConfig.parse


def test_ngram_fields_as_given() -> None:
    c = parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 3,
        }
    )
    assert c is not None
    assert (c.method, c.num_speculative_tokens) == ("ngram", 4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3)
    assert (c.model, c.quantization, c.max_backoff_steps) == (None, None, DEFAULT_MAX_BACKOFF_STEPS)
    assert c.method == "ngram" and not c.is_self_draft and c.num_lookahead_slots == 4


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)),  # vLLM: both 5
        ({"prompt_lookup_min": 3}, (3, 3)),  # the missing one follows the other
        ({"prompt_lookup_max": 2}, (2, 2)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 1}, (1, 1)),
    ],
)
def test_ngram_lookup_defaults_follow_vllm(given: dict, expected: tuple[int, int]) -> None:
    c = parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert c is not None
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == expected


def test_json_string_is_the_cli_form() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    c = parse(text)
    assert c == SpeculativeConfig(num_speculative_tokens=3, method="ngram", prompt_lookup_max=4)
    assert c is not None and c.prompt_lookup_min == 4


def test_none_and_config_pass_through() -> None:
    assert parse(None) is None
    c = SpeculativeConfig(num_speculative_tokens=2)
    assert parse(c) is c


def test_model_without_method_is_a_draft_model() -> None:
    c = parse({"model": "/models/draft", "num_speculative_tokens": 5})
    assert c is not None
    assert (c.method, c.model, c.quantization) == ("draft_model", "/models/draft", None)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (None, None)
    assert c.method == "draft_model" and not c.is_self_draft


@pytest.mark.parametrize("quantization", ["gguf", "int4", "int8"])
def test_quantized_self_draft(quantization: str) -> None:
    c = parse({"model": "self", "quantization": quantization, "num_speculative_tokens": 4})
    assert c is not None and c.is_self_draft and c.quantization == quantization


def test_draft_quantization_takes_the_engines_methods() -> None:
    for q in QUANTIZATION_METHODS:
        c = parse(
            {"method": "draft_model", "model": "d", "quantization": q, "num_speculative_tokens": 1}
        )
        assert c is not None and c.quantization == q


@pytest.mark.parametrize(
    "values, names",
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 4}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 4, "foo": 1}, "foo"),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0},
            "prompt_lookup_max",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1.5},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 4, "model": "d"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 4, "quantization": "int4"}, "quantization"),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "model"),
        ({"method": "draft_model", "model": "", "num_speculative_tokens": 4}, "model"),
        ({"model": "d", "num_speculative_tokens": 4, "quantization": "q3"}, "quantization"),
        ({"model": "self", "num_speculative_tokens": 4}, "quantization"),
        ({"model": "self", "num_speculative_tokens": 4, "quantization": "none"}, "quantization"),
        ({"model": "d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "max_backoff_steps": -1},
            "max_backoff_steps",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": 0},
            "max_catch_up_ratio",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": -1.5},
            "max_catch_up_ratio",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": "2"},
            "max_catch_up_ratio",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": "fast"},
            "max_catch_up_ratio",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": True},
            "max_catch_up_ratio",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "max_catch_up_ratio": float("nan")},
            "max_catch_up_ratio",
        ),
    ],
)
def test_bad_values_name_the_field(values: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse(values)


def test_bad_json_and_non_objects() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        parse("{method: ngram}")
    with pytest.raises(ValueError, match="JSON object"):
        parse("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        parse(json.dumps(4))


def test_frozen_and_serializable() -> None:
    c = parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert c is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_speculative_tokens = 3  # type: ignore[misc]
    assert c.to_dict() == {
        "num_speculative_tokens": 2,
        "method": "ngram",
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 2,
        "max_backoff_steps": DEFAULT_MAX_BACKOFF_STEPS,
        "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE,
        "max_catch_up_ratio": "auto",
    }
    assert parse(c.to_dict()) == c
    assert hash(c) == hash(parse(json.dumps(c.to_dict())))


def test_every_method_a_config_takes_is_registered() -> None:
    """SpeculativeConfig validates method names without importing the proposers; each names a
    registered method (spec_decode/methods.py), and a draft model is what a `model` names."""
    from pagoda.spec_decode.methods import METHODS

    assert set(METHODS) == set(SPEC_METHODS)
    for name, method in METHODS.items():
        assert method.name == name
    assert METHODS["draft_model"].uses_draft_model and not METHODS["ngram"].uses_draft_model


@pytest.mark.parametrize(
    "given, cpu, cuda",
    [(None, None, None), ("auto", 2.0, None), (3, 3.0, 3.0), (0.5, 0.5, 0.5)],
)
def test_catch_up_ratio_per_device(given: object, cpu: float | None, cuda: float | None) -> None:
    """ "auto" (the default) bounds a draft's catch-up on CPU only, where the bound was measured;
    a number or null applies on every device."""
    values: dict = {"model": "d", "num_speculative_tokens": 2}
    if given != "auto":
        values["max_catch_up_ratio"] = given
    c = parse(values)
    assert c is not None
    assert (c.catch_up_ratio("cpu"), c.catch_up_ratio("cuda")) == (cpu, cuda)
