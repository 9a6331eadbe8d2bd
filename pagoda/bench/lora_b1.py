"""`bench latency --enable-lora`: batch-1 decode (B1) with a LoRA adapter against the same
prompts without one, in alternating rounds (bench/machine.py says why); with --peer vllm, vLLM
with the same adapter and vLLM without it in the same rounds.

Engines, every one up at once: `pagoda` (no LoRA flag), `pagoda-lora` (--enable-lora,
--max-loras defaulting to the number of adapters: one, generated or --lora-path, unless
--num-loras says more, and then the prompts take them in turn), and per vLLM precision `vllm-<dtype>` and `vllm-<dtype>-lora`.
Each engine first runs --num-iters-warmup prompts untimed; each round then draws --num-iters
fresh random prompts (no prefix-cache hit) that every engine takes one at a time, in the
round's order.

pagoda's figures are streamed: TTFT and the decode rate after the first token; vLLM's offline
LLM does not stream, so its side is `vllm bench latency`'s: each whole request timed, e2e tok/s
= output tokens / latency. pagoda's e2e tok/s is the same quantity, the one set beside vLLM's.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import tempfile
from typing import Any

from pagoda.bench.b1_runs import IterTiming, start_pagoda, time_prompt
from pagoda.bench.common import BenchRequest, median, random_prompt
from pagoda.bench.lora_adapters import (
    assign_adapters,
    lora_engine_kwargs,
    num_loras,
    prepare_adapters,
)
from pagoda.bench.lora_runs import (
    TARGETS,
    lora_requests,
    ratio_pairs,
    start_vllm_peers,
    summarize_ratios,
    vllm_lora_args,
)
from pagoda.bench.machine import machine_record, pagoda_version, round_order
from pagoda.bench.vllm_peer import PeerLoRA, VLLMPeer, vllm_dtypes, vllm_python

METRICS = ("decode_tok_s", "e2e_tok_s", "ttft_ms")


def pagoda_round(
    llm: Any, prompts: list[list[int]], output_len: int, loras: list[Any], outputs: list[Any]
) -> dict[str, Any]:
    """Each prompt alone, streamed, with its adapter (None: the base model); the medians."""
    timings: list[IterTiming] = []
    for ids, lora in zip(prompts, loras, strict=True):
        timing, tokens = time_prompt(llm, ids, output_len, lora_request=lora)
        timings.append(timing)
        outputs.append(tokens)
    decode = [t.decode_tok_s for t in timings if t.decode_tok_s is not None]
    e2e = [t.e2e_tok_s for t in timings if t.e2e_tok_s is not None]
    return {
        "decode_tok_s": round(median(decode), 2) if decode else None,
        "e2e_tok_s": round(median(e2e), 2) if e2e else None,
        "ttft_ms": round(median([t.ttft_s * 1e3 for t in timings]), 2),
        "iters_decode_tok_s": [round(r, 2) for r in decode],
        "iters_ttft_ms": [round(t.ttft_s * 1e3, 2) for t in timings],
        "num_output_tokens": [t.num_tokens for t in timings],
    }


def vllm_round(
    peer: VLLMPeer,
    prompts: list[list[int]],
    output_len: int,
    lora: PeerLoRA | None,
    outputs: list[Any],
) -> dict[str, Any]:
    """Each prompt alone (greedy), timed whole by the worker; the median e2e rate."""
    requests = [BenchRequest(p, output_len) for p in prompts]
    run = peer.run(requests, 0.0, [], lora, sequential=True)
    outputs.extend(run["token_ids"])
    rates = [n / s for n, s in zip(run["num_output_tokens"], run["latencies_s"], strict=True)]
    return {
        "decode_tok_s": None,
        "e2e_tok_s": round(median(rates), 2),
        "ttft_ms": None,
        "e2e_ms": round(median(run["latencies_s"]) * 1e3, 2),
        "iters_e2e_tok_s": [round(r, 2) for r in rates],
        "num_output_tokens": run["num_output_tokens"],
    }


def compare_lora_b1(
    args: argparse.Namespace, kwargs: dict[str, Any], gguf_type: str | None
) -> dict[str, Any]:
    """The record: machine, versions, the adapters and their shape, each round's figures per
    engine, the medians, and the ratios' medians and ranges (lora_runs.ratio_pairs)."""
    if args.workload != "random" or "speculative_config" in kwargs:
        raise ValueError("--enable-lora runs the random workload without speculation")
    if args.peer not in ("none", "vllm"):
        raise ValueError("--enable-lora runs with --peer none or --peer vllm")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    count = num_loras(args, kwargs, default=1)
    vllm = args.peer == "vllm"
    python = vllm_python(args.vllm_python) if vllm else ""
    machine = machine_record()
    dtypes = vllm_dtypes(args.vllm_dtype, machine["simd_flags"]) if vllm else []
    record: dict[str, Any] = {"machine": machine}
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-b1-") as folder:
        adapters, lora = prepare_adapters(args, kwargs, folder, count, export_base=vllm)
        base_kwargs, lora_kwargs = lora_engine_kwargs(kwargs, count, int(lora["rank"]))
        lora.update(assignment="round-robin", engine_args=lora_kwargs)
        record.update(engine_args=base_kwargs, lora=lora)
        peers: dict[str, VLLMPeer] = {}
        if vllm:
            lora["vllm_engine_args"] = vllm_lora_args(lora_kwargs)
            max_len = args.input_len + args.output_len
            peers = start_vllm_peers(
                python, folder, dtypes, args.seed, max_len, lora["vllm_engine_args"]
            )
        try:
            rows = [(a.name, a.int_id, a.path) for a in adapters]
            both = (base_kwargs, lora_kwargs)
            _run(record, args, both, gguf_type, lora_requests(adapters), rows, peers)
        finally:
            for peer in peers.values():
                peer.close()
    record["peers"] = {name: peer.info for name, peer in peers.items()}
    record["versions"] = {"pagoda": pagoda_version(), **record["peers"]}
    _finish(record, dtypes)
    return record


