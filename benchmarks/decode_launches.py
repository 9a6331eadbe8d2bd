"""Device launches of one batch-1 decode step on the triton backend, counted without a GPU.

B1 on a GPU replays the decode step as one CUDA graph, whose replay cost grows with its node
count (each node a kernel): the forward, the LM head and the argmax (the runner's decode_body);
sampling launches whatever else it needs eagerly (nothing for a greedy batch). This script runs
the same Python path on CPU (Triton in its interpreter, random weights from a config-only folder,
bfloat16 as on a GPU, the batch padded to the graph sizes as a replay is) and counts what would
be launched:
- every Triton kernel launch;
- every torch operator that runs a kernel: views, bare allocations (`empty*`) and aliasing
  operators that return their input (`to` a dtype it has) are not counted.
Triton's interpreter runs on torch too; nothing inside a Triton launch is counted.

Not counted: the host-to-device copies of the step's inputs (on CPU the input buffers are the
device's), and what CUDA libraries do inside one operator (a cuBLAS GEMM is one operator here,
usually one kernel there).

    python benchmarks/decode_launches.py [benchmarks/models/SmolLM2-135M-Instruct ...]

Prints one JSON line per model: launches in the decode forward, in the graph (the forward, LM
head and argmax), in one layer, outside the graph (sampling), and one layer's launches by name.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when pagoda.kernels is first imported

import argparse  # noqa: E402
import json  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from torch import Tensor  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.runner.cuda_graphs import capture_sizes  # noqa: E402

MODELS = Path(__file__).parent / "models"
DEFAULT_MODELS = ["SmolLM2-135M-Instruct", "Qwen3-0.6B", "Llama-3.2-1B"]
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}


def _storages(tree: Any) -> set[int]:
    return {
        t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)
    }


def _new_storage(out: Any, inputs: Any) -> bool:
    return bool(_storages(out) - _storages(inputs))


class LaunchCounter(TorchDispatchMode):
    """Counts operators that run a kernel, and Triton launches (see the module docstring), into
    every open window."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[Counter[str]] = []
        self.in_triton = False

    def _counts(self) -> bool:
        return bool(self.windows) and not self.in_triton

    def _add(self, name: str) -> None:
        for window in self.windows:
            window[name] += 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self._counts() and name not in NO_KERNEL:
            # An aliasing schema (view, reshape, to) runs a kernel only when it made new memory.
            if not func.is_view or _new_storage(out, (args, kwargs)):
                self._add(f"aten.{name}")
        return out

    def triton_run(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(fn: InterpretedFunction, *args: Any, **kwargs: Any) -> Any:
            if self._counts():
                self._add(f"triton.{fn.__name__}")
            outer, self.in_triton = self.in_triton, True
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.in_triton = outer

        return counted

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        window: Counter[str] = Counter()
        self.windows.append(window)
        try:
            yield window
        finally:
            self.windows.pop()


def count_model(folder: Path) -> dict[str, Any]:
    llm = LLM(
        str(folder),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        dtype="bfloat16",
        attention_backend="triton",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=1,
        num_gpu_blocks_override=8,
        block_size=16,
        async_scheduling=False,
    )
    runner = llm.engine.executor.runner
    runner.decode_sizes = capture_sizes(1)  # decode steps run the graph's body, eagerly
    model = runner.model
    counter = LaunchCounter()
    last: dict[str, Counter[str]] = {}  # the latest decode step's windows: step, forward, layer
    execute, forward = runner.execute, model.forward
    layer0 = model.model.layers[0]

    def wrap(f: Callable[..., Any], key: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not counter.windows:  # not inside a decode step
                return f(*args, **kwargs)
            with counter.counting() as last[key]:
                return f(*args, **kwargs)

        return counted

    def step(out: Any) -> Any:
        decode = bool(out.scheduled) and all(len(s.token_ids) == 1 for s in out.scheduled)
        if not decode:
            return execute(out)
        with counter.counting() as last["step"]:
            result = execute(out)
            result.get()  # the host copy of the sampled ids
        return result

    runner.execute = step  # type: ignore[method-assign]
    model.forward = wrap(forward, "forward")  # type: ignore[method-assign]
    runner.decode_body = wrap(runner.decode_body, "graph")  # type: ignore[method-assign]
    # The layer runs one of its two forms: fused (a few rows, float linears) or not.
    layer0.forward = wrap(layer0.forward, "layer")  # type: ignore[method-assign]
    layer0.forward_fused = wrap(layer0.forward_fused, "layer")  # type: ignore[method-assign]
    run = InterpretedFunction.run
    InterpretedFunction.run = counter.triton_run(run)  # type: ignore[method-assign]
    try:
        with counter:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            llm.generate({"prompt_token_ids": list(range(10, 30))}, params, use_tqdm=False)
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
    graph_n = sum(last["graph"].values())
    return {
        "bench": "decode_launches",
        "model": folder.name,
        "num_layers": len(model.model.layers),
        "forward_launches": sum(last["forward"].values()),
        "graph_launches": graph_n,
        "layer_launches": sum(last["layer"].values()),
        "outside_graph_launches": sum(last["step"].values()) - graph_n,
        "layer": dict(sorted(last["layer"].items())),
        "graph_after_forward": dict(sorted((last["graph"] - last["forward"]).items())),
        "outside_graph": dict(sorted((last["step"] - last["graph"]).items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="config folders (default: benchmarks/models/*)")
    args = parser.parse_args()
    folders = [Path(m) for m in args.models] or [MODELS / m for m in DEFAULT_MODELS]
    for folder in folders:
        print(json.dumps(count_model(folder)), flush=True)


if __name__ == "__main__":
    main()
