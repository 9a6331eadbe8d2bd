"""A step never waits for the device: ModelRunner.execute uploads host data only through
runner/device.py (pinned staging, non_blocking) or the persistent buffers of
runner/step_inputs.py, and reads nothing back (the one sync is PendingOutput.get, after it).

On CPU host and device memory are one, so the test checks the code path rather than timings:
while execute() runs, every call that pagoda's code makes to torch is watched for

- a tensor built from host data (torch.tensor, as_tensor, asarray, from_numpy) or moved to a
  device (.to(device), .cuda()) outside runner/device.py: on CUDA, a synchronous copy from
  pageable memory;
- a tensor indexed by a Python list or a numpy array (torch uploads the index, synchronously);
- a value read back (.item(), .tolist(), .cpu(), bool(), int(), float() of a tensor): a sync.

The steps run prefills, chunked prompts beside decodes, forks (n > 1), penalties, logit bias,
min_tokens, top-k / top-p / min-p, seeds, logprobs and prompt logprobs, under async
scheduling (placeholder inputs read from the previous step's samples).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams

PAGODA = Path(__file__).resolve().parents[2] / "pagoda"
UPLOAD_HOME = "runner/device.py:"
FROM_HOST = ("tensor", "as_tensor", "asarray", "from_numpy")
READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
INDEXED = ("__getitem__", "__setitem__", "index_put", "index_put_")


def _caller() -> str | None:
    """Where in pagoda the call into torch was made (two frames up: the wrapper's caller)."""
    frame = sys._getframe(2)
    path = Path(frame.f_code.co_filename).resolve()
    if not path.is_relative_to(PAGODA):
        return None
    return f"{path.relative_to(PAGODA)}:{frame.f_lineno}"


def _host_index(index: Any) -> bool:
    if isinstance(index, tuple):
        return any(_host_index(i) for i in index)
    return isinstance(index, (list, np.ndarray))


def _moves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether Tensor.to's arguments name a device."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


class StepAudit:
    def __init__(self) -> None:
        self.active = False
        self.found: list[str] = []

    def note(self, what: str, where: str | None) -> None:
        if self.active and where is not None:
            self.found.append(f"{what} at {where}")

    def wrap_factory(self, name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            where = _caller()
            if where is not None and not where.startswith(UPLOAD_HOME):
                self.note(f"torch.{name}", where)
            return original(*args, **kwargs)

        return wrapper

    def wrap_method(self, name: str, original: Any) -> Any:
        def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = _caller()
            if name in READS:
                self.note(f"Tensor.{name}", where)
            elif name in INDEXED and args and _host_index(args[0]):
                self.note(f"Tensor.{name} with a host index", where)
            elif name == "cuda" or (name == "to" and _moves(args, kwargs)):
                if where is not None and not where.startswith(UPLOAD_HOME):
                    self.note(f"Tensor.{name}(device)", where)
            return original(t, *args, **kwargs)

        return wrapper


@contextmanager
def audited_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[StepAudit]:
    audit = StepAudit()
    for name in FROM_HOST:
        monkeypatch.setattr(torch, name, audit.wrap_factory(name, getattr(torch, name)))
    for name in (*READS, *INDEXED, "to", "cuda"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, audit.wrap_method(name, original))
    runner = llm.engine.executor.runner
    execute = runner.execute

    def audited(out: Any) -> Any:
        audit.active = True
        try:
            return execute(out)
        finally:
            audit.active = False

    monkeypatch.setattr(runner, "execute", audited)
    yield audit


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=1, max_tokens=8),
        SamplingParams(
            temperature=0.0,
            logit_bias={500: 10.0},
            frequency_penalty=2.0,
            presence_penalty=2.0,
            repetition_penalty=5.0,
            max_tokens=8,
        ),
        SamplingParams(temperature=0.7, min_tokens=4, presence_penalty=1.5, max_tokens=8),
        SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, max_tokens=6),
        SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=6, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]


def test_steps_upload_through_pinned_staging_only(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        tiny_model_dir("llama"),
        skip_tokenizer_init=True,
        async_scheduling=True,
        num_gpu_blocks_override=256,
        max_num_batched_tokens=16,  # prompts in chunks beside decodes
    )
    params = _params()
    prompts = [[(11 * i + 3 * j) % 900 + 5 for j in range(4 + 9 * i)] for i in range(len(params))]
    with audited_steps(llm, monkeypatch) as audit:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    assert sorted(set(audit.found)) == []
