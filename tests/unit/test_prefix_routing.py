"""Prefix-aware routing (pagoda/scaleout/routing.py): prompts that share their first blocks go
to one replica, spread evenly over replicas, move little when a replica is added, and leave a
preferred replica that is too busy for the next in their order."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagoda.scaleout.routing import (
    CHARS_PER_TOKEN,
    choose_replica,
    prefix_key,
    rendezvous_order,
)

REPLICAS = [f"replica-{i}" for i in range(4)]
IDLE = dict.fromkeys(REPLICAS, 0)


def test_a_shared_prefix_is_one_key() -> None:
    system = "You are a helpful assistant. " * 20  # longer than the prefix
    assert prefix_key(system + "What is 2 + 2?") == prefix_key(system + "Name a colour.")
    assert prefix_key("Hello there") != prefix_key("Goodbye now")
    ids = list(range(100))
    assert prefix_key(ids + [1, 2], prefix_tokens=64) == prefix_key(ids + [3], prefix_tokens=64)
    assert prefix_key(ids[:10], prefix_tokens=64) != prefix_key(ids[:11], prefix_tokens=64)
    assert prefix_key("") is None and prefix_key([]) is None
    short = "x" * (8 * CHARS_PER_TOKEN)
    assert prefix_key(short + "a", prefix_tokens=8) == prefix_key(short + "b", prefix_tokens=8)
    with pytest.raises(ValueError, match="prefix_tokens"):
        prefix_key("x", prefix_tokens=0)


def test_same_prefix_same_replica_and_keys_spread_evenly() -> None:
    rng = random.Random(0)
    keys = [prefix_key(f"prompt {rng.random()}") for _ in range(4000)]
    chosen = [choose_replica(k, IDLE) for k in keys]
    assert chosen == [choose_replica(k, IDLE) for k in keys]  # stable
    counts = Counter(chosen)
    assert set(counts) == set(REPLICAS)
    # 1000 expected per replica; binomial sd ~27: 150 is more than 5 sd
    assert all(abs(c - 1000) < 150 for c in counts.values()), counts


def test_adding_a_replica_moves_only_the_keys_it_wins() -> None:
    rng = random.Random(1)
    keys = [prefix_key(f"prompt {rng.random()}") for _ in range(4000)]
    before = [choose_replica(k, IDLE) for k in keys]
    five = {**IDLE, "replica-4": 0}
    after = [choose_replica(k, five) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if a != b]
    assert all(a == "replica-4" for _, a in moved)  # nothing moves between the old ones
    assert 600 < len(moved) < 1000  # about 1/5 of 4000


def test_a_busy_preferred_replica_yields_to_the_next_in_order() -> None:
    key = prefix_key("a long shared system prompt")
    assert key is not None
    order = rendezvous_order(key, REPLICAS)
    loads = {**IDLE, order[0]: 5}
    assert choose_replica(key, loads, max_imbalance=5) == order[0]  # within the slack
    assert choose_replica(key, loads, max_imbalance=4) == order[1]
    loads = {order[0]: 9, order[1]: 9, order[2]: 3, order[3]: 2}
    assert choose_replica(key, loads, max_imbalance=1) == order[2]
    assert choose_replica(key, loads, max_imbalance=0) == order[3]  # the least loaded


def test_no_key_goes_to_the_least_loaded() -> None:
    assert choose_replica(None, {"a": 3, "b": 1, "c": 2}) == "b"
    with pytest.raises(ValueError, match="no replica"):
        choose_replica(None, {})
    with pytest.raises(ValueError, match="max_imbalance"):
        choose_replica(None, {"a": 0}, max_imbalance=-1)
