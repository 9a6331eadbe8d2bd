"""The JSON objects config flags take (--kv-transfer-config, --pooler-config, --hf-overrides):
given as JSON text (the CLI) or as a mapping (Python)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any


def json_object(value: Mapping[str, Any] | str, name: str) -> Mapping[str, Any]:
    """`value` as a mapping: parsed if it is JSON text; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def config_fields(value: Mapping[str, Any] | str, name: str, cls: type) -> Mapping[str, Any]:
    """json_object, whose keys must all be fields of the dataclass `cls` (ValueError naming
    the unknown ones and the known)."""
    fields = json_object(value, name)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return fields
