"""Prefix caching across replicas: the prefix-cache hit rate of a shared-prefix load on one
`pagoda serve`, and on the Ray Serve app with two replicas under prefix-aware routing and under
Ray's default power-of-two-choices routing (load-aware, prefix-blind).

The load: --groups system prompts of about --prefix-words words each, every one followed by
--per-group different questions; all requests shuffled and sent --concurrency at a time, one
output token each (the prefill is what the cache saves). Hit rate = cached prompt tokens /
prompt tokens, from each response's usage.prompt_tokens_details.cached_tokens.

    python benchmarks/ray_routing.py --output-json benchmarks/results/issue20/routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx

from pagoda.bench.common import free_port, started_server, write_json


def workload(groups: int, per_group: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta omega river stone cloud paper light music garden".split()
    prompts = []
    for g in range(groups):
        prefix = f"System {g}: " + " ".join(rng.choice(words) for _ in range(prefix_words))
        prompts += [f"{prefix}\nQuestion {q}: what is {q} plus {g}?" for q in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def send_all(url: str, prompts: list[str], concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    cached = total = 0
    replicas: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(p: str) -> None:
            nonlocal cached, total
            async with sem:
                r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
            r.raise_for_status()
            usage = r.json()["usage"]
            total += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            replicas[r.headers.get("x-pagoda-replica", "single")] += 1

        began = time.monotonic()
        await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.monotonic() - began
    return {
        "prompt_tokens": total,
        "cached_tokens": cached,
        "hit_rate": round(cached / total, 4),
        "requests_per_replica": sorted(replicas.values()),
        "seconds": round(seconds, 2),
    }


def single_server(model: str | None, prompts: list[str], concurrency: int) -> dict[str, Any]:
    with started_server([model] if model else []) as server:
        return asyncio.run(send_all(server.url, prompts, concurrency))


def ray_app(
    url: str, model: str | None, router: str, prompts: list[str], concurrency: int
) -> dict[str, Any]:
    from ray import serve

    from pagoda.config import EngineConfig
    from pagoda.scaleout.ray_serve import RayServeOptions, build_application
    from pagoda.server.state import ServerConfig

    options = RayServeOptions(min_replicas=2, max_replicas=2, router=router)
    app = build_application(
        EngineConfig.from_kwargs(model), ServerConfig(log_requests=False), options
    )
    serve.run(app, name="pagoda", route_prefix="/")
    try:
        return asyncio.run(send_all(url, prompts, concurrency))
    finally:
        serve.delete("pagoda")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    prompts = workload(args.groups, args.per_group, args.prefix_words, args.seed)
    result: dict[str, Any] = {
        "bench": "ray_routing",
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 (embedded)",
        "workload": {k: v for k, v in vars(args).items() if k != "output_json"},
        "note": "same prompts, order and concurrency for each system; two replicas share this "
        "machine's 2 cores (hit rates, not speed, are the point)",
        "single_server": single_server(args.model, prompts, args.concurrency),
    }
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for router in ("prefix", "power-of-two"):
            result[f"ray_2_replicas_{router}"] = ray_app(
                f"http://127.0.0.1:{port}", args.model, router, prompts, args.concurrency
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    single = result["single_server"]["hit_rate"]
    for router in ("prefix", "power-of-two"):
        run = result[f"ray_2_replicas_{router}"]
        run["hit_rate_vs_single"] = round(run["hit_rate"] / single, 4)
    print(json.dumps(result), flush=True)
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
