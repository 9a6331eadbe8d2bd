"""The `score` head of HF's *ForSequenceClassification checkpoints (a Linear from the hidden
size to the labels, no bias), added to the family's causal LM class by the loader."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ScoreHead(nn.Module):
    """HF's `score`: hidden states (n, hidden_size) -> label logits (n, num_labels) float32."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_labels, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.to(self.weight.dtype), self.weight).float()


def add_score_head(model: Any, num_labels: int) -> None:
    """Make a DecoderForCausalLM (models/base.py) a sequence classifier: `score` loads from the
    checkpoint ("score.weight"), and the LM head the checkpoint lacks is tied to the embedding
    (no memory, no tensor to load): the runner's warm-up and memory profile run it, scores
    never read it."""
    dtype = model.dtype
    model.add_module("score", ScoreHead(int(model.config.hidden_size), num_labels, dtype))
    model.tie_word_embeddings = True
    if model.lm_head is not None and not model.lm_head.tied:
        if model.model.embed_tokens is None:
            raise ValueError("a sequence classifier runs without --pipeline-parallel-size")
        model.lm_head.tie_to(model.model.embed_tokens)
