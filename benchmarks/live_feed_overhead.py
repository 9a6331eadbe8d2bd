"""What the live feed costs the engine (issue 23): W-CPU through one `pagoda serve` (64
requests, in/out U[16,256], all at once, ignore_eos), with GET /v1/engine/events read by a
client (a browser page's place) and without, alternately, --rounds each; output tok/s per run
and the ratio of the medians.

    python benchmarks/live_feed_overhead.py --output-json benchmarks/results/issue23/feed_overhead.json
"""

from __future__ import annotations

import argparse
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

from pagoda.bench.common import write_json

PORT = 8765
URL = f"http://127.0.0.1:{PORT}"


def start_server(flags: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--port", str(PORT), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(URL + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("pagoda serve did not start")


class FeedReader(threading.Thread):
    """Reads the feed until stopped, as a page would; counts events."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.events = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", URL + "/v1/engine/events", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])  # a page parses every event
                    self.events += 1
                if self.stop.is_set():
                    return


def run_load(seed: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "serve.json")
        cmd = [
            sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", URL,
            "--num-prompts", "64", "--input-len-range", "16,256", "--output-len-range", "16,256",
            "--max-concurrency", "64", "--seed", str(seed), "--output-json", out,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            record = json.load(f)
    return float(record["runs"][0]["summary"]["output_throughput"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-flags", default="-O2", help="flags for pagoda serve")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    server = start_server(args.server_flags.split())
    try:
        run_load(seed=100)  # warm-up (compiles the step graphs' shapes)
        runs: dict[str, list[float]] = {"closed": [], "open": []}
        events: list[int] = []
        for r in range(args.rounds):
            for side in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                reader = FeedReader() if side == "open" else None
                if reader is not None:
                    reader.start()
                    time.sleep(1.0)
                runs[side].append(run_load(seed=0))
                if reader is not None:
                    reader.stop.set()
                    events.append(reader.events)
                print(f"round {r} feed {side}: {runs[side][-1]:.1f} output tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    closed, opened = statistics.median(runs["closed"]), statistics.median(runs["open"])
    record: dict[str, Any] = {
        "bench": "live_feed_overhead",
        "workload": "W-CPU through pagoda serve: 64 requests, in/out U[16,256], seed 0, "
        "max concurrency 64, ignore_eos, temperature 0",
        "server_flags": args.server_flags,
        "output_tok_s_feed_closed": runs["closed"],
        "output_tok_s_feed_open": runs["open"],
        "events_read_per_open_run": events,
        "median_closed": round(closed, 2),
        "median_open": round(opened, 2),
        "open_over_closed": round(opened / closed, 4),
    }
    print(json.dumps(record, indent=1))
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
