"""freeze_startup_heap (the served engine process, after its warm-up): startup's cyclic
garbage is collected first, never frozen; what lives is frozen, and a full collection then
scans only objects made since."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pagoda.engine.process import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process builds many engines: give the heap back


def test_garbage_is_collected_and_the_live_heap_frozen(unfrozen: None) -> None:
    garbage = weakref.ref(Node())  # unreachable, held by its cycle alone
    kept = Node()
    frozen = freeze_startup_heap()
    assert garbage() is None  # collected before the freeze
    assert frozen == gc.get_freeze_count() > 0
    assert all(kept is not obj for obj in gc.get_objects())  # frozen: out of every generation
    made_later = weakref.ref(Node())
    gc.collect()
    assert made_later() is None  # objects made after the freeze are still collected
