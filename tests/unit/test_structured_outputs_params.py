"""StructuredOutputsParams (pagoda/structured_outputs.py): vLLM's fields, exactly one kind, the
schema kept canonical (so equal schemas share a compiled grammar), clear ValueErrors, and the
params' trip through SamplingParams and the engine contract's msgpack."""

from __future__ import annotations

import msgspec
import pytest

from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineRequest
from pagoda.structured_outputs import StructuredOutputsParams


def test_kinds_and_keys() -> None:
    a = StructuredOutputsParams(json={"type": "object", "required": ["b"]})
    b = StructuredOutputsParams(json='{"required": ["b"], "type": "object"}')
    assert a.kind == "json" and a == b and a.key == b.key  # the same canonical text
    assert StructuredOutputsParams(regex="[0-9]+").key == ("regex", "[0-9]+", False)
    choice = StructuredOutputsParams(choice=["x", "y"])
    assert choice.kind == "choice" and choice.choice == ("x", "y")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(grammar='start: "a"').kind == "grammar"
    loose = StructuredOutputsParams(json={"type": "object"})
    tight = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    assert loose.key != tight.key
    assert StructuredOutputsParams.from_value(choice.to_dict()) == choice
    assert StructuredOutputsParams.from_value(tight.to_dict()) == tight


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"grammar": 5}, "structured_outputs.grammar"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ],
)
def test_bad_fields_are_value_errors(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)  # type: ignore[arg-type]


def test_through_sampling_params_and_the_contract() -> None:
    params = SamplingParams(structured_outputs={"json": {"type": "integer"}}, n=2)
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="must be a dict"):
        SamplingParams(structured_outputs="[0-9]")  # type: ignore[arg-type]
    request = EngineRequest("r", [1, 2], params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest)
    assert decoded.sampling_params == params
    assert decoded.sampling_params.structured_outputs.key == params.structured_outputs.key  # type: ignore[union-attr]
    assert SamplingParams().structured_outputs is None
