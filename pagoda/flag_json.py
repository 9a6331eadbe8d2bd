"""The JSON objects config flags take (--kv-transfer-config, --pooler-config, --hf-overrides):
given as JSON text (the CLI) or as a mapping (Python)."""

from __future__ import annotations

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
