"""`bench latency --peer llama-bench`: native llama.cpp's own benchmark on the same GGUF file, 2
threads, as its users run it (benchmarks/build_llama_cpp.sh builds it for this CPU).

Two runs a round, each with llama-bench's warm-up run and `--repetitions` timed ones:
- prefill: `-p INPUT_LEN -n 0`, the prompt evaluated at once (ppN), against pagoda's prompt
  tokens over its time to first token;
- decode: `-p 0 -n OUTPUT_LEN -d INPUT_LEN`, OUTPUT_LEN tokens one at a time after INPUT_LEN
  tokens of context (tgM @ dN: the context pagoda decodes at), against pagoda's decode rate after
  the first token.

llama-bench's folder comes from --llama-cpp-bin or PAGODA_LLAMA_CPP_BIN.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from pagoda.bench.common import log

THREADS = 2


def llama_cpp_bin(flag: str | None, tool: str) -> Path:
    """The native llama.cpp tool `tool` from the folder the flag or PAGODA_LLAMA_CPP_BIN names;
    ValueError when neither is given or the tool is not there."""
    folder = flag or os.environ.get("PAGODA_LLAMA_CPP_BIN")
    if not folder:
        raise ValueError(
            f"this peer needs native llama.cpp's {tool}: --llama-cpp-bin DIR or "
            "PAGODA_LLAMA_CPP_BIN (its bin/ folder; `bash benchmarks/build_llama_cpp.sh` builds it)"
        )
    path = Path(folder) / tool
    if not os.access(path, os.X_OK):
        raise ValueError(f"{path} is not an executable (`bash benchmarks/build_llama_cpp.sh`)")
    return path


def run_llama_bench(tool: Path, gguf: str, args: list[str], repetitions: int) -> dict[str, Any]:
    """One llama-bench test (its JSON record); RuntimeError with its stderr if it fails."""
    argv = [str(tool), "-m", gguf, "-t", str(THREADS), "-r", str(repetitions), "-o", "json"]
    proc = subprocess.run(argv + args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv + args)} failed ({proc.returncode}): {proc.stderr}")
    tests = json.loads(proc.stdout)
    if len(tests) != 1:
        raise RuntimeError(f"llama-bench gave {len(tests)} tests, one was asked for")
    return dict(tests[0])


def llama_bench_round(
    tool: Path, gguf: str, input_len: int, output_len: int, repetitions: int
) -> dict[str, Any]:
    """One round: prefill (ppN) and decode (tgM @ dN) tok/s, with llama-bench's own spread."""
    pp = run_llama_bench(tool, gguf, ["-p", str(input_len), "-n", "0"], repetitions)
    tg = run_llama_bench(
        tool, gguf, ["-p", "0", "-n", str(output_len), "-d", str(input_len)], repetitions
    )
    log(
        f"llama-bench: pp{input_len} {pp['avg_ts']:.1f} tok/s, tg{output_len} @ d{input_len} "
        f"{tg['avg_ts']:.1f} tok/s"
    )
    return {
        "prefill_tok_s": round(float(pp["avg_ts"]), 2),
        "prefill_tok_s_stddev": round(float(pp["stddev_ts"]), 2),
        "ttft_ms": round(input_len / float(pp["avg_ts"]) * 1e3, 2),
        "decode_tok_s": round(float(tg["avg_ts"]), 2),
        "decode_tok_s_stddev": round(float(tg["stddev_ts"]), 2),
        "setup": {k: tg.get(k) for k in ("n_batch", "n_ubatch", "type_k", "type_v", "flash_attn")},
        "version": {
            "name": "llama.cpp (native llama-bench)",
            "binary": str(tool),  # build/ (native) or build-avx2/ (benchmarks/build_llama_cpp.sh)
            "build_number": tg.get("build_number"),
            "build_commit": tg.get("build_commit"),
            "cpu_info": tg.get("cpu_info"),
            "backends": tg.get("backends"),
            "threads": tg.get("n_threads"),
        },
    }
