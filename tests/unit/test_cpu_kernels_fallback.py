"""Where pagoda's CPU kernels cannot be built, pagoda says why once and its layers keep torch's
quantized forms: a missing C++ compiler is a warning (a user's machine may have none), a build
that fails with a compiler there is an error carrying the compiler's output, and
PAGODA_CPU_KERNELS=require (make test, CI) turns either into a failure. Runs on every machine:
the compiler is hidden or the build made to fail here."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

import pagoda.kernels.cpu as cpu_kernels
from pagoda.layers.linear import Linear
from pagoda.layers.quant import Int4Method


def test_no_compiler_means_a_warning_and_torch_forms(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("no build is tried without a compiler")

    monkeypatch.setattr(cpp_extension, "load", never)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a fresh process
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    with caplog.at_level(logging.WARNING, logger="pagoda.kernels.cpu"):
        assert cpu_kernels.kernels() is None
        assert cpu_kernels.kernels() is None  # the failure is remembered, not retried
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no C++ compiler (no-such-compiler-here not found)" in caplog.records[0].message
    assert "torch's quantized ops" in caplog.records[0].message

    layer = Linear(64, 32)
    with torch.no_grad():
        layer.weight.normal_(generator=torch.Generator().manual_seed(0))
    w = layer.weight.detach().clone()
    layer.set_quant_method(Int4Method())
    layer.finalize()
    assert layer.kernel == "int4"  # torch's packed int4 op, not the kernels' tiles
    assert "packed" not in dict(layer.named_buffers())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ref = x @ w.T
    # int4's error, as test_quant.py bounds it for torch's int4 path
    assert (layer(x).float() - ref).norm() / ref.norm() < 0.15


def test_a_failed_build_is_an_error_with_the_compiler_output(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def compile_error(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension: quant_gemm.cpp:12: error: expected ';'")

    monkeypatch.setattr(cpp_extension, "load", compile_error)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    with caplog.at_level(logging.WARNING, logger="pagoda.kernels.cpu"):
        assert cpu_kernels.kernels() is None
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "failed to build" in caplog.records[0].message
    assert "quant_gemm.cpp:12: error: expected ';'" in caplog.records[0].message


@pytest.mark.parametrize("cxx", ["no-such-compiler-here", None])
def test_require_turns_any_failure_into_an_error(
    monkeypatch: pytest.MonkeyPatch, cxx: str | None
) -> None:
    def compile_error(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension: error: expected ';'")

    monkeypatch.setattr(cpp_extension, "load", compile_error)
    if cxx is not None:
        monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "require")
    why = r"no C\+\+ compiler" if cxx else "expected ';'"
    with pytest.raises(cpu_kernels.KernelBuildError, match=why):
        cpu_kernels.kernels()
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    assert cpu_kernels.kernels() is None


@pytest.mark.parametrize(
    ("cxx", "switch", "code", "says"),
    [
        ("no-such-compiler-here", "1", 0, "no C++ compiler"),
        ("no-such-compiler-here", "require", 1, "no C++ compiler"),
        ("false", "1", 1, "failed to build"),  # a compiler that fails every compile
    ],
)
def test_the_setup_build_exits_by_what_failed(
    tmp_path: Path, cxx: str, switch: str, code: int, says: str
) -> None:
    """`python -m pagoda.kernels.cpu` (make setup): 0 where a user simply has no compiler, 1
    where the build failed or the kernels are required (an empty extension cache, so it builds)."""
    env = os.environ | {
        "CXX": cxx,
        "PAGODA_CPU_KERNELS": switch,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.kernels.cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert says in done.stdout + done.stderr
