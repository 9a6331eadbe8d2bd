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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-flags", default="-O2", help="flags for pagoda serve")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    runs: dict[str, list[float]] = {"closed": [], "open": []}
    events: list[int] = []
    with started_server(args.server_flags.split()) as server:
        run_load(server.url, seed=100)  # warm-up (compiles the step graphs' shapes)
        for r in range(args.rounds):
            for side in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                reader = FeedReader(server.url) if side == "open" else None
                if reader is not None:
                    reader.start()
                    time.sleep(1.0)
                runs[side].append(run_load(server.url, seed=0))
                if reader is not None:
                    reader.stop.set()
                    events.append(reader.events)
                print(f"round {r} feed {side}: {runs[side][-1]:.1f} output tok/s", flush=True)
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