def _run(
    record: dict[str, Any],
    args: argparse.Namespace,
    kwargs: tuple[dict[str, Any], dict[str, Any]],
    gguf_type: str | None,
    loras: list[Any],
    rows: list[tuple[str, int, str]],
    peers: dict[str, VLLMPeer],
) -> None:
    """Both pagoda engines started, every engine warmed up, then the rounds into record."""
    engines = {
        name: start_pagoda(args.model, k, gguf_type)
        for name, k in zip(("pagoda", "pagoda-lora"), kwargs, strict=True)
    }
    record["pagoda"], record["pagoda_lora"] = engines["pagoda"][1], engines["pagoda-lora"][1]
    names = [*engines, *peers]
    seeds = itertools.count(args.seed)  # a fresh prompt each time: no prefix-cache hit
    outputs: dict[str, list[Any]] = {name: [] for name in names}

    def run_engine(name: str, prompts: list[list[int]], kept: list[Any]) -> dict[str, Any]:
        index = assign_adapters(len(prompts), len(loras), "round-robin", 0)
        if name in engines:
            with_lora = [loras[i] for i in index] if name == "pagoda-lora" else [None] * len(index)
            return pagoda_round(engines[name][0], prompts, args.output_len, with_lora, kept)
        peer_lora = PeerLoRA(rows, index) if name.endswith("-lora") else None
        return vllm_round(peers[name], prompts, args.output_len, peer_lora, kept)

    warm = [random_prompt(args.input_len, next(seeds)) for _ in range(args.num_iters_warmup)]
    if warm:
        for name in names:
            run_engine(name, warm, [])
    record["rounds"] = []
    for r in range(args.rounds):
        prompts = [random_prompt(args.input_len, next(seeds)) for _ in range(args.num_iters)]
        entry: dict[str, Any] = {"order": round_order(r, names)}
        for name in entry["order"]:
            entry[name] = run_engine(name, prompts, outputs[name])
        record["rounds"].append(entry)
    # greedy: an adapter is live when its tokens differ from the base model's, on each side
    record["lora_changes_outputs"] = {
        name: outputs[name] != outputs[name.removesuffix("-lora")]
        for name in names
        if name.endswith("-lora")
    }
    record["outputs_sha256"] = {
        name: hashlib.sha256(repr(out).encode()).hexdigest() for name, out in outputs.items()
    }


def _finish(record: dict[str, Any], dtypes: list[str]) -> None:
    rounds = record["rounds"]
    for name in rounds[0]["order"]:
        key = {"pagoda": "pagoda", "pagoda-lora": "pagoda_lora"}.get(name)
        target = record[key] if key else record["peers"][name]
        for metric in METRICS:
            values = [e[name][metric] for e in rounds if e[name][metric] is not None]
            if values:
                target[f"{metric}_median"] = round(median(values), 2)
    pairs = ratio_pairs(dtypes)
    summarize_ratios(record, pairs[:1], "decode_tok_s", "decode tok/s")
    summarize_ratios(record, pairs[:1], "ttft_ms", "TTFT ms")
    summarize_ratios(record, pairs, "e2e_tok_s", "e2e tok/s")
    key = "pagoda-lora / pagoda decode_tok_s"
    record["target"] = {
        "ratio": key,
        "at_least": TARGETS["b1_decode_tok_s"],
        "met": (record["ratios"][key]["median"] or 0) >= TARGETS["b1_decode_tok_s"],
    }
