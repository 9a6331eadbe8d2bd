"""Seconds from `pagoda serve`'s start to its first 200 on GET /health, over several starts.

    python benchmarks/serve_start.py [--runs 5] [--model PATH] [--port 8123] [-- EXTRA SERVE ARGS]

Each run starts `python -m pagoda.cli serve` (the embedded SmolLM2-135M without --model), polls
/health every 50 ms until it answers 200, then stops the server and waits for it to exit. Prints
one JSON line: every run's seconds to ready and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

POLL_S = 0.05


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def one_start(command: list[str], url: str, timeout: float) -> float:
    """Seconds from spawning the server to its first 200 on /health."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode}")
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"no 200 on {url} within {timeout:.0f} s")
            time.sleep(POLL_S)
        return time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: embedded)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per start")
    parser.add_argument("extra", nargs="*", help="more `pagoda serve` flags (after --)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "pagoda.cli", "serve"]
    if args.model is not None:
        command.append(args.model)
    command += ["--port", str(args.port), "--uvicorn-log-level", "warning", *args.extra]
    url = f"http://127.0.0.1:{args.port}/health"
    if healthy(url):
        raise SystemExit(f"something already answers on {url}; pick another --port")
    seconds = [round(one_start(command, url, args.timeout), 3) for _ in range(args.runs)]
    record = {
        "bench": "serve_start",
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "cwd": os.getcwd(),
        "runs_s": seconds,
        "median_s": round(statistics.median(seconds), 3),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
