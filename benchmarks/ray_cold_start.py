"""A fresh replica's cold start on the Ray Serve app: the seconds from `serve.run` to the
application running (one engine replica), the replica's own start (constructor to engine ready,
as the replica measures it), and the time to first token of the first request it serves;
then the same for a second replica added by scaling to two (what an autoscaler waits for).

    python benchmarks/ray_cold_start.py --output-json benchmarks/results/issue20/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from pagoda.bench.common import free_port, write_json


def first_token_s(url: str) -> float:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "stream": True}
    began = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - began
    raise RuntimeError("no token came back")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import ray
    from ray import serve

    from pagoda.config import EngineConfig
    from pagoda.scaleout.ray_serve import RayServeOptions, build_application
    from pagoda.server.state import ServerConfig

    began = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    ray_s = time.monotonic() - began
    engine = EngineConfig.from_kwargs(args.model)

    def deploy(replicas: int) -> dict[str, Any]:
        options = RayServeOptions(min_replicas=replicas, max_replicas=replicas)
        began = time.monotonic()
        serve.run(build_application(engine, ServerConfig(log_requests=False), options), name="p")
        ready = time.monotonic() - began
        handle = serve.get_deployment_handle("PagodaEngine", app_name="p")
        starts = sorted({handle.info.remote().result()["start_seconds"] for _ in range(8)})
        return {
            "serve_run_to_running_s": round(ready, 2),
            "replica_start_s": [round(s, 2) for s in starts],
            "first_request_ttft_s": round(first_token_s(url), 3),
        }

    try:
        one = deploy(1)
        two = deploy(2)  # the first replica stays; a second one starts beside it
    finally:
        ray.shutdown()
    result = {
        "bench": "ray_cold_start",
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 (embedded)",
        "ray_init_and_serve_start_s": round(ray_s, 2),
        "first_replica": one,
        "scale_to_two": two,
        "note": "replica_start_s: each running replica's constructor-to-engine-ready time "
        "(sampled over 8 calls); 2-core CPU machine",
    }
    print(json.dumps(result), flush=True)
    if args.output_json:
        write_json(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
