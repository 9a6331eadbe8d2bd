"""Triton's interpreter computing as a GPU does, for the kernels' CPU tests.

Triton 3.8's interpreter multiplies the raw bits of bf16 operands in `tl.dot`
(triton-lang/triton#11584) and truncates float32 -> bf16 / fp8e4nv casts, where a GPU rounds to
nearest even, as torch does. `interpreter_as_gpu` (a module-scoped fixture: use it with
`pytestmark = pytest.mark.usefixtures("interpreter_as_gpu")` after importing it) patches both
for the module's tests, and does nothing when the kernels run compiled.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def check_interpreted() -> None:
    """Fail clearly if triton was imported before TRITON_INTERPRET=1 was set."""
    if not INTERPRET:
        return
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.max, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so tl.max / tl.sum are not "
            "interpreted: set it before anything imports triton (tests/conftest.py)"
        )


@pytest.fixture(scope="module")
def interpreter_as_gpu() -> Iterator[None]:
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original_dot = interpreter.InterpreterBuilder.create_dot
    original_convert = interpreter._convert_float
    rounded = {tl.bfloat16: (torch.bfloat16, torch.int16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8)}  # fmt: skip

    def widen(h: Any) -> Any:
        if h.dtype != tl.bfloat16:
            return h
        data = (h.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def dot(self: Any, a: Any, b: Any, *args: Any) -> Any:
        return original_dot(self, widen(a), widen(b), *args)

    def convert(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        rtne = rounding_mode is None or rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE
        if src != tl.float32 or dst not in rounded or not rtne:
            return original_convert(data, src, dst, rounding_mode)
        torch_dtype, bits = rounded[dst]
        x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return x.to(torch_dtype).view(bits).numpy()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
        mp.setattr(interpreter, "_convert_float", convert)
        yield
