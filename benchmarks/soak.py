"""Soak: minutes of mixed load on `pagoda serve` or on the Ray Serve app (`pagoda serve --ray`),
started here, at a fixed Poisson rate (default 80% of a `pagoda plan` JSON's max rate).

Its prompt and output lengths are the plan's workload's (--input-len-range, --output-len-range
default to the plan JSON's; a word of the soak's prompts is about one token), and the server
runs the plan's --max-num-seqs, so 80% of the plan's rate is the load the plan measured, plus
the soak's own kinds: a long prompt is --long-factor x the longest input.

Each request is one of (weights in KINDS): a streamed completion, a plain one, a streamed chat
cancelled after its first events (the client closes the connection), a bad request (an OpenAI
400/404 is its expected answer), a long prompt, and n = 2. Every request sent must end with its
expected outcome: anything else is an unexpected error. At the end no request may remain in
the server (running + waiting = 0 in /metrics, once the cancelled ones are aborted), and the
server's resident memory (its whole process tree) must stay within 5% after the warm-up.

    python benchmarks/soak.py --target serve --plan-json benchmarks/results/issue20/plan.json \
        --duration-s 600 --output-json benchmarks/results/issue20/soak_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from pagoda.bench.common import parse_range, started_server, write_json

KINDS = {"stream": 4, "plain": 2, "cancel": 1, "bad": 1, "long": 1, "n2": 1}
BAD_BODIES = [
    ({"prompt": "hi", "max_tokens": -1}, 400),
    ({"prompt": "hi", "temperature": "hot"}, 400),
    ({"prompt": "hi", "model": "no-such-model"}, 404),
    ({"prompt": "hi", "n": 0}, 400),
    ({"max_tokens": 4}, 400),
]
WORDS = "the of and to in is was for on that with as by at from it an be this are or".split()


def serve_args(target: str, model: str | None, extra: list[str]) -> list[str]:
    args = [*([model] if model else []), *extra]
    return [*args, "--ray", "--num-replicas", "1"] if target == "ray" else args


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class Mix:
    input_words: tuple[int, int]
    output_tokens: tuple[int, int]
    long_words: int


async def one(
    client: httpx.AsyncClient, kind: str, rng: random.Random, mix: Mix
) -> tuple[str, str]:
    """(outcome, detail): outcome "ok" or "unexpected"."""
    short = {
        "prompt": prompt(rng, rng.randint(*mix.input_words)),
        "max_tokens": rng.randint(*mix.output_tokens),
    }
    if kind == "bad":
        body, status = rng.choice(BAD_BODIES)
        r = await client.post("/v1/completions", json=body)
        ok = r.status_code == status and "error" in r.json()
        return ("ok" if ok else "unexpected", f"bad: {r.status_code} {r.text[:200]}")
    if kind == "plain":
        r = await client.post("/v1/completions", json=short)
        return _check_plain(r, 1)
    if kind == "n2":
        r = await client.post("/v1/completions", json={**short, "n": 2, "temperature": 0.8})
        return _check_plain(r, 2)
    if kind == "long":
        body = {"prompt": prompt(rng, mix.long_words), "max_tokens": 16}
        r = await client.post("/v1/completions", json=body)
        return _check_plain(r, 1)
    if kind == "stream":
        return await _stream(client, "/v1/completions", {**short, "stream": True}, None)
    messages = [{"role": "user", "content": prompt(rng, rng.randint(*mix.input_words))}]
    body = {"messages": messages, "max_tokens": mix.output_tokens[1], "stream": True}
    return await _stream(client, "/v1/chat/completions", body, 2)


def _check_plain(r: httpx.Response, choices: int) -> tuple[str, str]:
    if r.status_code != 200:
        return "unexpected", f"{r.status_code} {r.text[:200]}"
    got = len(r.json()["choices"])
    return ("ok", "") if got == choices else ("unexpected", f"{got} choices, want {choices}")


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after: int | None
) -> tuple[str, str]:
    events = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return "unexpected", f"stream {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok", ""
            if '"error"' in line:
                return "unexpected", f"error event: {line[:200]}"
            events += 1
            if cancel_after is not None and events >= cancel_after:
                return "ok", "cancelled"  # leaving the block closes the connection
    return "unexpected", f"stream ended without [DONE] after {events} events"


async def load(url: str, rate: float, duration_s: float, seed: int, mix: Mix) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS.items() for _ in range(w)]
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    unexpected: list[str] = []
    tasks = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def run(kind: str, r: random.Random) -> None:
            try:
                outcome, detail = await one(client, kind, r, mix)
            except Exception as e:  # a transport error is an unexpected outcome, not a crash
                outcome, detail = "unexpected", f"{kind}: {type(e).__name__}: {e}"
            outcomes[outcome] += 1
            if outcome == "unexpected":
                unexpected.append(f"{kind}: {detail}")

        began = time.monotonic()
        at = 0.0
        while at < duration_s:
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            kind = rng.choice(kinds)
            by_kind[kind] += 1
            tasks.append(asyncio.create_task(run(kind, random.Random(rng.random()))))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    sent = sum(by_kind.values())
    return {
        "sent": sent,
        "answered": sum(outcomes.values()),
        "lost": sent - sum(outcomes.values()),
        "ok": outcomes["ok"],
        "unexpected_errors": outcomes["unexpected"],
        "unexpected": unexpected[:20],
        "by_kind": dict(by_kind),
        "load_seconds": round(time.monotonic() - began, 1),
    }


def in_flight(url: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def sample_rss(pid: int, every_s: float, samples: list[tuple[float, int]]) -> None:
    began = time.monotonic()
    while True:
        samples.append((round(time.monotonic() - began, 1), tree_rss(pid)))
        await asyncio.sleep(every_s)


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    samples: list[tuple[float, int]] = []
    sampler = asyncio.create_task(sample_rss(pid, args.rss_every_s, samples))
    mix = Mix(args.input_len_range, args.output_len_range, args.long_words)
    result = await load(url, args.rate, args.duration_s, args.seed, mix)
    sampler.cancel()
    after = [rss for t, rss in samples if t >= args.warmup_s and rss > 0]  # 0: it exited
    result["rss_samples_mb"] = [(t, round(r / 2**20, 1)) for t, r in samples]
    if len(after) < 2:  # the server exited, or the run was shorter than the warm-up
        result["rss_mb"] = None
        return result
    first = statistics.mean(after[: max(1, len(after) // 10)])
    last = statistics.mean(after[-max(1, len(after) // 10) :])
    result["rss_mb"] = {
        "after_warmup_min": round(min(after) / 2**20, 1),
        "after_warmup_max": round(max(after) / 2**20, 1),
        "first_tenth_mean": round(first / 2**20, 1),
        "last_tenth_mean": round(last / 2**20, 1),
        "drift": round(last / first - 1, 4),
        "range": round(max(after) / min(after) - 1, 4),
    }
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", choices=["serve", "ray"], required=True)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--rate", type=float, default=None, help="req/s (default: 0.8 x the plan's)")
    p.add_argument("--plan-json", default=None, help="a `pagoda plan --output-json` file")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--rss-every-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len-range", type=parse_range, default=None, metavar="A,B")
    p.add_argument("--output-len-range", type=parse_range, default=None, metavar="A,B")
    p.add_argument("--long-factor", type=int, default=4, help="a long prompt: x the longest input")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the plan's")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pagoda serve` flag")
    p.add_argument(
        "--no-rss-check",
        dest="rss_check",
        action="store_false",
        help="pass on the requests' outcomes alone (a run of seconds, where memory still grows "
        "after start; the RSS samples are still recorded)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--server-log", default=None, help="default: TMPDIR/pagoda-soak-TARGET.log")
    args = p.parse_args()
    if args.server_log is None:
        args.server_log = os.path.join(tempfile.gettempdir(), f"pagoda-soak-{args.target}.log")
    plan: dict[str, Any] = {}
    if args.plan_json:
        with open(args.plan_json) as f:
            plan = json.load(f)
    workload = plan.get("workload", {})
    args.input_len_range = args.input_len_range or tuple(workload.get("input_len_range", (8, 64)))
    args.output_len_range = args.output_len_range or tuple(
        workload.get("output_len_range", (8, 48))
    )
    args.long_words = args.long_factor * args.input_len_range[1]
    args.max_num_seqs = args.max_num_seqs or plan.get("max_num_seqs")
    plan_rate = plan.get("max_request_rate")
    if args.rate is None:
        if plan_rate is None:
            p.error("give --rate or a --plan-json with a max_request_rate")
        args.rate = round(0.8 * float(plan_rate), 4)
    extra = [*args.serve_arg]
    if args.max_num_seqs is not None:
        extra += ["--max-num-seqs", str(args.max_num_seqs)]
    began = time.monotonic()
    cmd = serve_args(args.target, args.model, extra)
    with started_server(cmd, log_path=args.server_log) as server:
        ready_s = time.monotonic() - began
        result = asyncio.run(soak(args, server.url, server.pid))
        exited = server.returncode()
        if exited is not None:
            print(f"the server exited ({exited}) during the soak; see {args.server_log}")
            print(json.dumps({k: v for k, v in result.items() if k != "rss_samples_mb"}))
            return 1
        time.sleep(2.0)  # cancelled streams are aborted as their connections close
        result["in_flight_after"] = in_flight(server.url)
    passed = (
        result["unexpected_errors"] == 0
        and result["lost"] == 0
        and result["in_flight_after"] == 0
        and (
            not args.rss_check
            or (result["rss_mb"] is not None and result["rss_mb"]["range"] <= 0.05)
        )
    )
    record = {
        "bench": "soak",
        "target": args.target,
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 (embedded)",
        "note": "ray: the Ray Serve app with 1 engine replica, the same capacity as pagoda "
        "serve on this 2-core machine; RSS is the whole process tree (Ray's own daemons "
        "included for ray)",
        "rate": args.rate,
        "plan_max_rate": plan_rate,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "kinds": KINDS,
        "input_words_range": args.input_len_range,
        "output_tokens_range": args.output_len_range,
        "long_prompt_words": args.long_words,
        "max_num_seqs": args.max_num_seqs,
        "ready_s": round(ready_s, 2),
        **result,
        "rss_checked": args.rss_check,
        "passed": passed,
    }
    line = json.dumps({k: v for k, v in record.items() if k != "rss_samples_mb"})
    print(line, flush=True)
    if args.output_json:
        write_json(record, args.output_json)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
