"""WorkerGroup._failure names a rank that died without a word even when a peer's report of the
lost connection comes first and the death takes longer than DEATH_GRACE_S to show (a killed
rank's teardown on a loaded machine: seen as a flaky "rank 0 failed: ... Connection reset by
peer" in the killed-rank tests)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from pagoda.distributed.workers import DEATH_GRACE_S, PEER_LOST_GRACE_S, WorkerGroup


def _live() -> None:
    time.sleep(60)


def _die_later(delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def _group(procs: list[mp.process.BaseProcess]) -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)
    group.procs = procs
    group.conns = [mp.Pipe()[0] for _ in procs]
    group._last_words = {}
    group.tp_size, group.cp_size = len(procs), 1
    return group


def test_a_lost_peer_report_waits_for_the_silent_death() -> None:
    ctx = mp.get_context("fork")
    delay = DEATH_GRACE_S + 1.5
    assert delay < PEER_LOST_GRACE_S
    procs = [ctx.Process(target=_live), ctx.Process(target=_die_later, args=(delay,))]
    for proc in procs:
        proc.start()
    try:
        group = _group(procs)
        group._last_words[0] = (
            "RuntimeError",
            "[pair.cc:537] Read error: Connection reset by peer",
        )
        error = group._failure(reporter=0)
        assert "tensor-parallel rank 1" in str(error) and "died with exit code -9" in str(error)
        assert "rank 0 failed" in str(error.__cause__)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def test_another_report_is_raised_after_the_usual_grace() -> None:
    """A rank's own error (not a lost peer) with every other rank alive: that error, after
    DEATH_GRACE_S, not PEER_LOST_GRACE_S."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_live), ctx.Process(target=_live)]
    for proc in procs:
        proc.start()
    try:
        group = _group(procs)
        group._last_words[0] = ("RuntimeError", "out of memory")
        start = time.monotonic()
        error = group._failure(reporter=0)
        assert str(error) == "tensor-parallel rank 0 failed: RuntimeError: out of memory"
        assert time.monotonic() - start < PEER_LOST_GRACE_S
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
