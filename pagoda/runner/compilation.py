"""torch.compile of pure-decode steps on CPU (`-O1` and above; see EngineConfig.level).

A batch-1 decode step of a small model is bound by eager dispatch: some 60 small ops per layer
(norms, rotary, casts around the quantized matmuls, the KV gather and mask), each a few
microseconds of host time. Inductor fuses them into a few C++ loops per layer, attention
included (layers/attention.py: decode_attention_reductions); the quantized matmuls stay
library calls.

Contract:
- Only pure-decode batches come here (one query token per request); prefills and mixed
  steps run eagerly. The step's ForwardContext is passed as an argument, since dynamo cannot
  trace the context variable.
- Two graphs, batch 1 and batch >= 2: inductor specializes on the sizes it compiles with, so
  one graph cannot serve both. `warm_up` compiles each at startup; the batch size (>= 2) and
  the block-table width are dynamic, backed_size_oblivious keeping a width of 1 from
  specializing. Each graph lives in its own function's dynamo cache, so a step checks the
  guards of one entry.
- The graphs keep no guards on the model's modules: checking some 400 parameters and module
  attributes cost 1.1-1.4 ms per step, an eighth of a batch-1 decode step of SmolLM2. That
  holds because each CompiledDecode compiles copies of the step functions with code objects
  of their own (dynamo keeps its graphs per code object), so its graphs only ever see its own
  model, and that model's modules are fixed once warmed up (weights may change in place: they
  are graph inputs). Guards on the step's inputs and globals stay: 0.17-0.28 ms a step for
  either graph of SmolLM2 on a 2-vCPU Zen 5, where the batch >= 2 graph's module guards had
  cost 1.0-1.3 ms until each graph got its own options dict (benchmarks/decode_guards.py).
- A step calls a graph's compiled code itself, after checking that entry's guards
  (`_Dispatch`), not through dynamo's frame evaluation: in one engine, alternating, that saved
  0.12 ms of a 1-row step and 0.2-0.3 ms of a 2- to 7-row one (steps of 6-13 ms). vLLM
  dispatches to its compiled code the same way, without checking guards. When no entry's
  guards hold, the call goes through dynamo as before (which may compile again).
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import ForwardContext, forward_context
from pagoda.models.interface import Backbone, CausalLM
from pagoda.runner.step_inputs import InputBuffers

logger = logging.getLogger(__name__)


# (batch, block-table width) of the warm-up decode steps: one per compiled graph.
WARMUP_SHAPES = ((1, 2), (2, 2))


# Two functions, so that each graph has a dynamo cache (keyed by code object) of its own.
def _decode_one(
    model: Backbone, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    return model(input_ids, positions, ctx)


def _decode_many(
    model: Backbone, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    return model(input_ids, positions, ctx)


_instances = itertools.count()


def _own_code(fn: Callable[..., torch.Tensor], instance: int) -> Callable[..., torch.Tensor]:
    """fn with a code object of its own, hence a dynamo cache of its own."""
    name = f"{fn.__name__}_{instance}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name)


StepFn = Callable[[Backbone, torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


class _Dispatch:
    """One compiled step function, called through its dynamo cache entries directly: the first
    entry whose guards hold on the call's arguments runs its compiled code (the bytecode dynamo
    would run after the same check); with none, the call goes through torch.compile's wrapper
    and the entries are read again. Without the cache-entry API (another torch), always the
    wrapper."""

    def __init__(
        self, fn: StepFn, options: dict[str, Any] | None, backend: str = "inductor"
    ) -> None:
        self.fn = fn
        # A copy: torch.compile pops guard_filter_fn from the dict it is given, so a second
        # call with the same dict would compile with every module guard (1.2 ms a step).
        options = None if options is None else dict(options)
        self.compiled = torch.compile(fn, fullgraph=True, backend=backend, options=options)
        self.entries: list[tuple[Callable[[dict[str, Any]], bool], StepFn]] = []

    def __call__(
        self, model: Backbone, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if self.entries:
            frame = {"model": model, "input_ids": input_ids, "positions": positions, "ctx": ctx}
            for check, code in self.entries:
                if check(frame):
                    return code(model, input_ids, positions, ctx)
        hidden = self.compiled(model, input_ids, positions, ctx)
        self.entries = _cache_entries(self.fn)
        return hidden


def _cache_entries(fn: StepFn) -> list[tuple[Callable[[dict[str, Any]], bool], StepFn]]:
    """(guard check, compiled code as a function) of each of fn's dynamo cache entries, newest
    first as dynamo tries them; [] where this torch does not expose them."""
    get_entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if get_entries is None:
        return []
    entries: list[tuple[Callable[[dict[str, Any]], bool], StepFn]] = []
    for entry in get_entries(fn.__code__):
        guards, code = getattr(entry, "guard_manager", None), getattr(entry, "code", None)
        if guards is None or code is None or not hasattr(guards, "check"):
            return []
        entries.append((guards.check, types.FunctionType(code, fn.__globals__, fn.__name__)))
    return entries


class CompiledDecode:
    def __init__(self, model: CausalLM, cpp_wrapper: bool = False) -> None:
        """cpp_wrapper: inductor's C++ wrapper runs each graph (EngineConfig.decode_cpp_wrapper);
        the kernels it calls, hence the bits, are the Python wrapper's."""
        self.model = model.model
        options: dict[str, Any] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "cpp_wrapper": cpp_wrapper,
        }
        instance = next(_instances)
        self._one = _Dispatch(_own_code(_decode_one, instance), options)
        self._many = _Dispatch(_own_code(_decode_many, instance), options)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states (num_decodes, hidden_size) of a pure-decode step."""
        return self._graph(input_ids)(self.model, input_ids, positions, ctx)

    def _graph(self, input_ids: torch.Tensor) -> _Dispatch:
        return self._one if input_ids.shape[0] == 1 else self._many

    def warm_up(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> None:
        """Compile the graph of this batch's kind (1 or >= 2 requests), with its dynamic dims."""
        meta = ctx.attn_metadata
        batch = input_ids.shape[0]
        if batch > 1:
            for t in (input_ids, positions, meta.slot_mapping, meta.decode_token_idx):
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(meta.decode_seq_lens, 0)
        torch._dynamo.mark_dynamic(meta.decode_block_tables, [0, 1] if batch > 1 else 1)
        start = time.perf_counter()
        with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            self._graph(input_ids)(self.model, input_ids, positions, ctx)
        logger.info(
            "compiled the decode step for batch %s in %.1f s",
            "1" if batch == 1 else ">= 2",
            time.perf_counter() - start,
        )

    def compile_now(
        self, caches: list[KVCache], buffers: InputBuffers, block_size: int, limits: StepLimits
    ) -> None:
        """Compile both graphs (a decode batch of one request and one of two, each request two
        blocks long) over `caches` now, rather than in the first requests' steps. This writes
        keys and values into blocks 0-3, which no request holds yet and every request
        overwrites before reading."""
        num_blocks = caches[0].k.shape[0]
        for batch, width in WARMUP_SHAPES:
            batch = min(batch, limits.max_num_seqs)
            width = min(width, limits.max_blocks_per_seq)
            seq_len = min(block_size * (width - 1) + 1, limits.max_model_len)
            tables = [[(width * i + j) % num_blocks for j in range(width)] for i in range(batch)]
            ids, pos, meta = buffers.prepare([[0]] * batch, [seq_len] * batch, tables, block_size)
            with forward_context(meta, caches) as ctx:
                try:
                    self.warm_up(ids, pos, ctx)
                except Exception as e:  # inductor needs a C++ compiler and Python headers
                    raise RuntimeError(
                        f"compiling the decode step failed ({type(e).__name__}: {e}); "
                        "run with -O0 (optimization_level=0) to skip torch.compile"
                    ) from e


class StepLimits(NamedTuple):
    """The runner's bounds on a decode step the warm-up may make."""

    max_num_seqs: int
    max_blocks_per_seq: int
    max_model_len: int
