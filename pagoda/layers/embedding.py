"""Token embedding and LM head. With tied embeddings the head shares the embedding's weight.

`quantize_int8()` (weight-quantized models) replaces the float weight with int8 rows and one scale
per row (on CPU in the kernels' tiles, layers/quant_forms.py): the embedding gathers and scales
rows, the head runs the int8 matmul. A tied head reads the embedding's stored form, so the
vocabulary matrix exists once. An untied head from a GGUF file keeps the file's own form on
pagoda's CPU kernels instead (a decode step reads it whole: Q6_K's 0.82 bytes a weight, not
int8 rows' 1.0; Q8_0 keeps its own group scales).

Under tensor parallelism both hold this rank's rows of the vocabulary (TensorParallel.vocab_part,
ceil(V / N) rows, the last rank's padded with zeros): the embedding zeroes the rows of ids it does
not hold and all-reduces; the head all-gathers the ranks' logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.cpu_forms import cpu_q8_rows
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.parallel import SINGLE, TensorParallel
from pagoda.layers.quant import gguf_cpu_form
from pagoda.layers.quant_forms import (
    apply_stored,
    cpu_kernels_for,
    keep_cpu_float16,
    set_int8,
    take_float_weight,
)


class _VocabRows(nn.Module):
    """The vocabulary matrix, or this rank's rows of it: weight (ceil(V / N), embedding_dim)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings  # the whole vocabulary
        self.embedding_dim = embedding_dim
        self.tp = tp
        self.vocab_start, self.vocab_len = tp.vocab_part(num_embeddings)
        rows = -(-num_embeddings // tp.size)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))

    def load(self, tensor: torch.Tensor | GGUFWeight, name: str) -> None:
        """Checkpoint tensor `name` (V, embedding_dim): this rank's rows, the padding zeroed."""
        if tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        rows = tensor.narrow(0, self.vocab_start, self.vocab_len)
        if isinstance(rows, GGUFWeight):
            rows = rows.dequantize()
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: self.vocab_len].copy_(rows)


class VocabEmbedding(_VocabRows):
    kernel = "float"
    qweight: torch.Tensor  # int8 rows, once quantized
    weight_scale: torch.Tensor
    dtype: torch.dtype  # of the float weight the rows replace

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp)

    def quantize_int8(self) -> None:
        set_int8(self, take_float_weight(self))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: (num_tokens,) -> (num_tokens, embedding_dim)
        if self.tp.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_len)
        rows = self._rows(torch.where(held, local, 0)) * held[:, None]
        return self.tp.all_reduce(rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel == "float":
            return F.embedding(ids, self.weight)
        if self.kernel == "cpu_q8":
            return cpu_q8_rows(self, ids).to(self.dtype)
        rows = F.embedding(ids, self.qweight).to(self.dtype)
        return rows * self.weight_scale[ids, None].to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kernel}"


class LMHead(_VocabRows):
    """Projects hidden states to float32 logits over the vocabulary."""

    kernel = "float"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp)
        self._tied: list[VocabEmbedding] = []  # a list keeps it out of the module tree
        self._gguf: GGUFWeight | None = None  # the file's blocks, until quantize_int8

    def load(self, tensor: torch.Tensor | GGUFWeight, name: str) -> None:
        super().load(tensor, name)
        # Only an untied head's own tensor: a tied matrix that a later pipeline stage loads for
        # its head stays int8 rows, as the one-process model's tied head (the embedding's).
        own = isinstance(tensor, GGUFWeight) and self.tp.size == 1 and name.startswith("lm_head.")
        self._gguf = tensor if own else None  # type: ignore[assignment]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = [embedding]

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    def quantize_int8(self) -> None:
        if self._tied:
            del self.weight  # the embedding holds (and quantizes) the shared matrix
            return
        blocks, self._gguf = self._gguf, None
        w = take_float_weight(self)
        if (
            blocks is not None
            and cpu_kernels_for(self) is not None
            and gguf_cpu_form(self, [blocks])
        ):
            return
        set_int8(self, w)

    def keep_half_on_cpu(self) -> None:
        """An untied float head's half-precision weight takes the CPU kernels' rows-alone form
        (quant_forms.keep_cpu_float16); a tied one stays the embedding's float matrix."""
        if not self._tied:
            keep_cpu_float16(self)

    def forward(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # hidden_states: (n, embedding_dim) -> logits (n, num_embeddings) float32, or in the
        # matmul's dtype (the model's) unless float32
        owner: Any = self._tied[0] if self._tied else self
        if owner.kernel == "float":
            logits = _float_logits(hidden_states, owner.weight)
        else:
            logits = apply_stored(owner, hidden_states)
        logits = self.tp.all_gather_last(logits, self.num_embeddings)
        return logits.float() if float32 else logits

    def extra_repr(self) -> str:
        tied = ", tied" if self._tied else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tied}"


# Rows for which a float32 LM head on CPU runs as W @ x^T: a vocabulary-sized weight with a few
# rows (speculative decoding verifies k + 1 positions a request; small decode batches) is 2.3x
# faster that way than F.linear with MKL on the 2-core AVX2 machine (SmolLM2's 49152 x 576:
# 5 rows 19.2 -> 8.5 ms, 16 rows 20.2 -> 14.4 ms; 1 row and 64 rows equal). The decoder's own
# (smaller) linears measured no gain, so only the LM head does it.
_TRANSPOSED_ROWS = range(2, 33)


def _float_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if (
        hidden_states.shape[0] in _TRANSPOSED_ROWS
        and hidden_states.device.type == "cpu"
        and weight.dtype == torch.float32
    ):
        return torch.mm(weight, hidden_states.t()).t().contiguous()
    return F.linear(hidden_states, weight)
