"""Served load against the strongest peers, in alternating rounds: `pagoda serve`, native
llama.cpp's `llama-server` and vLLM's OpenAI server, all on one GGUF's weights, driven by the
same `pagoda bench serve` load (64 completions at once, in/out U[16,256], streamed, EOS ignored:
W-CPU's shape served).

    python benchmarks/serve_peers.py --rounds 3 \
        --llama-cpp-bin /tmp/llamacpp/build/bin --vllm-python /tmp/vllm/bin/python
    python benchmarks/serve_peers.py --model "$(bash benchmarks/qwen_gguf.sh)" ...

- pagoda: `pagoda serve -O2 --model GGUF` (kept quantized, the CPU default).
- llama-server: `-m GGUF -t 2 -tb 2 -np 16 -c 16 x 1024` (16 slots, continuous batching, its
  default), built by benchmarks/build_llama_cpp.sh. It reads the same file.
- vLLM: `vllm serve` on the checkpoint dequantized to float32 by transformers (its tokenizer
  saved beside it), in --vllm-dtype (bfloat16 where the CPU has avx512_bf16, as its users run
  it), 2 cores bound (VLLM_CPU_OMP_THREADS_BIND=0-1).

`--workload b1` sends 8 requests of 128 tokens in and out one at a time instead: batch 1
through each server (its TTFT and TPOT).

`--pagoda-args` given more than once serves one pagoda per setting, each against every peer
(the burst study: `--peers vllm --pagoda-args=-O2 --pagoda-args="-O2
--max-num-batched-tokens 512"`).

One server is up at a time: each is started for its load and stopped after it, so that no
idle engine runs beside the one measured (an idle vLLM's worker keeps 13 gloo threads that wake
about 100 times a second each; with it up and idle after a load, pagoda's TTFT p50 under this
load was 1.2-1.5x its own alone: benchmarks/README.md, issue 42 tenth part). `--all-up` starts
every server once and keeps them up, as this script did before. Each round sends new prompts
(seed + 100 x round: a prompt an earlier round sent would be a prefix-cache hit) to every
server in turn, the order alternating round by round; the record holds each round's summaries,
the per-round ratios pagoda / peer (output tok/s, TTFT p50 / p99, TPOT p50 / p99) with their
medians and ranges, the machine and every engine's version and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from serve_compare import System, start_server, stop_server

from pagoda.bench.common import gguf_path, log, median
from pagoda.bench.llama_bench import llama_cpp_bin
from pagoda.bench.machine import machine_record, pagoda_version, ratio_summary, round_order
from pagoda.bench.vllm_peer import MEMORY_SHARE, export_float32, vllm_dtypes, vllm_python

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "issue42")
# burst: W-CPU's shape served, all at once; b1: one request at a time (batch 1 through the server)
WORKLOADS = {
    "burst": "--num-prompts 64 --input-len-range 16,256 --output-len-range 16,256".split(),
    "b1": (
        "--num-prompts 8 --input-len-range 128,128 --output-len-range 128,128 --max-concurrency 1"
    ).split(),
}
COMMON = ["--temperature", "0", "--disable-tqdm"]
SLOTS = 16
METRICS = (  # (summary key, higher is better)
    ("output_throughput", True),
    ("median_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("median_tpot_ms", False),
    ("p99_tpot_ms", False),
)


@dataclass(frozen=True)
class Served:
    system: System
    version: dict[str, Any]


def pagoda_system(gguf: str, extra: list[str], label: str = "pagoda") -> Served:
    def command(path: str, port: int) -> list[str]:
        argv = [sys.executable, "-m", "pagoda.cli", "serve", "--model", path]
        return argv + ["--host", "127.0.0.1", "--port", str(port), "--disable-log-requests", *extra]

    return Served(System(label, command, "/health"), {**pagoda_version(), "args": extra})


def pagoda_systems(gguf: str, variants: list[str]) -> list[Served]:
    """One `pagoda serve` per --pagoda-args: "pagoda" for the first, "pagoda-2", ... after it."""
    labels = ["pagoda"] + [f"pagoda-{i}" for i in range(2, len(variants) + 1)]
    return [
        pagoda_system(gguf, v.split(), label) for v, label in zip(variants, labels, strict=True)
    ]


def llama_server_system(bin_dir: str | None) -> Served:
    tool = llama_cpp_bin(bin_dir, "llama-server")

    def command(path: str, port: int) -> list[str]:
        argv = [str(tool), "-m", path, "-t", "2", "-tb", "2", "-np", str(SLOTS)]
        return argv + ["-c", str(SLOTS * 1024), "--host", "127.0.0.1", "--port", str(port)]

    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=False)
    version = (out.stdout + out.stderr).strip().splitlines()
    info = {"name": "llama.cpp (native llama-server)", "version": version, "threads": 2}
    return Served(System("llama-server", command, "/health"), {**info, "slots": SLOTS})


def vllm_system(python: str, folder: str, dtype: str, share: float) -> Served:
    def command(path: str, port: int) -> list[str]:
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
        argv += ["--served-model-name", "peer", "--dtype", dtype, "--max-model-len", "1024"]
        return argv + [
            "--gpu-memory-utilization",
            "0.5",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    out = subprocess.run(
        [python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    version, torch = (out.stdout.split() + [None, None])[:2]
    env = (("VLLM_CPU_OMP_THREADS_BIND", "0-1"), ("HF_HUB_OFFLINE", "1"))
    info = {"name": f"vllm-cpu {version}", "version": version, "torch": torch, "dtype": dtype}
    info["gpu_memory_utilization"] = share
    return Served(System(f"vllm-{dtype}", command, "/health", env=env), {**info, "threads": 2})


def export_vllm_folder(model: str | None, folder: str) -> None:
    """The float32 checkpoint (as `bench throughput --peer vllm` exports it) with its
    tokenizer, so vLLM's server can take text prompts."""
    from transformers import AutoTokenizer

    from pagoda.loading.model_files import resolve_model

    export_float32(model, folder)
    source, gguf_file = resolve_model(model)
    AutoTokenizer.from_pretrained(source, gguf_file=gguf_file).save_pretrained(folder)


