"""`--runner pooling` and `--pooler-config` (vLLM's names): how an embedding model turns a prompt's
hidden states into one vector (runner/pooler.py), and PoolingParams, a request's own choices."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.flag_json import config_fields, json_object

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
        value = config_fields(value, "pooler_config", cls)
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


CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_classifier(architectures: list[str]) -> bool:
    """Whether HF architecture names are a sequence-classification checkpoint's (a base model
    with a `score` head), which vLLM's runner "auto" runs as a pooling model."""
    return any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures)


def parse_hf_overrides(value: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """vLLM's --hf-overrides: a JSON object (or dict) of fields set on the checkpoint's config
    after it is read, e.g. the Qwen3-Reranker recipe's '{"architectures":
    ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}'."""
    if value is None:
        return None
    return dict(json_object(value, "hf_overrides"))


@dataclass(frozen=True)
class Classifier:
    """A pooling model's classification head (runner/pooler.py applies it to the LAST-pooled
    hidden state): the checkpoint's `score` Linear, or rows of the LM head named by
    `classifier_from_token` (vLLM's hf_overrides). `token_ids` empty: the score head;
    `yes_minus_no` (is_original_qwen3_reranker): one label, logit[yes] - logit[no] of
    token_ids = (no, yes), so that its sigmoid is softmax([no, yes])[yes]."""

    num_labels: int
    token_ids: tuple[int, ...] = ()
    yes_minus_no: bool = False


def folder_architectures(model: str | None) -> list[str]:
    """The architectures in a local checkpoint folder's config.json ([] for anything else: a
    GGUF file, the embedded model, a hub id not downloaded yet)."""
    path = None if model is None else os.path.join(model, "config.json")
    if path is None or not os.path.isfile(path):
        return []
    with open(path) as f:
        return [str(a) for a in json.load(f).get("architectures") or []]
