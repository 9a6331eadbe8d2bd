"""B1 decode with a draft model: pagoda with and without it, and native llama.cpp's llama-server
with and without the same draft (`-md`, its draft-simple speculation), all four up at once and
timed on the same prompts, the engines' order rotating from prompt to prompt.

Workloads (pagoda/bench/spec_workloads.py): code (a function's signature and docstring to
complete) and chat. Per workload and temperature, each prompt runs once on every engine,
OUTPUT_LEN tokens, EOS ignored; a seeded request at temperature > 0 (seed = the prompt's
index). Every engine is timed the same way, by this client from the token stream: decode tok/s
= (tokens - 1) / (last token's arrival - first's), so every engine counts the same tokens. The
sampling is plain on both sides (llama.cpp's top_k / top_p / min_p / repeat penalty set
neutral, as pagoda's defaults are). Per engine the median over the prompts; the ratios are
medians of the per-prompt ratios. Greedy outputs of pagoda with the draft are checked equal to
pagoda's without.

    python benchmarks/spec_pair.py --target T.gguf --draft D.gguf --llama-cpp-bin DIR \\
        [--k 3] [-O 2] [--workloads code,chat] [--temperatures 0,0.7] [--num-prompts 6] \\
        [--output-len 128] [--output-json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagoda.bench.b1_runs import time_prompt  # noqa: E402
from pagoda.bench.common import decode_tok_s, free_port, log, median, ratio, write_json  # noqa: E402
from pagoda.bench.llama_bench import THREADS, llama_cpp_bin  # noqa: E402
from pagoda.bench.machine import machine_record  # noqa: E402
from pagoda.bench.spec_workloads import workload_prompts  # noqa: E402

ENGINES = ("pagoda", "pagoda+draft", "llama.cpp", "llama.cpp+draft")


def main() -> int:
    args = _parse()
    from pagoda import LLM

    spec = {"model": args.draft, "num_speculative_tokens": args.k}
    common = dict(optimization_level=args.O, max_model_len=2048)
    pagoda = {
        "pagoda": LLM(args.target, **common),
        "pagoda+draft": LLM(args.target, speculative_config=spec, **common),
    }
    tokenizer = pagoda["pagoda"].get_tokenizer()
    tool = llama_cpp_bin(args.llama_cpp_bin, "llama-server")
    draft_args = ["-md", args.draft, "--spec-type", "draft-simple"]
    draft_args += ["--spec-draft-n-max", str(args.k)]
    with (
        _llama_server(tool, args.target, []) as plain,
        _llama_server(tool, args.target, draft_args) as drafted,
    ):
        servers = {"llama.cpp": plain, "llama.cpp+draft": drafted}
        cases = []
        for kind in args.workloads.split(","):
            prompts = workload_prompts(tokenizer, kind, args.num_prompts)
            for temperature in (float(t) for t in args.temperatures.split(",")):
                cases.append(_case(kind, temperature, prompts, pagoda, servers, args))
    record = {
        "bench": "spec_pair",
        "target": args.target,
        "draft": args.draft,
        "num_speculative_tokens": args.k,
        "optimization_level": args.O,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "method": "B1, one request at a time; the four engines up at once, their order rotating "
        "per prompt; decode tok/s = (tokens - 1) / (last - first token arrival) from each "
        "engine's stream, timed by the same client; ratios: medians of per-prompt ratios",
        "llama_cpp": {
            "server": str(tool),
            "version": _version(tool),
            "threads": THREADS,
            "draft_args": draft_args,
            "sampling": "temperature as pagoda's; top_k 0, top_p 1, min_p 0, repeat_penalty 1",
        },
        "machine": machine_record(),
        "cases": cases,
    }
    if args.output_json:
        write_json(record, args.output_json)
    return 0


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--llama-cpp-bin", default=None)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step, both engines")
    p.add_argument("-O", type=int, default=2, help="pagoda's optimization level")
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def _case(
    kind: str,
    temperature: float,
    prompts: list[list[int]],
    pagoda: dict[str, Any],
    servers: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every prompt on every engine, rotating the order: per-engine runs and medians."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ENGINES}
    for i, prompt in enumerate(prompts):
        order = ENGINES[i % len(ENGINES) :] + ENGINES[: i % len(ENGINES)]
        for name in order:
            seed = i if temperature > 0 else None
            if name in pagoda:
                run = _pagoda_run(pagoda[name], prompt, temperature, seed, args.output_len)
            else:
                run = _llama_run(servers[name], prompt, temperature, seed, args.output_len)
            runs[name].append(run)
        log(f"{kind} T={temperature} prompt {i}: " + ", ".join(
            f"{n} {runs[n][-1]['decode_tok_s']}" for n in ENGINES
        ))  # fmt: skip
    case: dict[str, Any] = {"workload": kind, "temperature": temperature}
    for name in ENGINES:
        rates = [r["decode_tok_s"] for r in runs[name]]
        drafted = sum(r.get("drafted", 0) for r in runs[name])
        accepted = sum(r.get("accepted", 0) for r in runs[name])
        case[name] = {
            "decode_tok_s": round(median(rates), 2),
            "ttft_ms": round(median([r["ttft_ms"] for r in runs[name]]), 1),
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "runs": runs[name],
        }

    def per_prompt(a: str, b: str) -> float | None:
        values = [ratio(x["decode_tok_s"], y["decode_tok_s"]) for x, y in zip(runs[a], runs[b])]
        known = [v for v in values if v is not None]
        return round(median(known), 3) if known else None

    case["ratio_draft_vs_plain"] = per_prompt("pagoda+draft", "pagoda")
    case["ratio_vs_llama_cpp_draft"] = per_prompt("pagoda+draft", "llama.cpp+draft")
    case["ratio_vs_llama_cpp_plain"] = per_prompt("pagoda+draft", "llama.cpp")
    case["llama_cpp_draft_vs_plain"] = per_prompt("llama.cpp+draft", "llama.cpp")
    if temperature == 0:
        same = [a["tokens"] == b["tokens"] for a, b in zip(runs["pagoda+draft"], runs["pagoda"])]
        case["greedy_outputs_identical"] = all(same)
    for name in ENGINES:
        for r in runs[name]:
            r.pop("tokens", None)
    log(
        f"{kind} T={temperature}: pagoda+draft / pagoda {case['ratio_draft_vs_plain']}x, "
        f"/ llama.cpp+draft {case['ratio_vs_llama_cpp_draft']}x, / llama.cpp "
        f"{case['ratio_vs_llama_cpp_plain']}x; acceptance pagoda "
        f"{case['pagoda+draft']['acceptance']}, llama.cpp {case['llama.cpp+draft']['acceptance']}"
    )
    return case


def _pagoda_run(
    llm: Any, prompt: list[int], temperature: float, seed: int | None, output_len: int
) -> dict[str, Any]:
    from pagoda import SamplingParams

    params = SamplingParams(
        temperature=temperature, seed=seed, max_tokens=output_len, ignore_eos=True
    )
    before = llm.engine.stats()
    timing, tokens = time_prompt(llm, prompt, output_len, params)
    after = llm.engine.stats()
    run: dict[str, Any] = {
        "ttft_ms": round(timing.ttft_s * 1e3, 1),
        "decode_tok_s": _round(timing.decode_tok_s),
        "tokens": tokens,
    }
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    if drafted:
        run["drafted"] = drafted
        run["accepted"] = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return run


def _llama_run(
    url: str, prompt: list[int], temperature: float, seed: int | None, output_len: int
) -> dict[str, Any]:
    """One streamed /completion on the prompt's token ids, cache off."""
    body = {
        "prompt": prompt,
        "n_predict": output_len,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": False,
        "temperature": temperature,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "seed": -1 if seed is None else seed,
    }
    t0 = time.perf_counter()
    first = last = None
    final: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("content") or chunk.get("tokens"):
                last = time.perf_counter() - t0
                first = last if first is None else first
            if chunk.get("stop"):
                final = chunk
    timings = final.get("timings", {})
    n = int(timings.get("predicted_n", 0))
    assert first is not None and last is not None and n == output_len, (n, final)
    run: dict[str, Any] = {
        "ttft_ms": round(first * 1e3, 1),
        "decode_tok_s": _round(decode_tok_s(n, first, last)),
        "server_predicted_per_second": _round(timings.get("predicted_per_second")),
    }
    if timings.get("draft_n"):
        run["drafted"] = int(timings["draft_n"])
        run["accepted"] = int(timings["draft_n_accepted"])
    return run


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@contextmanager
def _llama_server(tool: Path, gguf: str, extra: list[str]) -> Iterator[str]:
    """llama-server on the GGUF (one slot, 2 threads) until the block ends; its URL."""
    port = free_port()
    argv = [str(tool), "-m", gguf, "-t", str(THREADS), "-tb", str(THREADS), "-np", "1"]
    argv += ["-c", "2048", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {' '.join(argv)}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up: {' '.join(argv)}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _version(tool: Path) -> list[str]:
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=False)
    return (out.stdout + out.stderr).strip().splitlines()


if __name__ == "__main__":
    sys.exit(main())
