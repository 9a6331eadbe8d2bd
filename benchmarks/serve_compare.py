"""Serving benchmark, pagoda against llama.cpp's OpenAI server on the same GGUF, in one run.

Starts `pagoda serve` on the embedded SmolLM2-135M Q4_1 GGUF (`--quantization gguf`: kept
quantized) and `python -m llama_cpp.server` on the same file (skipped, with a message, when
llama-cpp-python is not importable), then runs each `pagoda bench serve` scenario (concurrency
1, 8, 32 and a Poisson rate sweep) on pagoda and right after on llama.cpp, with the same seeded
prompts. Writes summaries (compare.json, with both systems' precisions and the machine's load)
and plots under benchmarks/results/serve/ and prints the tables with the pagoda / llama.cpp
output-throughput ratio.

llama-cpp-python runs under the Python given by --llama-cpp-python (default:
$PAGODA_LLAMA_CPP_PYTHON, else this interpreter), so it can live in its own virtualenv:

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install 'llama-cpp-python[server]'
    python benchmarks/serve_compare.py --llama-cpp-python /tmp/peers/bin/python
    python benchmarks/serve_compare.py --scale 0.5  # half the prompts (about 8 minutes idle)
    python benchmarks/serve_compare.py --scale 0.1  # smoke run: a few prompts per scenario
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import httpx

from pagoda.bench.common import gguf_weight_type, llama_cpp_precision, pagoda_precision
from pagoda.bench.serve_plots import plot_cdfs, plot_sweep
from pagoda.loading.model_files import resolve_model

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "serve")


@dataclass(frozen=True)
class Scenario:
    name: str
    num_prompts: int
    max_concurrency: int | None = None
    sweep_rates: tuple[float, ...] = ()


SCENARIOS = (
    Scenario("concurrency-1", 16, max_concurrency=1),
    Scenario("concurrency-8", 32, max_concurrency=8),
    Scenario("concurrency-32", 64, max_concurrency=32),
    Scenario("rate-sweep", 32, sweep_rates=(0.5, 1.0, 2.0, 4.0)),
)
WORKLOAD = [
    "--input-len-range",
    "64,256",
    "--output-len-range",
    "64,128",
    "--seed",
    "0",
    "--temperature",
    "0",
    "--slo-ttft-ms",
    "2000",
    "--slo-tpot-ms",
    "200",
]


@dataclass(frozen=True)
class System:
    label: str
    command: Callable[[str, int], list[str]]  # (gguf path, port) -> argv
    ready_path: str  # GET this until it answers 200
    bench_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment


PAGODA_QUANTIZATION = "gguf"  # the CPU default for a GGUF file, said explicitly


def pagoda_command(gguf: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    # No MODEL: `pagoda serve` runs the embedded SmolLM2 GGUF, the same file as `gguf`.
    return [sys.executable, "-m", "pagoda.cli", "serve", "--host", "127.0.0.1"] + [
        "--port",
        str(port),
        "--quantization",
        PAGODA_QUANTIZATION,
        "--disable-log-requests",
        *extra,
    ]


def llama_cpp_command(
    gguf: str, port: int, python: str = sys.executable, threads: int = 2
) -> list[str]:
    # interrupt_requests false: by default a new request cuts the stream being generated short.
    return [python, "-m", "llama_cpp.server", "--model", gguf] + [
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        "2048",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--interrupt_requests",
        "false",
        "--model_alias",
        "smollm2",
        "--verbose",
        "false",
    ]


PAGODA = System("pagoda", pagoda_command, "/health")
LLAMA_CPP = System(
    "llama.cpp",
    llama_cpp_command,
    "/v1/models",
    # llama-cpp-python ignores ignore_eos and bans only one end-of-generation id with
    # min_tokens; repeat_penalty 1.0 makes its greedy sampling plain greedy, like pagoda's.
    ("--logit-bias-eos", "--extra-body", json.dumps({"repeat_penalty": 1.0})),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(system: System, gguf: str, log_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log_path = os.path.join(log_dir, f"{system.label}-server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            system.command(gguf, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **dict(system.env)},
        )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system.label} server exited ({proc.returncode}); see {log_path}")
        try:
            if (
                httpx.get(base_url + system.ready_path, timeout=5, trust_env=False).status_code
                == 200
            ):
                print(f"{system.label} server ready at {base_url} (log: {log_path})", flush=True)
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"{system.label} server not ready after 600 s; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL to the process group we started (engine subprocesses included)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started for this server only
    except ProcessLookupError:
        pass
    proc.wait()


def bench_argv(system: System, scenario: Scenario, base_url: str, n: int, out: str) -> list[str]:
    argv = [sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", base_url]
    argv += ["--label", system.label, "--num-prompts", str(n), "--output-json", out]
    argv += WORKLOAD + list(system.bench_args)
    if scenario.max_concurrency is not None:
        argv += ["--max-concurrency", str(scenario.max_concurrency)]
    if scenario.sweep_rates:
        argv += ["--sweep-rates", ",".join(f"{r:g}" for r in scenario.sweep_rates)]
    return argv


def run_scenario(
    system: System, scenario: Scenario, base_url: str, scale: float, raw_dir: str
) -> dict[str, Any] | None:
    """The bench's full JSON (config, runs) of one scenario on one server; None if it failed."""
    n = max(2, round(scenario.num_prompts * scale))
    out = os.path.join(raw_dir, f"{system.label}-{scenario.name}.json")
    load = round(os.getloadavg()[0], 2)
    print(f"== {system.label}: {scenario.name} ({n} prompts, load {load})", flush=True)
    t0 = time.perf_counter()
    argv = bench_argv(system, scenario, base_url, n, out)
    # stdout is the bench's JSON line, also in `out`; stderr (progress) passes through.
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        print(f"   failed (exit {done.returncode}); see above", flush=True)
        return None
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    result["loadavg_1m_before"] = load
    result["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
    return result


def run_all(
    systems: list[System], gguf: str, scale: float, raw_dir: str
) -> dict[str, dict[str, dict[str, Any]]]:
    """{system: {scenario: the bench's JSON}}. Every server is up at once (an idle one blocks
    on its socket) and each scenario runs on each server in turn, so the peer runs right after
    pagoda on the same prompts and a shared machine's load drifts on both alike."""
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, dict[str, dict[str, Any]]] = {s.label: {} for s in systems}
    try:
        urls = {}
        for system in systems:
            proc, urls[system.label] = start_server(system, gguf, raw_dir)
            procs.append(proc)
        for scenario in SCENARIOS:
            for system in systems:
                result = run_scenario(system, scenario, urls[system.label], scale, raw_dir)
                if result is not None:
                    results[system.label][scenario.name] = result
    finally:
        for proc in procs:
            stop_server(proc)
    return results


