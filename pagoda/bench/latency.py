"""Batch-1 latency (B1): one random-token prompt, greedy decode with ignore_eos; TTFT and
tok/s two ways, median over iterations, optionally against HF transformers in the same run.

decode_tok_s is the decode rate after the first token, (n - 1) / (last - first token);
e2e_tok_s is n / end-to-end time, submission to last token, prefill included: how `vllm bench
latency` figures are turned into tok/s (output_len / avg latency), so it is the one to set
beside vLLM's B1 anchor.

--workload copy asks the model to repeat a passage (bench/copy_workload.py), the case prompt
lookup is made for; --workload code and chat are the draft-model workloads
(bench/spec_workloads.py). With --speculative-config, pagoda also runs without it in the same run (its
own baseline: the ratio and whether the greedy outputs are identical; both engines are up at
once and take each prompt in turn, bench/b1_runs.py), --peer hf decodes with
HF's prompt lookup (prompt_lookup_num_tokens = num_speculative_tokens,
max_matching_ngram_size = prompt_lookup_max) and --peer llama.cpp with its
LlamaPromptLookupDecoding (num_pred_tokens, max_ngram_size: the same two). With --enable-lora,
pagoda with a LoRA adapter against pagoda without, in alternating rounds (bench/lora_b1.py)."""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from typing import Any

from pagoda.bench.b1_rounds import compare_with_llama_bench
from pagoda.bench.b1_runs import IterTiming, run_pagoda, run_pagoda_pair
from pagoda.bench.common import (
    add_output_json_arg,
    emit,
    gguf_path,
    gguf_weight_type,
    hf_pad_token_id,
    hf_precision,
    left_pad,
    like_with_like_kwargs,
    llama_cpp_precision,
    load_hf_peer,
    log,
    median,
    parallel_stats,
    peer_comparison,
    prompt_lookup_args,
    random_prompt,
    ratio,
    spec_stats,
    token_id_engine_kwargs,
)
from pagoda.bench.lora_adapters import add_lora_arguments
from pagoda.bench.lora_b1 import compare_lora_b1
from pagoda.bench.roofline import roofline, roofline_line
from pagoda.bench.vllm_peer import add_vllm_arguments

NAME = "latency"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --seed (an engine flag) also seeds the prompts: iteration i uses random_prompt(seed + i),
    # a fresh prompt each time so that the prefix cache cannot shorten prefill.
    g = parser.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--num-iters", type=int, default=3)
    g.add_argument("--num-iters-warmup", type=int, default=1)
    g.add_argument(
        "--workload",
        choices=["random", "copy", "code", "chat"],
        default="random",
        help="random: --input-len random token ids; copy: chat prompts asking to repeat a "
        "passage; code: function signatures with docstrings to complete; chat: questions in "
        "the chat template (bench/spec_workloads.py). All but random need the model's "
        "tokenizer and ignore --input-len",
    )
    p = parser.add_argument_group("peer")
    p.add_argument(
        "--peer",
        choices=["none", "hf", "llama.cpp", "llama-bench", "vllm"],
        default="none",
        help="hf: transformers, float32 dequantized from the same checkpoint (pagoda then runs "
        "--quantization none unless --quantization is given); llama.cpp: llama-cpp-python on the "
        "same GGUF file, 2 threads; llama-bench: native llama.cpp's llama-bench on the same GGUF "
        "file, 2 threads, in alternating rounds (--rounds); vllm (with --enable-lora): vLLM on "
        "that float32 checkpoint, with and without the adapter (bench/lora_b1.py)",
    )
    add_vllm_arguments(p)
    p.add_argument(
        "--llama-cpp-bin",
        default=None,
        help="native llama.cpp's bin/ folder (benchmarks/build_llama_cpp.sh); default: "
        "$PAGODA_LLAMA_CPP_BIN",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--peer llama-bench or --enable-lora: rounds, the engines' order alternating; the "
        "median ratio and its range are reported",
    )
    g.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="also profile this many batch-1 decode steps (torch profiler): step time, GPU "
        "busy fraction, host time per step",
    )
    add_lora_arguments(parser)
    add_output_json_arg(parser)


