"""How many tokens does llama.cpp's server stream, counted four ways?

llama-cpp-python's server (0.3.x) sends no usage in a stream (it ignores
`stream_options.include_usage`), so `pagoda bench serve` has to count its output tokens itself.
This sends serve_compare.py's concurrency-1 prompts (seeded, the same request bodies as
`pagoda bench serve --logit-bias-eos`) one at a time, each twice: streamed, then not streamed,
whose response carries the server's own `usage.completion_tokens`. Per request it writes the
tokens asked for, the server's count, the streamed chunks, the chunks re-tokenized one by one
(what `pagoda bench serve` counts without usage) and the whole text re-tokenized (what it counted
before: lossy, because a model's greedy tokens are often not the tokenizer's own split of the
text).

    python benchmarks/serve_count_check.py --llama-cpp-python /tmp/peers/bin/python

The non-streamed text can differ from the streamed one: llama-cpp-python reuses the prompt's
KV cache from the previous request, so the prefill runs in other batch shapes and float rounding
can flip a greedy choice. Both counts are the server's for its own text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from functools import partial
from typing import Any

import httpx
from serve_compare import (
    LLAMA_CPP,
    RESULTS_DIR,
    SCENARIOS,
    llama_cpp_command,
    llama_cpp_version,
    start_server,
    stop_server,
)

from pagoda.bench.serve_client import DONE, chunk_text, parse_sse_line
from pagoda.bench.serve_prompts import (
    build_requests,
    load_bench_tokenizer,
    num_tokens,
    special_token_ids,
)
from pagoda.loading.model_files import resolve_model


def stream(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[list[str], list[Any]]:
    chunks: list[str] = []
    events: list[Any] = []
    with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            event = parse_sse_line(line)
            if event is None:
                continue
            if event == DONE:
                break
            assert isinstance(event, dict)
            events.append(event)
            if text := chunk_text(event):
                chunks.append(text)
    return chunks, events


def check(base_url: str, num_prompts: int) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(None)
    requests = build_requests(tokenizer, num_prompts, (64, 256), (64, 128), seed=0)
    bias = {str(i): -100.0 for i in special_token_ids(tokenizer)}
    url = base_url + "/v1/completions"
    rows = []
    with httpx.Client(timeout=3600.0, trust_env=False) as client:
        for i, req in enumerate(requests):
            body = {
                "model": "smollm2",
                "prompt": req.prompt,
                "max_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "logit_bias": bias,
                "repeat_penalty": 1.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            chunks, events = stream(client, url, body)
            plain = {k: v for k, v in body.items() if k != "stream_options"}
            full = client.post(url, json={**plain, "stream": False}).json()
            text = "".join(chunks)
            row = {
                "request": i,
                "tokens_asked": req.output_len,
                "stream_finish_reason": (events[-1].get("choices") or [{}])[0].get("finish_reason"),
                "stream_has_usage": any("usage" in e for e in events),
                "stream_chunks": len(chunks),
                "stream_chunks_retokenized_each": sum(num_tokens(tokenizer, c) for c in chunks),
                "stream_text_retokenized": num_tokens(tokenizer, text),
                "nonstream_usage_completion_tokens": full["usage"]["completion_tokens"],
                "nonstream_finish_reason": full["choices"][0]["finish_reason"],
                "nonstream_text_retokenized": num_tokens(tokenizer, full["choices"][0]["text"]),
                "same_text": full["choices"][0]["text"] == text,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = [k for k in rows[0] if isinstance(rows[0][k], int) and not isinstance(rows[0][k], bool)]
    totals = {k: sum(r[k] for r in rows) for k in keys if k != "request"}
    return {"num_prompts": num_prompts, "totals": totals, "requests": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-cpp-python",
        default=os.environ.get("PAGODA_LLAMA_CPP_PYTHON", sys.executable),
        help="the Python that runs llama-cpp-python's server",
    )
    parser.add_argument("--num-prompts", type=int, default=SCENARIOS[0].num_prompts)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's --n_threads")
    parser.add_argument("--output-json", default=os.path.join(RESULTS_DIR, "count_check.json"))
    args = parser.parse_args()
    version = llama_cpp_version(args.llama_cpp_python)
    if version is None:
        return 1
    folder, gguf_file = resolve_model(None)
    assert gguf_file is not None
    command = partial(llama_cpp_command, python=args.llama_cpp_python, threads=args.threads)
    system = replace(LLAMA_CPP, command=command, env=(("OMP_NUM_THREADS", str(args.threads)),))
    proc, base_url = start_server(system, os.path.join(folder, gguf_file), tempfile.mkdtemp())
    try:
        record = {
            "bench": "serve_count_check",
            "llama_cpp_python": version,
            "threads": args.threads,
            "loadavg_1m_before": round(os.getloadavg()[0], 2),
        }
        record.update(check(base_url, args.num_prompts))
    finally:
        stop_server(proc)
    print(json.dumps(record["totals"]))
    with open(args.output_json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
