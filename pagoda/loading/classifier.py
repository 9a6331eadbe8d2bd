"""A pooling model's classification head, as vLLM reads it from the checkpoint's config (after
--hf-overrides): a *ForSequenceClassification checkpoint's `score` Linear, or LM-head rows of
the tokens in `classifier_from_token` (the Qwen3-Reranker recipe with
`is_original_qwen3_reranker`)."""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineConfig
from pagoda.loading.tokenizer import load_tokenizer_for
from pagoda.pooler_config import CLASSIFIER_SUFFIX, Classifier


def classifier_of(
    config: EngineConfig, hf_config: Any, architecture: str, tokenizer: Any
) -> Classifier | None:
    """The head of a checkpoint whose architecture is a sequence classifier, None for others.
    `tokenizer` (loaded here when None) names classifier_from_token's ids. ValueError for a
    token outside the vocabulary or a Qwen3-Reranker recipe without exactly two tokens."""
    if not architecture.endswith(CLASSIFIER_SUFFIX):
        return None
    tokens = getattr(hf_config, "classifier_from_token", None)
    if not tokens:
        return Classifier(int(getattr(hf_config, "num_labels", 2)))
    if tokenizer is None:
        tokenizer = load_tokenizer_for(config)
    ids = tuple(_token_id(tokenizer, str(t)) for t in tokens)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        if len(ids) != 2:
            raise ValueError(
                'is_original_qwen3_reranker needs classifier_from_token ["no", "yes"] (two '
                f"tokens), got {list(tokens)}"
            )
        return Classifier(1, ids, yes_minus_no=True)
    return Classifier(len(ids), ids)


def _token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"classifier_from_token: {token!r} is not a token of the vocabulary")
    return token_id