def main(args: argparse.Namespace) -> int:
    if args.input_len < 1 or args.output_len < 2:
        raise ValueError("--input-len must be >= 1 and --output-len >= 2")
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--num-iters must be >= 1 and --num-iters-warmup >= 0")
    total = args.num_iters_warmup + args.num_iters
    kwargs = like_with_like_kwargs(args.peer, token_id_engine_kwargs(args))
    prompts = workload_prompts(args.workload, args.model, args.input_len, args.seed, total)
    spec = kwargs.get("speculative_config")
    record: dict[str, Any] = {
        "bench": NAME,
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "workload": _workload_record(args, prompts),
        "engine_args": kwargs,
    }
    gguf_type = gguf_weight_type(args.model)
    if kwargs.get("enable_lora"):  # with an adapter against without (and vLLM's LoRA)
        record.update(compare_lora_b1(args, kwargs, gguf_type))
        emit(record, args.output_json)
        return 0
    if args.peer == "vllm":
        raise ValueError("bench latency --peer vllm runs with --enable-lora (bench/lora_b1.py)")
    if args.peer == "llama-bench":
        record.update(compare_with_llama_bench(args, kwargs, gguf_type))
        emit(record, args.output_json)
        return 0
    weights, llm = _run_pagoda_into(record, args, kwargs, prompts, gguf_type)
    decode_ms = record["pagoda"].get("decode_ms_per_token")
    if spec is None and "parallel" not in record and decode_ms:
        path = gguf_path(args.model)
        record["roofline"] = roofline(llm, args.input_len, args.output_len, decode_ms, path)
        log(roofline_line(record["roofline"]))
    if args.profile_steps > 0:
        record["decode_step_profile"] = profile_decode_steps(
            llm, random_prompt(args.input_len, args.seed + total), args.profile_steps
        )
    del llm
    record["peer"], same = _run_peer(args, prompts, spec, gguf_type, weights)
    _compare_with_peer(record, weights, same)
    log(rates_line(record["pagoda"], args.output_len))
    emit(record, args.output_json)
    return 0


