"""Structured outputs in the runner: the engine's grammar bitmasks applied to a step's logits.

The engine computes each grammar sample's allowed tokens for the step (engine/grammar.py) and
sends them in SchedulerOutput.grammar_bitmask: int32 rows per sample, one per position it samples
(several when it verifies drafts), bit t % 32 of word t // 32 set when token t is allowed. Disallowed tokens' logits become -inf before sampling, so
every sampling method (greedy, temperature, top-k/p, min-p, penalties, seeds) draws only allowed
tokens, and the rows without a grammar are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, row_ids: Sequence[str], bitmasks: dict[str, list[bytes]]
) -> bool:
    """Mask logits (R, vocab) in place: the j-th row of sample s (its j-th position) by
    bitmasks[s][j] where there is one. Whether any row was masked (a precomputed argmax is then
    stale)."""
    if not bitmasks:  # no grammar this step: nothing to walk
        return False
    rows: list[int] = []
    chosen: list[bytes] = []
    position: dict[str, int] = {}
    for i, rid in enumerate(row_ids):
        masks = bitmasks.get(rid)
        if masks is None:
            continue
        j = position[rid] = position.get(rid, -1) + 1
        if j < len(masks):
            rows.append(i)
            chosen.append(masks[j])
    if not rows:
        return False
    # int32 words are little-endian, so bit t of the row's bytes read little-endian is token t.
    # Each byte becomes its 8 additive biases (0 allowed, -inf banned) by a table lookup, and
    # the biases are added to the rows: several times faster on CPU than a boolean masked_fill.
    packed = np.frombuffer(b"".join(chosen), dtype=np.uint8).reshape(len(rows), -1)
    vocab = logits.shape[1]
    if packed.shape[1] * 8 < vocab:
        raise ValueError(f"a grammar bitmask of {packed.shape[1] * 8} tokens for {vocab} logits")
    codes = torch.from_numpy(packed.astype(np.int64)).to(logits.device)
    table = _bias_table(logits.dtype, logits.device)
    bias = torch.nn.functional.embedding(codes, table).view(len(rows), -1)[:, :vocab]
    if len(rows) == logits.shape[0]:  # rows are 0..R-1 in order
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
    return True


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8): byte value -> the bias of its 8 tokens, lowest bit first."""
    key = (dtype, device)
    if key not in _TABLES:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
        table = torch.from_numpy(np.where(bits == 1, 0.0, -np.inf).astype(np.float32))
        _TABLES[key] = table.to(device=device, dtype=dtype)
    return _TABLES[key]
