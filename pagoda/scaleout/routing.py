"""Prefix-aware routing across replicas, so that prefix caching survives scale-out: requests that
share the start of their prompt go to the same replica, which then holds those blocks, unless it
is busier than the least-loaded replica by more than a slack. Nothing here imports ray; the Ray
Serve app's request router calls choose_replica with its replicas' queue lengths.

    key        a hash of the prompt's first `prefix_tokens` tokens (or, for text, the first
               `prefix_tokens` * 4 characters: about as many tokens), so prompts that share
               their first blocks share a key
    preferred  rendezvous (highest-random-weight) hashing of the key over the replicas: each
               key has a stable order of replicas, and adding or removing a replica moves only
               the keys that replica wins or held (about 1/N of them), not the others
    load       the first replica in that order whose load is within `max_imbalance` requests of
               the least-loaded replica's; the least-loaded one qualifies, so there always is one
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

# Characters per token assumed for a text prompt's prefix (English BPE averages about 4).
CHARS_PER_TOKEN = 4


def prefix_key(prompt: str | Sequence[int], prefix_tokens: int = 64) -> bytes | None:
    """The routing key of a prompt (text, or token ids); None for an empty prompt."""
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    if isinstance(prompt, str):
        head = prompt[: prefix_tokens * CHARS_PER_TOKEN].encode("utf-8")
    else:
        head = b",".join(str(int(t)).encode() for t in prompt[:prefix_tokens])
    return hashlib.sha256(head).digest() if head else None


def rendezvous_order(key: bytes, replicas: Sequence[str]) -> list[str]:
    """The replicas in the key's order of preference (highest hash of key and replica first)."""
    return sorted(replicas, key=lambda r: hashlib.sha256(key + r.encode()).digest(), reverse=True)


def choose_replica(key: bytes | None, loads: Mapping[str, int], max_imbalance: int = 4) -> str:
    """The replica for a request with routing key `key` (None: no prefix to follow), given each
    replica's load (requests queued or running on it)."""
    if not loads:
        raise ValueError("no replica to route to")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    least = min(loads.values())
    if key is None:
        return min(loads, key=lambda r: (loads[r], r))
    for replica in rendezvous_order(key, list(loads)):
        if loads[replica] <= least + max_imbalance:
            return replica
    raise AssertionError("unreachable: the least-loaded replica qualifies")