def _workload_record(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    return {
        "kind": args.workload,
        "input_lens": sorted({len(p) for p in prompts}),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "seed": args.seed,
        "greedy": True,
        "ignore_eos": True,
    }


def _run_pagoda_into(
    record: dict[str, Any],
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    prompts: list[list[int]],
    gguf_type: str | None,
) -> tuple[dict[str, Any], Any]:
    """Runs pagoda (with a speculative config, pagoda without it too) into `record`; returns its
    weights' description and the LLM, still up."""
    spec = kwargs.get("speculative_config")
    outputs: list[list[int]] = []
    warm = args.num_iters_warmup
    if spec is None:
        timings, weights, llm = run_pagoda(
            args.model, kwargs, prompts, args.output_len, gguf_type, outputs
        )
    else:  # both engines at once, each prompt on one then the other: drifts hit both alike
        plain = {k: v for k, v in kwargs.items() if k != "speculative_config"}
        baseline: list[list[int]] = []
        timings, plain_timings, weights, llm = run_pagoda_pair(
            args.model, (kwargs, plain), prompts, args.output_len, gguf_type, (outputs, baseline)
        )
    record["pagoda"] = {**weights, **summarize(timings[warm:])}
    # what another run's greedy outputs can be compared with
    record["pagoda"]["outputs_sha256"] = hashlib.sha256(repr(outputs).encode()).hexdigest()
    sizes = ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size")
    if any(kwargs.get(size, 1) > 1 for size in sizes):
        record["parallel"] = parallel_stats(llm.engine)
    if spec is not None:
        record["spec_decode"] = spec_stats(llm.engine.stats())
        record["pagoda_no_spec"] = summarize(plain_timings[warm:])
        record["spec_output_identical"] = outputs == baseline
        for key in ("decode_tok_s", "e2e_tok_s"):
            record[f"spec_ratio_{key}"] = ratio(
                record["pagoda"][key], record["pagoda_no_spec"][key]
            )
        log(
            f"speculative decoding: decode {record['spec_ratio_decode_tok_s']}x, e2e "
            f"{record['spec_ratio_e2e_tok_s']}x pagoda without it; greedy outputs identical: "
            f"{record['spec_output_identical']}; {record['spec_decode']}"
        )
    return weights, llm


def _run_peer(
    args: argparse.Namespace,
    prompts: list[list[int]],
    spec: Any,
    gguf_type: str | None,
    weights: dict[str, Any],
) -> tuple[dict[str, Any] | None, bool]:
    """The peer's summary (None with --peer none), and whether it runs the same weights as
    pagoda."""
    if args.peer == "hf":
        lookup = prompt_lookup_args(spec)
        timings = run_hf(args.model, prompts, args.output_len, lookup)
        peer = {
            "name": "hf-transformers" + (f", prompt lookup {lookup}" if lookup else ""),
            "precision": hf_precision(gguf_type),
            **summarize(timings[args.num_iters_warmup :]),
        }
        return peer, weights["quantization"] == "none" and weights["dtype"] == "float32"
    if args.peer == "llama.cpp":
        lookup = prompt_lookup_args(spec)
        timings = run_llama_cpp(args.model, prompts, args.output_len, lookup)
        peer = {
            "name": "llama-cpp-python, 2 threads"
            + (f", LlamaPromptLookupDecoding {lookup}" if lookup else ""),
            "precision": llama_cpp_precision(gguf_type),
            **summarize(timings[args.num_iters_warmup :]),
        }
        return peer, weights["quantization"] == "gguf"
    return None, False


def _compare_with_peer(record: dict[str, Any], weights: dict[str, Any], same: bool) -> None:
    peer = record["peer"] or {}
    # Every ratio is pagoda / peer: above 1 is better for tok/s, below 1 is better for ms.
    for key in ("ttft_ms", "decode_tok_s", "e2e_tok_s", "e2e_ms"):
        record[f"ratio_{key}"] = ratio(record["pagoda"][key], peer.get(key))
    if peer:
        record.update(
            peer_comparison(
                weights["precision"],
                peer["name"],
                peer["precision"],
                same,
                "decode tok/s",
                record["ratio_decode_tok_s"],
            )
        )
        log(record["ratio_line"])


def summarize(timings: list[IterTiming]) -> dict[str, Any]:
    """Medians over iterations, plus the per-iteration values. decode_ms_per_token is the
    batch-1 decode step time as the client sees it (1000 / decode_tok_s)."""
    rates = [t.decode_tok_s for t in timings]
    e2e_rates = [t.e2e_tok_s for t in timings]
    rate, e2e_rate = _median_known(rates), _median_known(e2e_rates)
    return {
        "ttft_ms": round(median([t.ttft_s * 1e3 for t in timings]), 2),
        "decode_tok_s": None if rate is None else round(rate, 2),
        "decode_ms_per_token": None if rate is None else round(1e3 / rate, 2),
        "e2e_tok_s": None if e2e_rate is None else round(e2e_rate, 2),
        "e2e_ms": round(median([t.last_token_s * 1e3 for t in timings]), 2),
        "num_output_tokens": [t.num_tokens for t in timings],
        "num_cached_tokens": [t.num_cached_tokens for t in timings],
        "iters_ttft_ms": [round(t.ttft_s * 1e3, 2) for t in timings],
        "iters_decode_tok_s": [None if r is None else round(r, 2) for r in rates],
        "iters_e2e_tok_s": [None if r is None else round(r, 2) for r in e2e_rates],
    }


def _median_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def rates_line(summary: dict[str, Any], output_len: int) -> str:
    """B1 both ways in words: the decode rate after the first token, and output_len /
    end-to-end time (vLLM's way)."""

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    return (
        f"B1: decode {shown(summary['decode_tok_s'])} tok/s after the first token; "
        f"{output_len} / end-to-end {shown(summary['e2e_tok_s'])} tok/s (vLLM's way: output "
        f"tokens over submission to last token, prefill included); TTFT "
        f"{summary['ttft_ms']:,.1f} ms, end-to-end {summary['e2e_ms']:,.1f} ms"
    )


def workload_prompts(
    kind: str, model: str | None, input_len: int, seed: int, count: int
) -> list[list[int]]:
    """random: `count` random prompts of input_len tokens (seed + i); copy: copy_workload's;
    code, chat: spec_workloads'."""
    if kind == "random":
        return [random_prompt(input_len, seed + i) for i in range(count)]
    from pagoda.bench import spec_workloads
    from pagoda.bench.copy_workload import copy_prompts
    from pagoda.loading.model_files import resolve_model
    from pagoda.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(*resolve_model(model))
    if kind == "copy":
        return copy_prompts(tokenizer, count)
    return spec_workloads.workload_prompts(tokenizer, kind, count)


def profile_decode_steps(llm: Any, prompt: list[int], num_steps: int) -> dict[str, Any]:
    """One request decoding alone, num_steps engine steps under torch.profiler after its
    prefill and a few warm-up steps. step_ms: wall time of an engine step (schedule, execute,
    update); GPU busy: the union of device kernel intervals inside the steps over their length
    (the rest of a step is host time the GPU waits on); top_ops: the host ops by self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduling.messages import EngineRequest

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True)
    engine.add_request(EngineRequest("profile", prompt, params))
    for _ in range(4):  # prefill, then warm-up decodes
        engine.step()
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    wall: list[float] = []
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            with record_function("pagoda_step"):
                engine.step()
            wall.append(time.perf_counter() - t0)
    engine.abort_request("profile")
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == "pagoda_step"]
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    record: dict[str, Any] = {
        "num_steps": num_steps,
        "step_ms": round(median(wall) * 1e3, 3),
        # torch ops called from Python (not from inside another op) per step: the dispatches.
        "top_level_ops_per_step": round(_top_level_ops(events) / num_steps, 1),
        "top_ops": [
            {
                "name": a.key,
                "self_cpu_ms_per_step": round(a.self_cpu_time_total / 1e3 / num_steps, 3),
                "calls_per_step": round(a.count / num_steps, 1),
            }
            for a in top
        ],
    }
    if cuda:
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        busy = _covered(kernels, steps)
        span = sum(end - start for start, end in steps)
        record["gpu_busy_fraction"] = round(busy / span, 4) if span else None
        record["gpu_busy_ms_per_step"] = round(busy / 1e3 / num_steps, 3)
        record["host_ms_per_step"] = round((span - busy) / 1e3 / num_steps, 3)
    return record


def _top_level_ops(events: Any) -> int:
    """aten ops with no aten op above them in the call tree."""
    count = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def _covered(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` inside the (disjoint) windows."""
    total = 0.0
    for w_start, w_end in windows:
        clipped = sorted(
            (max(s, w_start), min(e, w_end)) for s, e in intervals if e > w_start and s < w_end
        )
        end = w_start
        for s, e in clipped:
            if e > end:
                total += e - max(s, end)
                end = e
    return total


def run_llama_cpp(
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    prompt_lookup: dict[str, int] | None = None,
) -> list[IterTiming]:
    """llama-cpp-python on the same GGUF file: 2 threads, greedy, no stop at EOS (its token
    generator runs until we stop it); each token is stamped as it is yielded. prompt_lookup
    (prompt_lookup_args' keys): decode with its LlamaPromptLookupDecoding draft model."""
    from pagoda.loading.model_files import resolve_model

    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ValueError("--peer llama.cpp needs `pip install -e '.[peers]'`") from e
    folder, gguf_file = resolve_model(model)
    if gguf_file is None:
        raise ValueError("--peer llama.cpp needs a GGUF model")
    n_ctx = max(len(p) for p in prompts) + output_len + 8
    draft = None
    if prompt_lookup is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(
            max_ngram_size=prompt_lookup["max_matching_ngram_size"],
            num_pred_tokens=prompt_lookup["prompt_lookup_num_tokens"],
        )
    path = os.path.join(folder, gguf_file)
    llm = Llama(path, n_threads=2, n_ctx=n_ctx, verbose=False, draft_model=draft)
    timings = []
    for ids in prompts:
        stamps: list[float] = []
        t0 = time.perf_counter()
        for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == output_len:
                break
        timings.append(IterTiming(stamps[0] - t0, stamps[-1] - t0, len(stamps)))
    return timings


def run_hf(
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    prompt_lookup: dict[str, int] | None = None,
) -> list[IterTiming]:
    """HF generate with its KV cache, greedy, batch 1; a streamer stamps each new token (with
    prompt lookup, several at a time). prompt_lookup: generate()'s prompt-lookup arguments."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.num_tokens = 0
            self.prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:  # generate() first puts the prompt itself
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())
            self.num_tokens += int(value.numel())

        def end(self) -> None:
            pass

    hf = load_hf_peer(model)
    pad = hf_pad_token_id(hf)
    timings = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids, mask = left_pad([ids], pad)
            streamer = TimingStreamer()
            t0 = time.perf_counter()
            hf.generate(
                input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad,
                use_cache=True,
                streamer=streamer,
                **(prompt_lookup or {}),
            )
            if not streamer.times:
                raise RuntimeError("HF produced no tokens")
            timings.append(
                IterTiming(streamer.times[0] - t0, streamer.times[-1] - t0, streamer.num_tokens)
            )
    return timings