def load_alone(
    system: System, gguf: str, seed: int, raw_dir: str, r: int, workload: list[str]
) -> dict[str, Any]:
    """run_load with only this server up: started for the load, stopped after it."""
    proc, url = start_server(system, gguf, raw_dir)
    try:
        return run_load(system.label, url, gguf, seed, raw_dir, r, workload)
    finally:
        stop_server(proc)


def run_load(
    label: str, url: str, gguf: str, seed: int, raw_dir: str, r: int, workload: list[str]
) -> dict[str, Any]:
    out = os.path.join(raw_dir, f"{label}-round{r}.json")
    argv = [sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", url]
    argv += ["--label", label, "--tokenizer", gguf, "--seed", str(seed), "--output-json", out]
    done = subprocess.run(argv + workload, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve against {label} failed ({done.returncode})")
    with open(out) as f:
        summary: dict[str, Any] = json.load(f)["runs"][0]["summary"]
    log(
        f"round {r} {label}: {summary['output_throughput']:.1f} out tok/s, TTFT p50/p99 "
        f"{summary['median_ttft_ms']:.0f}/{summary['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
        f"{summary['median_tpot_ms']:.1f}/{summary['p99_tpot_ms']:.1f} ms"
    )
    return summary


def compare(rounds: list[dict[str, Any]], ours: list[str], peers: list[str]) -> dict[str, Any]:
    """Each engine's median of every metric, and per pagoda server and peer the per-round
    ratios pagoda / peer with their median and range: `ratios_PEER` for the first pagoda
    server, `ratios_LABEL_vs_PEER` for the others (--pagoda-args given more than once)."""
    out: dict[str, Any] = {}
    for name in [*ours, *peers]:
        out[f"{name}_medians"] = {
            key: round(median([r[name][key] for r in rounds]), 2) for key, _ in METRICS
        }
    for label in ours:
        for peer in peers:
            name = f"ratios_{peer}" if label == ours[0] else f"ratios_{label}_vs_{peer}"
            out[name] = {
                key: ratio_summary([r[label][key] for r in rounds], [r[peer][key] for r in rounds])
                for key, _ in METRICS
            }
    return out


def peer_systems(args: argparse.Namespace, simd_flags: list[str], raw_dir: str) -> list[Served]:
    """The peers --peers names: llama-server, and vLLM in each of its --vllm-dtype precisions
    (its checkpoint exported into raw_dir)."""
    wanted = args.peers.split(",") if args.peers else []
    served: list[Served] = []
    if "llama-server" in wanted:
        served.append(llama_server_system(args.llama_cpp_bin))
    if "vllm" in wanted:
        python = vllm_python(args.vllm_python)
        folder = os.path.join(raw_dir, "vllm-model")
        export_vllm_folder(args.model, folder)
        dtypes = vllm_dtypes(args.vllm_dtype, simd_flags)
        for dtype in dtypes:  # every server up at once: the memory share split between them
            served.append(vllm_system(python, folder, dtype, MEMORY_SHARE / len(dtypes)))
    return served


def log_ratios(record: dict[str, Any]) -> None:
    for name, ratios in record.items():
        if name.startswith("ratios_"):
            for key, _ in METRICS:
                s = ratios[key]
                log(f"{name} {key}: {s['median']}x (range {s['min']}-{s['max']})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--peers", default="llama-server,vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="burst")
    parser.add_argument("--llama-cpp-bin", default=None)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--vllm-dtype", default="auto")
    parser.add_argument(
        "--pagoda-args",
        action="append",
        help="pagoda serve's arguments (default -O2); given more than once, one server each "
        "(labels pagoda, pagoda-2, ...), every one against every peer",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--all-up",
        action="store_true",
        help="start every server once and keep all up (default: one up at a time, for its load)",
    )
    parser.add_argument("--output-json", default=os.path.join(RESULTS, "serve_peers.json"))
    args = parser.parse_args()
    gguf = gguf_path(args.model)
    if gguf is None:
        parser.error("--model must be a GGUF file: every server reads the same one")
    machine = machine_record()
    served = pagoda_systems(gguf, args.pagoda_args or ["-O2"])
    ours = [s.system.label for s in served]
    raw_dir = tempfile.mkdtemp(prefix="pagoda-serve-peers-")
    served += peer_systems(args, machine["simd_flags"], raw_dir)
    labels = [s.system.label for s in served]
    procs, urls = [], {}
    t0 = time.perf_counter()
    workload = WORKLOADS[args.workload] + COMMON
    record: dict[str, Any] = {"bench": "serve_peers", "model": gguf, "workload": workload}
    record["rounds"] = []
    record["servers_up"] = "all at once" if args.all_up else "one at a time"
    try:
        if args.all_up:
            for s in served:
                proc, urls[s.system.label] = start_server(s.system, gguf, raw_dir)
                procs.append(proc)
        by_label = {s.system.label: s.system for s in served}
        for r in range(args.rounds):
            entry: dict[str, Any] = {"order": round_order(r, labels)}
            seed = args.seed + 100 * r
            for label in entry["order"]:
                if args.all_up:
                    entry[label] = run_load(label, urls[label], gguf, seed, raw_dir, r, workload)
                else:
                    entry[label] = load_alone(by_label[label], gguf, seed, raw_dir, r, workload)
            record["rounds"].append(entry)
    finally:
        for proc in procs:
            stop_server(proc)
    peers = labels[len(ours) :]
    record.update(compare(record["rounds"], ours, peers))
    record["machine"] = {**machine, "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    record["versions"] = {s.system.label: s.version for s in served}
    record["commands"] = {s.system.label: s.system.command("GGUF", 0) for s in served}
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["raw_dir"] = raw_dir
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    log_ratios(record)
    log(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
