"""`--runner pooling` and `--pooler-config` (vLLM's names): how an embedding model turns a prompt's
hidden states into one vector (runner/pooler.py), and PoolingParams, a request's own choices."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
# LAST: the last token's hidden state (causal embedding models: Qwen3-Embedding, e5-mistral);
# MEAN: the mean over the prompt's tokens; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's --pooler-config, e.g. '{"pooling_type": "MEAN", "normalize": false}'. A field left
    None is the checkpoint's (its sentence-transformers files, loading/pooling.py), else LAST
    with normalize true (vLLM's default for a causal LM run as an embedding model)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                    f"got {self.pooling_type!r}"
                )
            object.__setattr__(self, "pooling_type", kind)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"pooler_config: normalize must be true or false, got {self.normalize!r}"
            )

    @classmethod
    def parse(cls, value: PoolerConfig | Mapping[str, Any] | str | None) -> PoolerConfig | None:
        """A PoolerConfig, its dict or its JSON object text; ValueError naming a bad field."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from e
        if not isinstance(value, Mapping):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"pooler_config: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)

    def over(self, base: PoolerConfig) -> PoolerConfig:
        """These fields where set, `base`'s elsewhere."""
        return PoolerConfig(
            self.pooling_type if self.pooling_type is not None else base.pooling_type,
            self.normalize if self.normalize is not None else base.normalize,
        )


DEFAULT_POOLER = PoolerConfig("LAST", True)


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's own choices (vLLM's PoolingParams): `dimensions` keeps the first N
    values (Matryoshka models only), `normalize` (None: the pooler's) scales to unit length
    after that cut."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an int >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
