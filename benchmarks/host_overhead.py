"""The engine's host ceiling: W1 and B1 with the model's math stubbed out.

The forward returns zeros and the LM head 256 zero logits, so what is timed is the host's work
per step: scheduling, step inputs, sampling metadata, the launches and copies that remain,
output bookkeeping and the offline client. Throughput here is an upper bound on what the engine
can reach on this host whatever the device; where it is near the measured W1 / B1, the run is
host-bound. Run it on the machine whose figures it explains, e.g.

    python benchmarks/host_overhead.py                     # this machine's default device
    python benchmarks/host_overhead.py --device cuda --no-async-scheduling

Prints one JSON line (and writes it to --output-json): output tok/s of each workload (best of
--repeats runs; shared machines are noisy), the median host time of each phase at W1's full
batch, and the load average before and after the run (other jobs on the machine move the
figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig

from pagoda import LLM, SamplingParams

VOCAB = 256  # stub logits: sampling math stays negligible next to the bookkeeping


def stub_model_dir() -> str:
    """A one-layer Llama config folder (weights come from --load-format dummy)."""
    folder = tempfile.mkdtemp(prefix="pagoda-host-")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=4096,
    ).save_pretrained(folder)
    return folder


def make_llm(folder: str, args: argparse.Namespace, max_num_seqs: int) -> LLM:
    llm = LLM(
        folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        device=args.device,
        max_model_len=4096,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=1 << 30,
        async_scheduling=args.async_scheduling,
        enforce_eager=True,  # graphs would be captured around the real forward
    )
    model = runner_of(llm.engine).model
    device = llm.engine.device

    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape[0], 64, device=device)

    def compute_logits(hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], VOCAB, device=device)

    model.forward = forward  # type: ignore[method-assign]
    model.compute_logits = compute_logits  # type: ignore[method-assign]
    return llm


def runner_of(engine: Any) -> Any:
    """The engine's ModelRunner, in this tree and in trees before the executor (where the engine
    held the runner itself), so that before_after.sh times both with this script."""
    executor = getattr(engine, "executor", None)
    return engine.runner if executor is None else executor.runner


def timed(obj: Any, name: str, into: dict[str, list[float]]) -> None:
    f: Callable[..., Any] = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        result = f(*a, **k)
        into.setdefault(name, []).append(time.perf_counter() - t0)
        return result

    setattr(obj, name, wrapper)


def run_w1(llm: LLM, phases: dict[str, list[float]]) -> float:
    """W1's shape (256 requests, in/out U[100, 1024], temperature 0.6, seed 0): output tok/s."""
    rng = random.Random(0)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(i)]} for i, _ in lens]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in lens]
    for values in phases.values():
        values.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(o for _, o in lens) / (time.perf_counter() - t0)


def run_b1(llm: LLM) -> float:
    """B1's shape (one 128-token prompt, 512 greedy tokens, streamed): decode tok/s."""
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    stamps = []
    for out in llm.generate_stream({"prompt_token_ids": list(range(10, 138))}, params):
        if out.outputs[0].token_ids:
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    folder = stub_model_dir()

    w1_llm = make_llm(folder, args, max_num_seqs=256)
    engine = w1_llm.engine
    phases: dict[str, list[float]] = {}
    for obj, name in (
        (engine.scheduler, "schedule"),
        (runner_of(engine), "execute"),
        (runner_of(engine).buffers, "prepare"),
        (engine.scheduler, "update"),
        (engine, "step"),
    ):
        timed(obj, name, phases)
    w1 = []
    for _ in range(args.repeats):
        w1.append(run_w1(w1_llm, phases))
        if w1[-1] == max(w1):
            full = slice(50, 250)  # steps with about 256 running decodes
            best_phases = {k: statistics.median(v[full]) * 1e3 for k, v in phases.items()}
    del w1_llm
    b1_llm = make_llm(folder, args, max_num_seqs=1)
    b1 = [run_b1(b1_llm) for _ in range(args.repeats)]
    record = {
        "bench": "host_overhead",
        "device": str(b1_llm.engine.device),
        "async_scheduling": b1_llm.engine.async_scheduling,
        "w1_host_ceiling_tok_s": round(max(w1)),
        "w1_runs_tok_s": [round(x) for x in w1],
        "w1_full_batch_ms_per_step": {k: round(v, 3) for k, v in best_phases.items()},
        "b1_host_ceiling_tok_s": round(max(b1)),
        "b1_host_us_per_token": round(1e6 / max(b1), 1),
        "b1_runs_tok_s": [round(x) for x in b1],
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }
    line = json.dumps(record)
    print(line, flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
