"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts and mixes their
outputs by the router's weights.

Experts are gated MLPs of their own (each a `make_expert(index)` module: gate_up_proj, its
activation, down_proj), so each keeps the checkpoint's form through the usual quantization
methods (a GGUF file's `ffn_*_exps` blocks stay quantized, one expert's rows each). A step runs
expert by expert over the tokens routed to it (one gather, two projections, one scatter-add
each): no loop over tokens, and experts no token chose cost nothing.

Under tensor parallelism the experts are split across the ranks, not sharded (expert
parallelism): rank r holds experts [r * E / N, (r + 1) * E / N), whole; every rank routes every
token, computes its own experts' share and the ranks' shares are summed (all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.parallel import SINGLE, TensorParallel


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        make_expert: Callable[[int], nn.Module],
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        router: nn.Module | None = None,
    ) -> None:
        """make_expert(index): expert `index`'s MLP, whole (never sharded); router: the `gate`
        module when the family's is not a plain Router (it then overrides `route`)."""
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = tp
        self.first_expert, self.num_held = tp.part(num_experts, "num_experts")
        # the router, whole on every rank and never quantized (a rounded logit can pick
        # another expert)
        self.gate = router if router is not None else Router(hidden_size, num_experts, dtype)
        # every expert's slot, so that checkpoint names index the list; other ranks' are None
        self.experts = nn.ModuleList(
            make_expert(e) if self.holds(e) else _Elsewhere() for e in range(num_experts)
        )

    def holds(self, e: int) -> bool:
        """Whether this rank holds expert e."""
        return self.first_expert <= e < self.first_expert + self.num_held

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, top_k) expert ids and their weights (in x's dtype), HF's rule: softmax
        over all experts in float32, the top k, renormalized to sum 1 if norm_topk_prob."""
        logits = self.gate(x)  # (num_tokens, num_experts)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) -> (num_tokens, hidden_size)
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.flatten()  # (num_tokens * top_k,): token t's choices at t * top_k + j
        flat_weights = weights.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        start = 0
        for e, count in enumerate(counts):
            rows = order[start : start + count]
            start += count
            if count == 0 or not self.holds(e):
                continue
            tokens = rows // self.top_k
            y = self.experts[e](x.index_select(0, tokens))  # (count, hidden_size)
            y = y * flat_weights.index_select(0, rows).unsqueeze(1)
            out.index_add_(0, tokens, y)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class Router(nn.Module):
    """weight: (num_experts, hidden_size), HF's mlp.gate.weight."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Elsewhere(nn.Module):
    """An expert another tensor-parallel rank holds."""
