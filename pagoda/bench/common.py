"""What the benchmarks share: random-token workloads, rate and summary helpers, the JSON line,
the precision each system computes in (so a ratio names both), and the HF transformers peer
loaded from the same weights as pagoda."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# nano-vllm's bench recipe draws token ids from randint(0, 10000), both ends included.
TOKEN_ID_RANGE = (0, 10_000)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """argparse type for "A,B": two integers with 1 <= A <= B."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A,B (two integers), got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return lo, hi


def random_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int = 0,
    shared_prefix_len: int = 0,
    token_id_range: tuple[int, int] = TOKEN_ID_RANGE,
) -> list[BenchRequest]:
    """Random-token requests drawn in nano-vllm's order: every prompt (length, then ids), then
    every output length. seed 0 with W1's ranges gives 133,966 output tokens.

    With shared_prefix_len = L, the same L random tokens (drawn after everything else, so the
    rest of the workload is unchanged) are put in front of every prompt: input lengths become
    L + U[A, B].
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {shared_prefix_len}")
    rng = random.Random(seed)
    lo, hi = token_id_range
    prompts = [
        [rng.randint(lo, hi) for _ in range(rng.randint(*input_len_range))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    prefix = [rng.randint(lo, hi) for _ in range(shared_prefix_len)]
    return [BenchRequest(prefix + p, n) for p, n in zip(prompts, output_lens)]


def random_prompt(
    length: int, seed: int, token_id_range: tuple[int, int] = TOKEN_ID_RANGE
) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*token_id_range) for _ in range(length)]


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def throughput_stats(
    elapsed_s: float,
    num_prompt_tokens: int,
    num_output_tokens: int,
    prefix_cache_hit_rate: float | None = None,
) -> dict[str, Any]:
    """Rates over a timed run; total_tok_s counts prompt and output tokens."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be > 0, got {elapsed_s}")
    return {
        "elapsed_s": round(elapsed_s, 4),
        "output_tok_s": round(num_output_tokens / elapsed_s, 2),
        "total_tok_s": round((num_prompt_tokens + num_output_tokens) / elapsed_s, 2),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "prefix_cache_hit_rate": prefix_cache_hit_rate,
    }


def hit_rate(hits: int, queries: int) -> float | None:
    """Prefix-cache hit rate in tokens; None when nothing was looked up (caching off)."""
    if queries <= 0:
        return None
    return round(hits / queries, 4)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def decode_tok_s(num_tokens: int, first_token_time: float, last_token_time: float) -> float | None:
    """Decode rate after the first token: (n - 1) / (last - first); None if it cannot be told."""
    span = last_token_time - first_token_time
    if num_tokens < 2 or span <= 0:
        return None
    return (num_tokens - 1) / span


def emit(record: dict[str, Any], output_json: str | None) -> None:
    """The benchmark's one line on stdout, also written to output_json when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def token_id_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set, for a bench that sends token ids and reads token ids
    only: a model without tokenizer files (a config-only folder run with --load-format dummy)
    runs with skip_tokenizer_init. A model with a tokenizer keeps it, so outputs are
    detokenized as in vLLM's benchmarks."""
    from pagoda.engine_args import engine_kwargs
    from pagoda.loading.tokenizer import has_tokenizer

    kwargs = engine_kwargs(args)
    if not kwargs.get("skip_tokenizer_init") and not has_tokenizer(
        kwargs.get("tokenizer") or args.model
    ):
        log(f"{args.model} has no tokenizer files: running with --skip-tokenizer-init")
        kwargs["skip_tokenizer_init"] = True
    return kwargs


def add_output_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default=None, help="also write the JSON line here")


# ---- precisions: what each system computes in ----------------------------------------------
# A peer ratio compares two systems and the weights they read: a 4-bit model against a float32
# one measures the bytes per weight as much as the engine. Every record with a peer names both
# precisions (`precisions`, `same_precision`) and so does the ratio line on stderr.
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")
GGUF_WEIGHT_BITS = {
    "Q4_0": "4-bit",
    "Q4_1": "4-bit",
    "Q4_K": "4-bit",
    "IQ4_NL": "4-bit",  # on pagoda's CPU kernels (cpu_iq4nl); int8 groups elsewhere
    "IQ4_XS": "4-bit",  # on pagoda's CPU kernels (cpu_iq4xs); int8 rows elsewhere
    "Q5_0": "5-bit",  # on pagoda's CPU kernels (cpu_q5); int8 groups elsewhere
    "Q5_1": "5-bit",  # on pagoda's CPU kernels (cpu_q5_1); int8 rows elsewhere
    "Q5_K": "5-bit",  # on pagoda's CPU kernels (cpu_q5k); int8 rows elsewhere
    "Q6_K": "6-bit",  # on pagoda's CPU kernels (cpu_q6k); int8 rows elsewhere
    "Q8_0": "8-bit",
}


def gguf_path(model: str | None) -> str | None:
    """The model's GGUF file (the embedded SmolLM2's without a model); None for an HF folder."""
    import os

    from pagoda.loading.model_files import resolve_model

    folder, gguf_file = resolve_model(model)
    return None if gguf_file is None else os.path.join(folder, gguf_file)


