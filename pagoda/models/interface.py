"""The model interface the runner and the loader use: every registered family provides it
(models/__init__.py, the registry; models/base.py, DecoderForCausalLM, implements it), so
neither names a model class nor reaches into a model's modules."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from pagoda.layers.forward_context import ForwardContext


class Backbone(Protocol):
    """The decoder stack: token ids and positions (num_tokens,) -> hidden states
    (num_tokens, hidden_size). `ctx` is handed in by compiled steps (dynamo cannot trace the
    context variable); None reads it from forward_context()."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor: ...


class CausalLM(Protocol):
    @property
    def model(self) -> Backbone:
        """The decoder stack without the LM head (compiled decode steps run it)."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, stream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(num_tokens,) ids and positions -> (num_tokens, hidden_size), inside forward_context.
        Under pipeline parallelism a stage after the first takes the previous stage's `stream`,
        and a stage before the last returns its own (models/base.py, DecoderModel.forward)."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size) float32; float32=False: in the LM head's dtype
        (the model's), for a consumer that widens them in its own first pass (the Sampler)."""
        ...

    def set_kernel_backend(self, backend: str) -> None: ...

    def num_held_layers(self) -> int:
        """Decoder layers (and KV caches) this pipeline stage holds."""
        ...

    def rank_kv_heads(self) -> int:
        """KV heads in each of this rank's caches (its share under tensor parallelism)."""
        ...

    def vocab_layers(self) -> list[Any]:
        """The embedding and LM head this stage holds (quantize_int8 for weight-quantized runs)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Route HF-named tensors to their layers; returns what was written."""
        ...

    def expected_weights(self) -> set[str]: ...

    def finalize_weights(self) -> None: ...

    def modules(self) -> Iterator[nn.Module]: ...
