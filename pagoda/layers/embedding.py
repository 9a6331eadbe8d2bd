"""Token embedding and LM head. With tied embeddings the head shares the embedding's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,) -> (num_tokens, embedding_dim)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Projects hidden states to float32 logits over the vocabulary."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: (n, embedding_dim) -> logits (n, num_embeddings) float32
        return F.linear(hidden_states, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
