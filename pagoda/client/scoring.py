"""The client's side of a classifier (--runner pooling on a sequence-classification model, or a
causal LM under the Qwen3-Reranker recipe; loading/classifier.py): which calls it takes, the
pairs a score request compares and their prompts, and the engine's label logits turned into a
score (sigmoid, one label) or probabilities (softmax, several).

A pair is tokenized as the tokenizer's text pair, `tokenizer(text_1, text_2)`, as
sentence-transformers' CrossEncoder and vLLM do: the tokenizer's pair template (BERT-style
separators; Llama and Qwen tokenizers concatenate the two). The Qwen3-Reranker's own prompt is
the caller's to write: its instruction and query in text_1, the document and the template's
ending in text_2.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagoda.client.tokenizer import Prompt
from pagoda.scheduling.messages import EngineInfo

NEEDS_CLASSIFIER = (
    "a sequence-classification model run with --runner pooling: a *ForSequenceClassification "
    "checkpoint, or a causal LM with --hf-overrides naming classifier_from_token (the "
    "Qwen3-Reranker recipe)"
)


def check_classifier(info: EngineInfo, what: str, one_label: bool) -> None:
    """ValueError unless the engine runs a classifier, with one label when `one_label` (a
    score): `what` names the call in the message."""
    if info.num_labels == 0:
        runs = "generates text" if info.pooling_type is None else "embeds"
        raise ValueError(f"{what} needs {NEEDS_CLASSIFIER}; this model {runs}")
    if one_label and info.num_labels != 1:
        raise ValueError(
            f"{what} needs one score per input, but this classifier has {info.num_labels} labels "
            "(LLM.classify gives their probabilities)"
        )


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 with each text_2 (1:1, 1:N) or element-wise (N:N). ValueError
    naming the field for an empty side or other lengths."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, side in (("text_1", left), ("text_2", right)):
        if not side:
            raise ValueError(f"{name} must not be empty")
        if not all(isinstance(t, str) for t in side):
            raise ValueError(f"{name} must be a string or a list of strings")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(
            f"text_1 and text_2 must pair 1:1, 1:N or N:N; got {len(left)} and {len(right)}"
        )
    return list(zip(left, right))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str) -> Prompt:
    """The prompt of one pair: the tokenizer's text-pair encoding (its text is not kept)."""
    ids: list[int] = list(tokenizer(text_1, text_2)["input_ids"])
    return None, ids


def label_probs(pooled: bytes) -> list[float]:
    """The engine's label logits (float32) -> sigmoid of one logit (sentence-transformers'
    CrossEncoder and vLLM for num_labels 1), else the softmax over the labels."""
    logits = np.frombuffer(pooled, dtype=np.float32).astype(np.float64)
    if logits.size == 1:
        return [float(1.0 / (1.0 + np.exp(-logits[0])))]
    exp = np.exp(logits - logits.max())
    return [float(p) for p in exp / exp.sum()]
