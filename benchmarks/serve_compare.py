"""Serving benchmark, pagoda against llama.cpp's OpenAI server on the same GGUF, in one run.

Starts `pagoda serve` on the embedded SmolLM2-135M Q4_1 GGUF, runs `pagoda bench serve`
scenarios against it (concurrency 1, 8, 32 and a Poisson rate sweep), stops it; then does the
same with `python -m llama_cpp.server` on the same file (skipped, with a message, when
llama-cpp-python is not installed). Both get the same seeded prompts. Writes summaries
(compare.json) and plots under benchmarks/results/serve/ and prints a table with the
pagoda / llama.cpp output-throughput ratio.

    python benchmarks/serve_compare.py              # about 15 minutes on the 2-core CPU box
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
from dataclasses import dataclass
from typing import Any

import httpx

from pagoda.bench.serve import plot_cdfs, plot_sweep
from pagoda.loader import resolve_model

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


def pagoda_command(gguf: str, port: int) -> list[str]:
    # No MODEL: `pagoda serve` runs the embedded SmolLM2 GGUF, the same file as `gguf`.
    return [sys.executable, "-m", "pagoda.cli", "serve", "--host", "127.0.0.1"] + [
        "--port",
        str(port),
        "--disable-log-requests",
    ]


def llama_cpp_command(gguf: str, port: int) -> list[str]:
    # interrupt_requests false: by default a new request cuts the stream being generated short.
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf] + [
        "--n_threads",
        "2",
        "--n_threads_batch",
        "2",
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
            system.command(gguf, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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


def run_system(system: System, gguf: str, scale: float, raw_dir: str) -> dict[str, dict[str, Any]]:
    """{scenario name: the bench's full JSON (config, runs)} for one server."""
    proc, base_url = start_server(system, gguf, raw_dir)
    results: dict[str, dict[str, Any]] = {}
    try:
        for scenario in SCENARIOS:
            n = max(2, round(scenario.num_prompts * scale))
            out = os.path.join(raw_dir, f"{system.label}-{scenario.name}.json")
            print(f"== {system.label}: {scenario.name} ({n} prompts)", flush=True)
            t0 = time.perf_counter()
            argv = bench_argv(system, scenario, base_url, n, out)
            # stdout is the bench's JSON line, also in `out`; stderr (progress) passes through.
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)
            if done.returncode != 0:
                print(f"   failed (exit {done.returncode}); see above", flush=True)
                continue
            with open(out) as f:
                results[scenario.name] = json.load(f)
            print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        stop_server(proc)
    return results


def llama_cpp_available() -> bool:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        print(
            f"llama-cpp-python's server is not importable ({e}); skipping the llama.cpp peer. "
            "Install it with: pip install 'llama-cpp-python[server]'",
            flush=True,
        )
        return False
    return True


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


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    a, b = PAGODA.label, LLAMA_CPP.label
    head = [
        "scenario",
        f"{a} out tok/s",
        f"{b} out tok/s",
        "ratio",
        f"{a} P99 TPOT ms",
        f"{b} P99 TPOT ms",
        f"{a} P99 TTFT ms",
        f"{b} P99 TTFT ms",
        f"{a} goodput req/s",
        f"{b} goodput req/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_system in rows(results):
        sa, sb = by_system.get(a, {}), by_system.get(b, {})
        ta, tb = sa.get("output_throughput"), sb.get("output_throughput")
        ratio = f"**{ta / tb:.2f}x**" if ta is not None and tb else "-"
        cells = [
            name,
            fmt(ta),
            fmt(tb),
            ratio,
            fmt(sa.get("p99_tpot_ms")),
            fmt(sb.get("p99_tpot_ms")),
            fmt(sa.get("p99_ttft_ms"), 0),
            fmt(sb.get("p99_ttft_ms"), 0),
            fmt(sa.get("request_goodput"), 3),
            fmt(sb.get("request_goodput"), 3),
        ]
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


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("pagoda", "llama_cpp_python", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
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
    args = parser.parse_args()
    wanted = set(args.systems.split(","))
    systems = [s for s in (PAGODA, LLAMA_CPP) if s.label in wanted]
    if wanted - {s.label for s in systems}:
        parser.error(f"--systems: unknown {sorted(wanted - {s.label for s in systems})}")
    folder, gguf_file = resolve_model(None)
    assert gguf_file is not None, "the embedded model is a GGUF file"
    gguf = os.path.join(folder, gguf_file)
    raw_dir = args.raw_dir or tempfile.mkdtemp(prefix="pagoda-serve-compare-")
    os.makedirs(raw_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    if LLAMA_CPP in systems and not llama_cpp_available():
        systems.remove(LLAMA_CPP)
    print(f"model: {gguf}\nraw results and server logs: {raw_dir}", flush=True)
    load_before = os.getloadavg()
    if load_before[0] > 1.0:
        print(
            f"warning: load average {load_before[0]:.1f} before the run: the figures will "
            "move with whatever else runs on these cores",
            flush=True,
        )
    t0 = time.perf_counter()
    results = {s.label: run_system(s, gguf, args.scale, raw_dir) for s in systems}
    record = summaries_record(results, args.scale)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["loadavg_1m_before"] = round(load_before[0], 2)
    record["versions"] = versions()
    with open(os.path.join(args.out_dir, "compare.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    plots = write_plots(results, args.out_dir)
    print(table(results))
    print(f"wrote {os.path.join(args.out_dir, 'compare.json')} and {len(plots)} plots")
    print(f"total {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
