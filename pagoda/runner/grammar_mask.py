"""Structured outputs in the runner: the engine's grammar bitmasks applied to a step's logits.

The engine computes each grammar sample's allowed tokens for the step (engine/grammar.py) and
sends them in SchedulerOutput.grammar_bitmask: an int32 row per sample, bit t % 32 of word
t // 32 set when token t is allowed. Disallowed tokens' logits become -inf before sampling, so
every sampling method (greedy, temperature, top-k/p, min-p, penalties, seeds) draws only allowed
tokens, and the rows without a grammar are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, row_ids: Sequence[str], bitmasks: dict[str, bytes]
) -> bool:
    """Mask logits (R, vocab) in place: row i by bitmasks[row_ids[i]] if it has one. Whether any
    row was masked (a precomputed argmax is then stale)."""
    if not bitmasks:  # no grammar this step: nothing to walk
        return False
    rows = [i for i, rid in enumerate(row_ids) if rid in bitmasks]
    if not rows:
        return False
    # int32 words are little-endian, so bit t of the row's bytes read little-endian is token t.
    packed = np.frombuffer(b"".join(bitmasks[row_ids[i]] for i in rows), dtype=np.uint8)
    bits = np.unpackbits(packed.reshape(len(rows), -1), axis=1, bitorder="little")
    vocab = logits.shape[1]
    if bits.shape[1] < vocab:
        raise ValueError(f"a grammar bitmask of {bits.shape[1]} tokens for {vocab} logits")
    banned = torch.from_numpy(bits[:, :vocab] == 0).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, index, masked)
    return True
