"""The /ui page's cost to a busy engine, measured in short alternating windows (issue 23): one
`pagoda serve` kept under W-CPU's load shape without pause (64 requests in flight, prompts and
outputs U[16,256] tokens, ignore_eos, temperature 0), one headless Chromium that shows the /ui
page in every other window and about:blank in the others. Each window settles, then counts the
server's generated tokens (/metrics) for --window-s seconds. Windows this short fall within one
of the machine's speed phases (which last minutes and move whole runs by up to 15%), so each
page window is compared with the closed windows on either side of it.

    python benchmarks/live_view_windows.py --refresh 1 \
        --output-json benchmarks/results/issue23/page_windows_refresh_1.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from pagoda.bench.browser import launch_chromium
from pagoda.bench.common import started_server, write_json

IN_FLIGHT = 64
VOCAB = 30_000  # prompt ids are drawn below this: inside any vocabulary the tests use


class Load(threading.Thread):
    """IN_FLIGHT clients, each sending its next completion as soon as the last returns."""

    def __init__(self, url: str, vocab: int) -> None:
        super().__init__(daemon=True)
        self.url, self.vocab = url, vocab
        self.stopping = False
        self.failures = 0

    def run(self) -> None:
        asyncio.run(self._clients())

    async def _clients(self) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(IN_FLIGHT)))

    async def _client(self, client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping:
            prompt = [rng.randrange(100, self.vocab) for _ in range(rng.randint(16, 256))]
            body = {
                "prompt": prompt,
                "max_tokens": rng.randint(16, 256),
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(self.url + "/v1/completions", json=body)
            self.failures += r.status_code != 200


def generated(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("pagoda:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no pagoda:generation_tokens_total in /metrics")


def window(url: str, seconds: float) -> float:
    """Generated tokens per second over the next `seconds`."""
    t0, n0 = time.monotonic(), generated(url)
    time.sleep(seconds)
    return (generated(url) - n0) / (time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=14)
    p.add_argument("--window-s", type=float, default=12.0)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--server-flags", default="-O2", help="flags for pagoda serve")
    p.add_argument("--refresh", default="1", help="the page's refresh: 0.2, 1 (its default) or 5")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    windows: list[tuple[str, float]] = []
    with started_server(args.server_flags.split()) as server, sync_playwright() as playwright:
        load = Load(server.url, VOCAB)
        load.start()
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        time.sleep(args.warmup_s)  # the load's step shapes compiled, the KV cache in use
        for i in range(2 * args.pairs + 1):  # closed, page, closed, ..., closed
            side = "page" if i % 2 else "closed"
            if side == "page":
                page.goto(f"{server.url}/ui?refresh={args.refresh}")
                page.wait_for_selector("#feed-state.live", timeout=30_000)
            else:
                page.goto("about:blank")
            time.sleep(args.settle_s)
            windows.append((side, window(server.url, args.window_s)))
            print(f"window {i} {side}: {windows[-1][1]:.1f} generated tok/s", flush=True)
        load.stopping = True
        browser.close()
    closed = [v for s, v in windows if s == "closed"]
    opened = [v for s, v in windows if s == "page"]
    # each page window against the mean of the closed windows before and after it
    ratios = [opened[k] / ((closed[k] + closed[k + 1]) / 2) for k in range(len(opened))]
    record: dict[str, Any] = {
        "bench": "live_view_windows",
        "workload": f"pagoda serve {args.server_flags} under W-CPU's load shape without pause: "
        f"{IN_FLIGHT} completions in flight, prompt and output U[16,256] tokens (random ids), "
        "ignore_eos, temperature 0; generated tokens counted from /metrics",
        "machine": "2 vCPUs shared by the server, the engine, the load and Chromium",
        "page_refresh_s": float(args.refresh),
        "window_s": args.window_s,
        "settle_s": args.settle_s,
        "windows": [{"side": s, "generated_tok_s": round(v, 2)} for s, v in windows],
        "page_over_neighbouring_closed": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
        "mean_ratio": round(statistics.mean(ratios), 4),
        "load_failures": load.failures,
    }
    print(f"page / closed: median {record['median_ratio']}, mean {record['mean_ratio']}")
    if args.output_json:
        write_json(record, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
