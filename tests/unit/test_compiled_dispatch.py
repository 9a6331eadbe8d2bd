"""runner/compilation.py's _Dispatch: a compiled step is called through its dynamo cache
entries directly once its guards hold, and through torch.compile's wrapper (which may compile
again) when no entry's guards do. A toy step of the decode step's signature, on this torch,
compiled by dynamo's eager backend: the dispatch is dynamo's cache whatever the backend, and
inductor would build C++ for 12 s on a fresh machine (tests/engine/test_compiled_decode.py runs
the decode step's inductor graphs through it)."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.runner.compilation import _Dispatch, _own_code


def _step(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
    return (input_ids * 2 + positions).sum(dim=-1) + model.offset


class _Model:
    offset = 3


def test_calls_go_straight_to_the_compiled_code_while_guards_hold() -> None:
    step = _Dispatch(_own_code(_step, 9001), None, backend="eager")
    through_dynamo = []
    compiled = step.compiled

    def counted(*args: Any) -> torch.Tensor:
        through_dynamo.append(args[1].dtype)
        return compiled(*args)

    step.compiled = counted  # type: ignore[method-assign]
    model, pos = _Model(), torch.arange(4.0)
    x = torch.ones(2, 4)
    assert step(model, x, pos, None).tolist() == [17.0, 17.0]  # compiles
    assert through_dynamo == [torch.float32] and len(step.entries) == 1
    y = torch.full((2, 4), 2.0)
    assert step(model, y, pos, None).tolist() == [25.0, 25.0]  # the entry's guards hold
    assert through_dynamo == [torch.float32]

    # another dtype fails the entry's guards: through dynamo, which compiles a second entry
    z = torch.ones(2, 4, dtype=torch.float64)
    want = _step(model, z, pos, None)
    assert torch.equal(step(model, z, pos, None), want)
    assert through_dynamo == [torch.float32, torch.float64] and len(step.entries) == 2
    # then both go straight to their own entry's code
    assert torch.equal(step(model, z, pos, None), want)
    assert step(model, y, pos, None).tolist() == [25.0, 25.0]
    assert through_dynamo == [torch.float32, torch.float64]


def test_without_the_cache_entry_api_every_call_goes_through_dynamo(monkeypatch: Any) -> None:
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    step = _Dispatch(_own_code(_step, 9002), None, backend="eager")
    x = torch.ones(2, 4)
    for _ in range(2):
        assert step(_Model(), x, torch.arange(4.0), None).tolist() == [17.0, 17.0]
        assert step.entries == []
