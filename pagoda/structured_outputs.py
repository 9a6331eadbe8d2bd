"""What a request's output must match: StructuredOutputsParams, vLLM's names, plain data.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (Lark, or GBNF as
llama.cpp writes it) or `json_object` (any JSON object) is given. The schema is kept as its
canonical JSON text, so the params are hashable and `key` names the compiled grammar in the
engine's cache. `reasoning_end` (set by the server's reasoning parser, not a request field): the
token ids of `</think>`; the grammar applies only to the tokens after them, as vLLM does.
Nothing here imports the grammar engine: the client, the contract and the scheduler read this
type; pagoda/engine/grammar.py compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, init=False)
class StructuredOutputsParams:
    json: str | None
    regex: str | None
    choice: tuple[str, ...] | None
    grammar: str | None
    json_object: bool
    disable_any_whitespace: bool
    reasoning_end: tuple[int, ...] | None

    def __init__(
        self,
        json: str | dict[str, Any] | None = None,  # noqa: A002 - vLLM's field name
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        disable_any_whitespace: bool = False,
        reasoning_end: tuple[int, ...] | None = None,
    ) -> None:
        given = [
            name
            for name, value in (
                ("json", json),
                ("regex", regex),
                ("choice", choice),
                ("grammar", grammar),
                ("json_object", json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        object.__setattr__(self, "json", _schema_text(json))
        object.__setattr__(self, "regex", _text("regex", regex))
        object.__setattr__(self, "choice", _choices(choice))
        object.__setattr__(self, "grammar", _text("grammar", grammar))
        object.__setattr__(self, "json_object", bool(json_object))
        if not isinstance(disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be a bool, got {disable_any_whitespace!r}"
            )
        object.__setattr__(self, "disable_any_whitespace", disable_any_whitespace)
        if reasoning_end is not None and not (
            reasoning_end and all(isinstance(t, int) and t >= 0 for t in reasoning_end)
        ):
            raise ValueError(f"reasoning_end must be token ids, got {reasoning_end!r}")
        object.__setattr__(
            self, "reasoning_end", None if reasoning_end is None else tuple(reasoning_end)
        )

    @property
    def kind(self) -> str:
        """Which of KINDS this is."""
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        return "json_object"

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, disable_any_whitespace): equal keys compile to the same grammar."""
        text = {
            "json": self.json,
            "regex": self.regex,
            "choice": None if self.choice is None else json.dumps(list(self.choice)),
            "grammar": self.grammar,
            "json_object": "",
        }[self.kind]
        assert text is not None
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_value(cls, value: object) -> StructuredOutputsParams | None:
        """None, the params themselves, or their fields as a dict (over the wire, from JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {*KINDS, "disable_any_whitespace"}
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a dict of its fields, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        value: Any = {
            "json": self.json,
            "regex": self.regex,
            "choice": list(self.choice or ()),
            "grammar": self.grammar,
            "json_object": True,
        }[self.kind]
        out = {self.kind: value}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def _schema_text(schema: object) -> str | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _text(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
    return value


def _choices(choice: object) -> tuple[str, ...] | None:
    if choice is None:
        return None
    if (
        not isinstance(choice, (list, tuple))
        or not choice
        or not all(isinstance(c, str) and c for c in choice)
    ):
        raise ValueError(
            f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
            f"{choice!r}"
        )
    return tuple(choice)
