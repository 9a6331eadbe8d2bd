"""What the live view costs the engine (issue 23): W-CPU through one `pagoda serve` (64
requests, in/out U[16,256], all at once, ignore_eos) with nobody watching ("closed"), with GET
/v1/engine/events read and parsed by a plain client ("reader": the server's and the engine's
cost alone), and with the /ui page open in headless Chromium ("page": Debian's chromium through
Playwright, drawing every event on the same two cores), in a rotating order, --rounds each;
output tok/s per run and the ratio of the medians to "closed".

    python benchmarks/live_feed_overhead.py --output-json benchmarks/results/issue23/feed_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import psutil

from pagoda.bench.browser import launch_chromium
from pagoda.bench.common import started_server, write_json


class FeedReader(threading.Thread):
    """Reads the feed until stopped, as a page would; counts events."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", self.url + "/v1/engine/events", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])  # a page parses every event
                    self.events += 1
                if self.stop.is_set():
                    return


class OpenPage:
    """/ui open in headless Chromium while the block runs; counts the events the page drew."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0

    def __enter__(self) -> OpenPage:
        from playwright.sync_api import sync_playwright

        self.playwright = sync_playwright().start()
        self.browser = launch_chromium(self.playwright)
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.goto(self.url + "/ui")
        self.page.wait_for_selector("#feed-state.live", timeout=30_000)
        self.first = self._samples()
        self.cpu_start = chromium_cpu_s()
        return self

    def _samples(self) -> int:
        return int(self.page.eval_on_selector("[data-plot='TTFT']", "e => e.dataset.samples || 0"))

    def __exit__(self, *exc: object) -> None:
        # the plots keep two minutes of samples: the count drawn during this run
        self.events = self._samples() - self.first
        self.cpu_s = chromium_cpu_s() - self.cpu_start
        self.browser.close()
        self.playwright.stop()


def cpu_s(processes: list[psutil.Process]) -> float:
    """CPU seconds (user + system) the processes have used so far (gone ones count 0)."""
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def chromium_cpu_s() -> float:
    """CPU seconds used so far by this process's Chromium processes."""
    return cpu_s([c for c in psutil.Process().children(recursive=True) if _is_chromium(c)])


def _is_chromium(proc: psutil.Process) -> bool:
    try:
        return "chrom" in proc.name()
    except psutil.Error:  # gone meanwhile
        return False


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process `pid` and its children (the API server and its
    engine process)."""
    root = psutil.Process(pid)
    return cpu_s([root, *root.children(recursive=True)])


def run_load(url: str, seed: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "serve.json")
        cmd = [
            sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", url,
            "--num-prompts", "64", "--input-len-range", "16,256", "--output-len-range", "16,256",
            "--max-concurrency", "64", "--seed", str(seed), "--output-json", out,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            record = json.load(f)
    return float(record["runs"][0]["summary"]["output_throughput"])


def snapshot_cost(repeats: int = 100) -> dict[str, Any]:
    """What one event costs, timed directly at W-CPU's busiest state (64 requests running on
    the default engine, 2912 KV blocks), in this process: the engine's build_snapshot (in its
    step loop), and the API server's event (payload() and its JSON), against the mean step."""
    import random

    from pagoda.client.llm import LLM
    from pagoda.sampling_params import SamplingParams
    from pagoda.scheduling.messages import EngineRequest
    from pagoda.scheduling.snapshot import build_snapshot
    from pagoda.server.live import MIN_INTERVAL_S, payload
    from pagoda.server.metrics import Metrics

    llm = LLM(None)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    for i in range(64):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))]
        params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
        llm.engine.add_request(EngineRequest(str(i), ids, params))
    steps = []
    for _ in range(24):
        began = time.perf_counter()
        llm.engine.step()
        steps.append(time.perf_counter() - began)
    scheduler = llm.engine.scheduler
    began = time.perf_counter()
    for _ in range(repeats):
        snapshot = build_snapshot(scheduler)
    build_ms = (time.perf_counter() - began) / repeats * 1e3
    metrics = Metrics("m")
    began = time.perf_counter()
    for _ in range(repeats):
        event = json.dumps(payload(snapshot, metrics))
    event_ms = (time.perf_counter() - began) / repeats * 1e3
    per_s = 1 / MIN_INTERVAL_S
    return {
        "num_blocks": len(snapshot.block_state),
        "num_requests": len(snapshot.requests),
        "event_bytes": len(event),
        "build_snapshot_ms": round(build_ms, 3),
        "api_event_ms": round(event_ms, 3),
        "mean_decode_step_ms": round(statistics.mean(steps[8:]) * 1e3, 2),
        # share of the engine loop's time spent building snapshots at 5 a second
        "engine_loop_share": round(build_ms * per_s / 1e3, 5),
        "api_process_share": round(event_ms * per_s / 1e3, 5),
    }


