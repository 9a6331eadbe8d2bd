"""Where pagoda's CPU kernels cannot be built (no C++ compiler, no Python headers), pagoda says so
once with a warning and its layers keep torch's quantized forms; nothing fails. Runs on every
machine: the build is made to fail here."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils import cpp_extension

import pagoda.kernels.cpu as cpu_kernels
from pagoda.layers.linear import Linear
from pagoda.layers.quant import Int4Method


def test_no_compiler_means_a_warning_and_torch_forms(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as in a fresh process
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    with caplog.at_level(logging.WARNING, logger="pagoda.kernels.cpu"):
        assert cpu_kernels.kernels() is None
        assert cpu_kernels.kernels() is None  # the failure is remembered, not retried
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "c++: command not found" in warnings[0].message
    assert "torch's quantized ops" in warnings[0].message

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
