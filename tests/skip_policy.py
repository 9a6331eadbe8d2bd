"""No quiet skips: a pytest plugin (registered by tests/conftest.py) that lists every skip of a
run by reason at its end and, under CI (`CI=true`) or `make test` (`PAGODA_TEST_STRICT=1`),
fails the run when any reason is not on ALLOWED. A missing part (the embedded model, the CPU
kernels, triton, ptxas, chromium) would otherwise turn whole files into skips and leave the run
green; the only part a CPU machine may lack is a GPU.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

# Skip reasons a strict run accepts: what needs a CUDA device (tests/gpu/ and the like).
ALLOWED = ("needs a CUDA device",)

_TRUE = ("1", "true", "yes")


def strict() -> bool:
    return (
        os.environ.get("CI", "").lower() in _TRUE
        or os.environ.get("PAGODA_TEST_STRICT", "").lower() in _TRUE
    )


def disallowed(reasons: Iterable[str], allowed: Iterable[str] = ALLOWED) -> list[str]:
    """The reasons (distinct, sorted) that mention none of the allowed ones."""
    allowed = tuple(allowed)
    return sorted({r for r in reasons if not any(a in r for a in allowed)})


def skip_reason(report: Any) -> str:
    """A skipped report's reason without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkipLedger:
    """Collects the skips the controller sees (its own, or every xdist worker's)."""

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()

    def _record(self, report: Any) -> None:
        if report.skipped:
            self.reasons[skip_reason(report)] += 1

    def pytest_runtest_logreport(self, report: Any) -> None:
        self._record(report)

    def pytest_collectreport(self, report: Any) -> None:
        self._record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if strict() and disallowed(self.reasons) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.reasons:
            return
        terminalreporter.section("skips by reason")
        for reason, count in self.reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")
        bad = disallowed(self.reasons)
        if strict() and bad:
            terminalreporter.write_line(
                "FAILED: under CI a test may skip only for a missing GPU; these reasons are not "
                f"allowed ({', '.join(ALLOWED)} is):",
                red=True,
            )
            for reason in bad:
                terminalreporter.write_line(f"  {reason}", red=True)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(SkipLedger(), "pagoda-skip-ledger")