def watched_run(
    url: str, side: str, events: dict[str, list[int]], page_cpu: list[dict[str, float]]
) -> float:
    if side == "closed":
        return run_load(url, seed=0)
    if side == "page":
        with OpenPage(url) as page:
            began = time.monotonic()
            tok_s = run_load(url, seed=0)
            seconds = time.monotonic() - began
        events["page"].append(page.events)
        page_cpu.append({"chromium_cpu_s": round(page.cpu_s, 2), "run_s": round(seconds, 2)})
        return tok_s
    reader = FeedReader(url)
    reader.start()
    time.sleep(1.0)
    tok_s = run_load(url, seed=0)
    reader.stop.set()
    events["reader"].append(reader.events)
    return tok_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--server-flags", default="-O2", help="flags for pagoda serve")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    sides = ("closed", "reader", "page")
    runs: dict[str, list[float]] = {side: [] for side in sides}
    events: dict[str, list[int]] = {"reader": [], "page": []}
    page_cpu: list[dict[str, float]] = []
    server_cpu: dict[str, list[float]] = {side: [] for side in sides}
    with started_server(args.server_flags.split()) as server:
        # warm-up: the first run of a workload is slower (step shapes met for the first time)
        run_load(server.url, seed=100)
        run_load(server.url, seed=0)
        for r in range(args.rounds):
            for side in sides[r % 3 :] + sides[: r % 3]:
                cpu_before = tree_cpu_s(server.pid)
                runs[side].append(watched_run(server.url, side, events, page_cpu))
                server_cpu[side].append(round(tree_cpu_s(server.pid) - cpu_before, 2))
                print(f"round {r} {side}: {runs[side][-1]:.1f} output tok/s", flush=True)
    cost = snapshot_cost()
    print(f"one event: {cost}", flush=True)
    closed = statistics.median(runs["closed"])
    record: dict[str, Any] = {
        "bench": "live_feed_overhead",
        "workload": "W-CPU through pagoda serve: 64 requests, in/out U[16,256], seed 0, "
        "max concurrency 64, ignore_eos, temperature 0; the same requests in every run",
        "server_flags": args.server_flags,
        "machine": "2 vCPUs: the server, the engine, the load generator and (page) Chromium "
        "share them",
        "output_tok_s": runs,
        "events_per_run": events,
        "page_chromium_cpu": page_cpu,
        # the same requests every run: the server's and its engine's CPU seconds per run
        "server_cpu_s": server_cpu,
        "median_server_cpu_s": {side: statistics.median(v) for side, v in server_cpu.items()},
        "one_event": cost,
        "median_output_tok_s": {side: round(statistics.median(v), 2) for side, v in runs.items()},
        "over_closed": {
            side: round(statistics.median(runs[side]) / closed, 4) for side in ("reader", "page")
        },
        # each run against the same round's run without a watcher: drift between rounds cancels
        "median_of_round_ratios": {
            side: round(statistics.median(w / c for w, c in zip(runs[side], runs["closed"])), 4)
            for side in ("reader", "page")
        },
    }
    print(json.dumps(record, indent=1))
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