def gguf_weight_type(model: str | None) -> str | None:
    """The GGUF type most of the model's tensors are stored in ("Q4_1" for the embedded SmolLM2:
    210 Q4_1 tensors, the token embedding Q8_0, norms F32); None for an HF folder."""
    import collections
    import os

    from pagoda.loading.model_files import resolve_model

    folder, gguf_file = resolve_model(model)
    if gguf_file is None:
        return None
    from pagoda.loading.gguf_index import read_gguf_index

    types = collections.Counter(
        t.tensor_type.name for t in read_gguf_index(os.path.join(folder, gguf_file)).tensors
    )
    quantized = {k: v for k, v in types.items() if k not in FLOAT_GGUF_TYPES}
    return max(quantized or types, key=lambda k: (quantized or types)[k])


def pagoda_precision(quantization: str, dtype: str, gguf_type: str | None, device: str) -> str:
    """pagoda's weights and activations in words, e.g. "gguf Q4_1 (4-bit weights, bf16
    activations)" or "float32 dequantized from the GGUF Q4_1".

    quantization: the scheme in effect (ModelConfig.quantization); dtype: the model dtype
    ("float32"); device: "cpu" or "cuda" (torch's packed CPU ops take bf16 activations)."""
    act = "bf16" if device == "cpu" else dtype.replace("bfloat16", "bf16")
    from pagoda.kernels.cpu import kernels as cpu_kernels  # torch: only once a model is loaded

    if device == "cpu" and quantization != "none" and cpu_kernels() is not None:
        # GGUF layers and int8 rows take the kernels' form (layers/quant_forms.py)
        act = "int8 (pagoda's CPU kernels)" if quantization == "gguf" else act
    source = f"the GGUF {gguf_type}" if gguf_type else "the checkpoint"
    if quantization == "none":
        return f"{dtype} dequantized from {source}" if gguf_type else f"{dtype} ({source})"
    if quantization == "gguf":
        bits = GGUF_WEIGHT_BITS.get(gguf_type or "", "int8-per-row")
        return f"gguf {gguf_type} ({bits} weights, {act} activations)"
    return f"{quantization} weights quantized from {source}, {act} activations"


def weights_record(llm: Any, gguf_type: str | None) -> dict[str, Any]:
    """pagoda's weight scheme, model dtype, weight bytes in memory (and the GGUF file's size)
    and precision in words."""
    import os

    from pagoda.loading.model_files import resolve_model

    mc = llm.engine.model_config
    dtype = str(mc.dtype).removeprefix("torch.")
    record: dict[str, Any] = {
        "quantization": mc.quantization,
        "dtype": dtype,
        "weight_mib": round(mc.weight_bytes / 2**20, 2),
        "precision": pagoda_precision(mc.quantization, dtype, gguf_type, llm.engine.device.type),
        # K/V bytes a rank holds per token of a sequence (1/N of it under context parallelism)
        "kv_bytes_per_token_per_rank": mc.kv_bytes_per_token(llm.engine.config.cache.kv_dtype),
    }
    folder, gguf_file = resolve_model(llm.engine.config.model)
    if gguf_file is not None:
        size = os.path.getsize(os.path.join(folder, gguf_file))
        record["gguf_file_mib"] = round(size / 2**20, 2)
    draft = llm.engine.executor.draft
    if draft is not None:  # speculative decoding's draft model
        record["draft_model"] = {
            "architecture": draft.config.architecture,
            "num_layers": draft.config.num_layers,
            "quantization": draft.config.quantization,
            "weight_mib": round(draft.config.weight_bytes / 2**20, 2),
        }
    return record


def hf_precision(gguf_type: str | None) -> str:
    """The HF peer: transformers dequantizes a GGUF at load; load_hf_peer runs float32."""
    return f"float32 dequantized from the GGUF {gguf_type}" if gguf_type else "float32"


def llama_cpp_precision(gguf_type: str | None) -> str:
    """llama.cpp reads the GGUF file pagoda reads; on CPU its Q4 / Q8 dot products quantize the
    activations to 8 bits (ggml's vec_dot_type Q8_0 / Q8_1)."""
    return f"gguf {gguf_type}, the same file (llama.cpp's kernels, 8-bit activations)"