def llama_cpp_version(python: str) -> str | None:
    """llama-cpp-python's version under `python` if its server imports there, else None."""
    code = "import importlib.metadata as m, llama_cpp.server; print(m.version('llama_cpp_python'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(
            f"llama-cpp-python's server is not importable by {python}: "
            f"{done.stderr.strip().splitlines()[-1:]}; skipping the llama.cpp peer. Install it "
            "with: pip install 'llama-cpp-python[server]' (and pass --llama-cpp-python)",
            flush=True,
        )
        return None
    return done.stdout.strip()


# ---- report --------------------------------------------------------------------------------
def rows(results: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """(row name, {system: summary}) per scenario, one row per rate in the sweep."""
    out: list[tuple[str, dict[str, Any]]] = []
    for scenario in SCENARIOS:
        runs = {s: r[scenario.name]["runs"] for s, r in results.items() if scenario.name in r}
        if not runs:
            continue
        for i in range(max(len(v) for v in runs.values())):
            name = scenario.name
            if scenario.sweep_rates:
                name = f"rate {scenario.sweep_rates[i]:g} req/s"
            out.append((name, {s: v[i]["summary"] for s, v in runs.items() if i < len(v)}))
    return out


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def tokens_cell(summary: dict[str, Any]) -> str:
    """Output tokens counted, how (usage / server_timings / chunks), and the re-tokenized text's
    count as the cross-check, e.g. "1,576 (chunks; text 1,506)"."""
    if not summary:
        return "-"
    sources = "+".join(summary.get("output_tokens_source") or {}) or "-"
    n = summary["total_output_tokens"]
    text = summary.get("total_output_tokens_retokenized")
    cross = f"; text {text:,}" if text is not None and text != n else ""
    return f"{n:,} ({sources}{cross})"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Throughput: requests, output tokens and how they were counted, tok/s, goodput."""
    a, b = PAGODA.label, LLAMA_CPP.label
    head = [
        "scenario",
        "requests",
        f"{a} output tokens",
        f"{b} output tokens",
        f"{a} out tok/s",
        f"{b} out tok/s",
        "ratio",
        f"{a} goodput req/s",
        f"{b} goodput req/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_system in rows(results):
        sa, sb = by_system.get(a, {}), by_system.get(b, {})
        ta, tb = sa.get("output_throughput"), sb.get("output_throughput")
        ratio = f"**{ta / tb:.2f}x**" if ta is not None and tb else "-"
        done = sorted({s["completed"] + s["failed"] for s in (sa, sb) if s})
        cells = [
            name,
            "/".join(str(n) for n in done),
            tokens_cell(sa),
            tokens_cell(sb),
            fmt(ta),
            fmt(tb),
            ratio,
            fmt(sa.get("request_goodput"), 3),
            fmt(sb.get("request_goodput"), 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Latency: TTFT and ITL median / P99, P99 TPOT, in ms."""
    a, b = PAGODA.label, LLAMA_CPP.label

    def pair(summary: dict[str, Any], metric: str) -> str:
        med, p99 = summary.get(f"median_{metric}_ms"), summary.get(f"p99_{metric}_ms")
        digits = 0 if metric == "ttft" else 1
        return f"{fmt(med, digits)} / {fmt(p99, digits)}"

    head = ["scenario"]
    head += [f"{s} TTFT p50 / p99" for s in (a, b)] + [f"{s} ITL p50 / p99" for s in (a, b)]
    head += [f"{s} P99 TPOT" for s in (a, b)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_system in rows(results):
        sa, sb = by_system.get(a, {}), by_system.get(b, {})
        cells = [name, pair(sa, "ttft"), pair(sb, "ttft"), pair(sa, "itl"), pair(sb, "itl")]
        cells += [fmt(sa.get("p99_tpot_ms")), fmt(sb.get("p99_tpot_ms"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plots(results: dict[str, dict[str, dict[str, Any]]], out_dir: str) -> list[str]:
    paths = []
    for scenario in SCENARIOS:
        have = {s: r[scenario.name]["runs"] for s, r in results.items() if scenario.name in r}
        if not have:
            continue
        if scenario.sweep_rates:
            path = os.path.join(out_dir, f"{scenario.name}.png")
            sweeps = {
                s: [
                    {**run["summary"], "request_rate": float(run["summary"]["request_rate"])}
                    for run in runs
                ]
                for s, runs in have.items()
            }
            plot_sweep(sweeps, path, "output throughput and P99 latency vs request rate")
        else:
            path = os.path.join(out_dir, f"{scenario.name}-cdf.png")
            series = {s: runs[0]["requests"] for s, runs in have.items()}
            plot_cdfs(series, path, f"latency CDFs, {scenario.name}")
        paths.append(path)
    return paths


def summaries_record(results: dict[str, dict[str, dict[str, Any]]], scale: float) -> dict[str, Any]:
    """compare.json: configs and summaries only (per-request latencies stay in the raw files)."""
    return {
        "bench": "serve_compare",
        "scale": scale,
        "workload": WORKLOAD,
        "systems": {
            s: {
                name: {
                    "config": rec["config"],
                    "loadavg_1m_before": rec.get("loadavg_1m_before"),
                    "loadavg_1m_after": rec.get("loadavg_1m_after"),
                    "summaries": [run["summary"] for run in rec["runs"]],
                }
                for name, rec in by_scenario.items()
            }
            for s, by_scenario in results.items()
        },
        "rows": [
            {"scenario": name, **{s: summary for s, summary in by_system.items()}}
            for name, by_system in rows(results)
        ],
    }


def versions(llama_cpp_python: str | None) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("pagoda", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["llama_cpp_python"] = llama_cpp_python
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every scenario's prompt count"
    )
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    parser.add_argument(
        "--raw-dir",
        default=None,
        help="keep the per-run JSON (per-request latencies) and server logs here "
        "(default: a temporary folder)",
    )
    parser.add_argument(
        "--systems", default="pagoda,llama.cpp", help="comma-separated subset to run"
    )
    parser.add_argument(
        "--llama-cpp-python",
        default=os.environ.get("PAGODA_LLAMA_CPP_PYTHON", sys.executable),
        help="the Python that runs llama-cpp-python's server (default: "
        "$PAGODA_LLAMA_CPP_PYTHON, else this interpreter)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="CPU threads of each server: OMP_NUM_THREADS for both (torch's intra-op threads in "
        "pagoda) and llama.cpp's --n_threads / --n_threads_batch",
    )
    parser.add_argument(
        "--pagoda-args",
        default="",
        help="extra `pagoda serve` flags, space-separated, e.g. '-O2' (compiled decode steps)",
    )
    args = parser.parse_args()
    wanted = set(args.systems.split(","))
    pagoda_args = tuple(args.pagoda_args.split())
    env = (("OMP_NUM_THREADS", str(args.threads)),)
    pagoda = replace(PAGODA, command=partial(pagoda_command, extra=pagoda_args), env=env)
    llama_cpp = replace(
        LLAMA_CPP,
        command=partial(llama_cpp_command, python=args.llama_cpp_python, threads=args.threads),
        env=env,
    )
    systems = [s for s in (pagoda, llama_cpp) if s.label in wanted]
    if wanted - {s.label for s in systems}:
        parser.error(f"--systems: unknown {sorted(wanted - {s.label for s in systems})}")
    folder, gguf_file = resolve_model(None)
    assert gguf_file is not None, "the embedded model is a GGUF file"
    gguf = os.path.join(folder, gguf_file)
    raw_dir = args.raw_dir or tempfile.mkdtemp(prefix="pagoda-serve-compare-")
    os.makedirs(raw_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    llama_version = None
    if llama_cpp in systems:
        llama_version = llama_cpp_version(args.llama_cpp_python)
        if llama_version is None:
            systems.remove(llama_cpp)
    print(f"model: {gguf}\nraw results and server logs: {raw_dir}", flush=True)
    load_before = os.getloadavg()
    if load_before[0] > 1.0:
        print(
            f"warning: load average {load_before[0]:.1f} before the run: the figures will "
            "move with whatever else runs on these cores",
            flush=True,
        )
    t0 = time.perf_counter()
    results = run_all(systems, gguf, args.scale, raw_dir)
    record = summaries_record(results, args.scale)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["loadavg_1m_before"] = round(load_before[0], 2)
    record["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    record["cpu_count"] = os.cpu_count()
    gguf_type = gguf_weight_type(None)
    record["precisions"] = {
        PAGODA.label: pagoda_precision(PAGODA_QUANTIZATION, "float32", gguf_type, "cpu"),
        LLAMA_CPP.label: llama_cpp_precision(gguf_type),
    }
    record["threads"] = args.threads
    record["commands"] = {s.label: s.command("GGUF", 0) for s in systems}
    record["versions"] = versions(llama_version)
    with open(os.path.join(args.out_dir, "compare.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    plots = write_plots(results, args.out_dir)
    print(table(results))
    print()
    print(latency_table(results))
    print(f"wrote {os.path.join(args.out_dir, 'compare.json')} and {len(plots)} plots")
    print(f"total {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
