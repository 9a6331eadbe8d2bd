"""Which compiled variants of each Triton kernel the launches in a block of code need.

Triton's JIT compiles a kernel once per specialization key: argument types, constexpr values,
an int argument's class (1, divisible by 16, other) unless it is in do_not_specialize, a
pointer's 16-byte alignment, and the launch options (num_warps, ...). In the interpreter nothing
is compiled, so `KernelVariants` computes that key for every launch with Triton's own binder
(`create_function_from_signature`, the code JITFunction.run uses) and records it per kernel: a
launch whose key was not seen before is a compilation on the GPU.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


def _names(kernel: Any, option: str) -> list[Any]:
    value = getattr(kernel, option, None)
    if value is None:  # InterpretedFunction keeps the decorator's arguments in kwargs
        value = getattr(kernel, "kwargs", {}).get(option)
    return list(value or [])


def _binder(kernel: Any) -> Callable[..., Any]:
    from triton.backends import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    signature = inspect.signature(kernel.fn)
    dns, dns_align = (
        _names(kernel, "do_not_specialize"),
        _names(kernel, "do_not_specialize_on_alignment"),
    )
    params = [
        KernelParam(i, p, i in dns or p.name in dns, i in dns_align or p.name in dns_align)
        for i, p in enumerate(signature.parameters.values())
    ]
    return create_function_from_signature(signature, params, BaseBackend)


class KernelVariants:
    """kernel name -> the set of specialization keys its launches had."""

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = defaultdict(set)
        self._binders: dict[int, Callable[..., Any]] = {}

    def record(self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        binder = self._binders.get(id(kernel))
        if binder is None:
            binder = self._binders[id(kernel)] = _binder(kernel)
        _, specialization, options = binder(*args, **kwargs)
        key = repr(specialization) + repr(sorted(options.items()))
        self.keys[kernel.fn.__name__].add(key)

    def snapshot(self) -> dict[str, set[str]]:
        return {name: set(keys) for name, keys in self.keys.items()}

    def new_since(self, before: dict[str, set[str]]) -> dict[str, list[str]]:
        """The keys recorded since `before` (a snapshot), per kernel."""
        new = {name: sorted(keys - before.get(name, set())) for name, keys in self.keys.items()}
        return {name: keys for name, keys in new.items() if keys}


@contextmanager
def kernel_variants(monkeypatch: pytest.MonkeyPatch) -> Iterator[KernelVariants]:
    """Record every Triton launch (interpreted or compiled) while the block runs."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    variants = KernelVariants()
    for cls in (InterpretedFunction, JITFunction):
        run = cls.run

        def recording(self: Any, *args: Any, _run: Any = run, **kwargs: Any) -> Any:
            launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            variants.record(self, args, launch)
            return _run(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", recording)
    yield variants