def like_with_like_kwargs(peer: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """HF runs the checkpoint dequantized to float32, so with --peer hf pagoda does too
    (--quantization none) unless the user chose a --quantization."""
    if peer == "hf" and "quantization" not in kwargs:
        log("--peer hf: pagoda runs --quantization none, the float32 weights HF runs")
        return {**kwargs, "quantization": "none"}
    return kwargs


def peer_comparison(
    pagoda: str, peer_name: str, peer: str, same_weights: bool, metric: str, value: float | None
) -> dict[str, Any]:
    """The record's fields that name both precisions, and the ratio line printed with them.
    same_weights: both systems read the same weight values in the same format."""
    shown = "-" if value is None else f"{value:.2f}x"
    weights = "same weights" if same_weights else "DIFFERENT weight precisions"
    return {
        "precisions": {"pagoda": pagoda, "peer": peer},
        "same_weights": same_weights,
        "ratio_line": (
            f"pagoda / {peer_name} {metric}: {shown} ({weights}: pagoda {pagoda}; "
            f"{peer_name} {peer})"
        ),
    }


# ---- the HF transformers peer --------------------------------------------------------------
def load_hf_peer(model: str | None) -> Any:
    """HF transformers model on the weights pagoda loads (GGUF dequantized), fp32, CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.loading.model_files import resolve_model

    folder, gguf_file = resolve_model(model)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    hf = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    hf.eval()
    return hf


def hf_pad_token_id(hf: Any) -> int:
    gen = getattr(hf, "generation_config", None)
    for source in (gen, hf.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, (list, tuple)) and value:
                value = value[0]
            if isinstance(value, int):
                return value
    return 0


def left_pad(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[Any, Any]:
    """(input_ids, attention_mask) as long tensors, prompts padded on the left."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def spec_stats(after: Any, before: Any = None) -> dict[str, Any]:
    """Speculative decoding's counts between two engine stats (SchedulerStats; before None:
    since start) and their rates."""

    def delta(name: str) -> int:
        return int(getattr(after, name) - (getattr(before, name) if before is not None else 0))

    drafts, tokens = delta("spec_num_drafts"), delta("spec_num_draft_tokens")
    accepted = delta("spec_num_accepted_tokens")
    per_position = list(after.spec_accepted_per_position)
    if before is not None:
        for i, n in enumerate(before.spec_accepted_per_position):
            per_position[i] -= n
    return {
        "num_drafts": drafts,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_position": per_position,
        "acceptance_rate": round(accepted / tokens, 4) if tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
    }


def prompt_lookup_args(spec: Any) -> dict[str, int] | None:
    """HF generate()'s prompt-lookup arguments matching an ngram --speculative-config (the
    llama.cpp peer reads the same two)."""
    if spec is None:
        return None
    from pagoda.speculative_config import SpeculativeConfig

    config = SpeculativeConfig.parse(spec)
    if config is None or config.method != "ngram":
        return None
    assert config.prompt_lookup_max is not None
    return {
        "prompt_lookup_num_tokens": config.num_speculative_tokens,
        "max_matching_ngram_size": config.prompt_lookup_max,
    }


def parallel_stats(engine: Any) -> dict[str, Any] | None:
    """Under tensor, pipeline or context parallelism, per rank since start: steps, mean step
    time, the collectives' calls, bytes and time per step (gloo: the whole exchange), the
    pipeline's sends and receives per step (a receive's time includes the wait for the previous
    stage), the context-parallel all-gathers per step, and weight / KV-cache bytes. None on one
    rank."""
    stats = engine.executor.rank_stats()
    if stats is None:
        return None
    ranks = []
    for rank, s in enumerate(stats):
        steps = max(1, int(s["steps"]))
        ranks.append(
            {
                "rank": rank,
                "steps": int(s["steps"]),
                "step_ms": round(1000 * s["step_seconds"] / steps, 3),
                "collective_calls_per_step": round(s["collective_calls"] / steps, 2),
                "collective_bytes_per_step": round(s["collective_bytes"] / steps),
                "collective_ms_per_step": round(1000 * s["collective_seconds"] / steps, 3),
                "collective_share_of_step": round(
                    s["collective_seconds"] / max(s["step_seconds"], 1e-9), 4
                ),
                "pipeline_transfers_per_step": round(s["pipeline_calls"] / steps, 2),
                "pipeline_bytes_per_step": round(s["pipeline_bytes"] / steps),
                "pipeline_ms_per_step": round(1000 * s["pipeline_seconds"] / steps, 3),
                "context_gathers_per_step": round(s["context_calls"] / steps, 2),
                "context_bytes_per_step": round(s["context_bytes"] / steps),
                "context_ms_per_step": round(1000 * s["context_seconds"] / steps, 3),
                "weight_bytes": s["weight_bytes"],
                "kv_cache_bytes": s["kv_cache_bytes"],
            }
        )
    config = engine.config
    return {
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "prefill_context_parallel_size": config.prefill_context_parallel_size,
        "ranks": ranks,
    }


def write_json(record: dict[str, Any], path: str) -> None:
    """A benchmark's full result, indented, in `path` (its folder made if missing)."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StartedServer:
    url: str
    pid: int
    returncode: Callable[[], int | None]  # None while it runs


@contextlib.contextmanager
def started_server(
    serve_args: Sequence[str], timeout_s: float = 300.0, log_path: str | None = None
) -> Iterator[StartedServer]:
    """`pagoda serve SERVE_ARGS` on a free loopback port, ready (GET /health 200), until the
    block ends; then SIGTERM (it drains), SIGKILL after a minute. Its output goes to log_path
    (nowhere without one)."""
    import signal
    import subprocess
    import time

    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", *serve_args]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-log-requests"]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagoda serve {' '.join(serve_args)} exited: {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"pagoda serve was not ready in {timeout_s:.0f} s")
            time.sleep(0.1)
        yield StartedServer(url, proc.pid, proc.poll)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]
