"""Online serving load generator for any OpenAI-compatible server (pagoda, vLLM, llama.cpp):
seeded random-token prompts, Poisson arrivals and/or a concurrency cap, streamed responses;
TTFT / TPOT / ITL / E2E percentiles, throughput and goodput; JSON and PNG plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagoda.bench.common import emit, log, parse_range

if TYPE_CHECKING:
    import httpx

NAME = "serve"

DONE = "[DONE]"
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; e2el is end-to-end latency
METRIC_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


@dataclass(frozen=True)
class ServeRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` under the benchmark's tokenizer (no special tokens)
    output_len: int


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, from the moment it was sent."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # what was asked for (max_tokens)
    output_tokens: int = 0  # what came back, counted as output_tokens_source says
    output_tokens_source: str = ""  # one of COUNT_SOURCES
    retokenized_tokens: int = 0  # the whole text re-tokenized: a cross-check, lossy
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    start: float = 0.0  # send time (perf_counter; relative to the run's start after run_load)
    chunks: list[str] = field(default_factory=list)  # the text of each text-carrying chunk
    finish_reason: str | None = None
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    server_output_tokens: int | None = None  # llama.cpp's timings.predicted_n, no usage sent

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2el, self.ttft, self.output_tokens)


# ---- arguments -----------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """argparse type for "r1,r2,...": positive request rates ("inf" allowed)."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected r1,r2,... (numbers), got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
    )
    s.add_argument("--model", default=None, help="model name to send (default: GET /v1/models)")
    s.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf file to build prompts and count tokens with (default: SmolLM2)",
    )
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--label", default=None, help="name of the system under test (in the JSON)")

    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len-range", type=parse_range, default=(64, 256), metavar="A,B")
    w.add_argument("--output-len-range", type=parse_range, default=(64, 128), metavar="A,B")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="every prompt starts with the same L tokens (prefix caching)",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos and min_tokens = max_tokens (vLLM's extension fields), so every "
        "request runs to its output length",
    )
    w.add_argument(
        "--logit-bias-eos",
        action="store_true",
        help="send logit_bias -100 on the tokenizer's special tokens (every end-of-generation "
        "id) instead of min_tokens: what keeps llama-cpp-python's server from stopping early",
    )
    w.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra fields merged into every request body, e.g. '{\"repeat_penalty\": 1.0}'",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals (default inf: all at once)",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap of in-flight requests")
    load.add_argument(
        "--sweep-rates",
        type=parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="run once per request rate, same prompts each time (overrides --request-rate)",
    )
    load.add_argument("--slo-ttft-ms", type=float, default=None)
    load.add_argument("--slo-tpot-ms", type=float, default=None)

    o = parser.add_argument_group("output")
    o.add_argument(
        "--output-json",
        default=None,
        help="write the full result (config, summaries, per-request latencies) here",
    )
    o.add_argument("--plot-dir", default=None, help="write latency CDFs (and sweep plots) here")
    o.add_argument("--disable-tqdm", action="store_true")


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object, e.g. '{\"top_k\": 1}'")


# ---- prompts -------------------------------------------------------------------------------
def ordinary_vocab(tokenizer: Any) -> list[int]:
    """Token ids that are not added/special tokens and decode to whole characters alone."""
    added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    return [
        i for i in range(len(tokenizer)) if i not in added and "\ufffd" not in tokenizer.decode([i])
    ]


def special_token_ids(tokenizer: Any) -> list[int]:
    """EOS and every other special token: the ids --logit-bias-eos pushes down."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def fit_prompt(
    tokenizer: Any, ids: list[int], target: int, rng: random.Random, vocab: Sequence[int]
) -> tuple[str, int]:
    """Text that re-encodes to about `target` tokens, starting from random ids: decoding merges
    and splits tokens, so truncate or top up and re-decode until it holds (or stop trying).
    Returns (text, its token count)."""
    text = tokenizer.decode(ids)
    for _ in range(8):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target:
            return text, target
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + [rng.choice(vocab) for _ in range(target - len(enc))]
        text = tokenizer.decode(enc)
    return text, num_tokens(tokenizer, text)


def build_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int = 0,
    shared_prefix_len: int = 0,
) -> list[ServeRequest]:
    """Seeded random-token prompts (the same for every server under the same tokenizer), drawn
    in this order: input lengths, output lengths, the shared prefix, then each prompt's ids.
    With shared_prefix_len = L every prompt is the same L-token text followed by U[A, B] more."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    vocab = ordinary_vocab(tokenizer)
    input_lens = [rng.randint(*input_len_range) for _ in range(num_prompts)]
    output_lens = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    prefix = ""
    if shared_prefix_len > 0:
        ids = [rng.choice(vocab) for _ in range(shared_prefix_len)]
        prefix, _ = fit_prompt(tokenizer, ids, shared_prefix_len, rng, vocab)
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = [rng.choice(vocab) for _ in range(n_in)]
        text, _ = fit_prompt(tokenizer, ids, n_in, rng, vocab)
        prompt = prefix + text
        out.append(ServeRequest(prompt, num_tokens(tokenizer, prompt), n_out))
    return out


# ---- requests and the SSE stream -----------------------------------------------------------
@dataclass(frozen=True)
class RequestConfig:
    url: str
    endpoint: str
    model: str
    temperature: float
    ignore_eos: bool
    logit_bias: dict[str, float] | None
    extra_body: dict[str, Any] | None
    headers: dict[str, str]


def request_body(req: ServeRequest, cfg: RequestConfig, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.logit_bias:
        body["logit_bias"] = cfg.logit_bias
    elif cfg.ignore_eos:
        # Not with logit_bias: llama-cpp-python 0.3 then drops both (its logits-processor list
        # is replaced by list.extend's None), and its min_tokens bans only one of the EOG ids.
        body["min_tokens"] = max_tokens
    if cfg.extra_body:
        body.update(cfg.extra_body)
    return body


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A JSON chunk for `data: {...}`, DONE for `data: [DONE]`, None for anything else
    (blank separators, comments and pings, other SSE fields)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == DONE:
        return DONE
    if not data:
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None


def chunk_text(chunk: dict[str, Any]) -> str:
    """New text in a completions (choices[0].text) or chat (choices[0].delta.content) chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def finish_reason(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


async def send_request(
    client: httpx.AsyncClient, req: ServeRequest, cfg: RequestConfig, max_tokens: int | None = None
) -> RequestResult:
    """Stream one request; every text-carrying chunk is a token arrival."""
    n_out = req.output_len if max_tokens is None else max_tokens
    result = RequestResult(prompt_len=req.prompt_len, output_len=n_out)
    body = request_body(req, cfg, n_out)
    t0 = time.perf_counter()
    result.start = t0
    last = t0
    try:
        async with client.stream("POST", cfg.url, json=body, headers=cfg.headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event == DONE:
                    break
                assert isinstance(event, dict)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return result
                usage = event.get("usage")
                if usage:
                    result.usage_output_tokens = usage.get("completion_tokens")
                    result.usage_prompt_tokens = usage.get("prompt_tokens")
                timings = event.get("timings")
                if isinstance(timings, dict) and "predicted_n" in timings:
                    result.server_output_tokens = timings["predicted_n"]
                result.finish_reason = finish_reason(event) or result.finish_reason
                text = chunk_text(event)
                if text:
                    now = time.perf_counter()
                    if not result.chunks:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks.append(text)
        result.e2el = time.perf_counter() - t0
    except Exception as e:  # a load generator records failures and goes on
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    if not result.chunks:
        result.error = f"no text in the response (finish_reason {result.finish_reason})"
        return result
    result.success = True
    return result


# How a request's output tokens were counted, best first: the server's usage
# (stream_options.include_usage: pagoda, vLLM, llama.cpp's llama-server), llama-server's
# timings.predicted_n, else each streamed chunk re-tokenized on its own and summed (a chunk is
# one token in llama-cpp-python's stream unless several make up one UTF-8 character).
# Re-tokenizing the whole text is kept beside as a cross-check only: it undercounts, because a
# model's greedy output is often not the tokenizer's own split of that text (two tokens the
# tokenizer would merge into one), and tokens that decode to nothing vanish.
COUNT_SOURCES = ("usage", "server_timings", "chunks")


def count_output_tokens(results: Sequence[RequestResult], tokenizer: Any) -> None:
    """Each successful request's output_tokens and its source (COUNT_SOURCES), and the
    re-tokenized cross-check; after the run, so tokenizing never competes with the streams."""
    for r in results:
        if not r.success:
            continue
        r.retokenized_tokens = num_tokens(tokenizer, r.text)
        if r.usage_output_tokens is not None:
            r.output_tokens, r.output_tokens_source = int(r.usage_output_tokens), "usage"
        elif r.server_output_tokens is not None:
            r.output_tokens, r.output_tokens_source = int(r.server_output_tokens), "server_timings"
        else:
            r.output_tokens = sum(num_tokens(tokenizer, c) for c in r.chunks)
            r.output_tokens_source = "chunks"
        if r.usage_prompt_tokens is not None:
            r.prompt_len = int(r.usage_prompt_tokens)


# ---- load ----------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at `rate` requests/s (the first
    request at 0); all zero for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


def http_client() -> httpx.AsyncClient:
    import httpx

    # No pool cap (the benchmark's own semaphore is the only throttle); hour-long timeouts.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0), trust_env=False)


async def run_load(
    requests: Sequence[ServeRequest],
    cfg: RequestConfig,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    disable_tqdm: bool = False,
) -> tuple[list[RequestResult], float]:
    """All requests at their arrival times, at most max_concurrency in flight; time spent waiting
    for a slot is not latency (it is not the server's). Returns (results, duration_s)."""
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    times = arrival_times(len(requests), rate, seed)
    desc = f"rate {rate:g}" + (f", concurrency {max_concurrency}" if max_concurrency else "")
    pbar = tqdm(total=len(requests), desc=desc, disable=disable_tqdm)
    async with http_client() as client:
        start = time.perf_counter()

        async def one(req: ServeRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if sem is None:
                result = await send_request(client, req, cfg)
            else:
                async with sem:
                    result = await send_request(client, req, cfg)
            result.start -= start
            pbar.update(1)
            return result

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times)))
        duration = time.perf_counter() - start
    pbar.close()
    return list(results), duration


# ---- summary -------------------------------------------------------------------------------
def tpot(e2el: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (n - 1); None for n <= 1."""
    if output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in ms (numpy's linear percentiles, as vLLM); None without data."""
    import numpy as np

    keys = ["mean"] + ["median" if p == 50 else f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = [float(ms.mean())] + [float(np.percentile(ms, p)) for p in PERCENTILES]
    return {k: round(v, 3) for k, v in zip(keys, stats)}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.success:
        return False
    if slo_ttft_ms is not None and r.ttft * 1000.0 > slo_ttft_ms:
        return False
    t = r.tpot
    return slo_tpot_ms is None or t is None or t * 1000.0 <= slo_tpot_ms


def goodput(
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> float | None:
    """Requests/s that met every given SLO; None when no SLO is given."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
    return round(good / duration_s, 4)


def metric_values(results: Sequence[RequestResult], metric: str) -> list[float]:
    """Seconds per successful request (ITL: every gap of every request)."""
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "tpot":
        return [t for t in (r.tpot for r in ok) if t is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    if metric == "e2el":
        return [r.e2el for r in ok]
    raise ValueError(f"unknown metric {metric!r}; one of {METRICS}")


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """vLLM's `bench serve` summary keys: *_throughput, {mean,median,p90,p99}_{metric}_ms."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration_s": round(duration_s, 4),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": round(len(ok) / duration_s, 4),
        "request_goodput": goodput(results, duration_s, slo_ttft_ms, slo_tpot_ms),
        "output_throughput": round(n_out / duration_s, 3),
        "total_token_throughput": round((n_in + n_out) / duration_s, 3),
    }
    for metric in METRICS:
        for stat, value in latency_stats(metric_values(results, metric)).items():
            summary[f"{stat}_{metric}_ms"] = value
    # How the output tokens were counted, and the cross-checks: the tokens asked for, the whole
    # texts re-tokenized, and requests that finished at their length ("length") with a count
    # other than what they asked for (a count that is wrong, or a server that stopped at its
    # context length).
    summary["output_tokens_source"] = {
        s: n for s in COUNT_SOURCES if (n := sum(r.output_tokens_source == s for r in ok))
    }
    summary["total_output_tokens_asked"] = sum(r.output_len for r in ok)
    summary["total_output_tokens_retokenized"] = sum(r.retokenized_tokens for r in ok)
    summary["length_count_mismatches"] = sum(
        r.finish_reason == "length" and r.output_tokens != r.output_len for r in ok
    )
    # Requests that ended for another reason than their length: with --ignore-eos, a server that
    # stopped at EOS anyway (it would look faster than it is).
    summary["early_stops"] = sum(r.finish_reason not in (None, "length") for r in ok)
    errors = sorted({r.error for r in results if not r.success})
    summary["errors"] = errors[:5]
    return summary


def request_records(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request latencies in ms for the CDFs (compact: rounded to 0.01 ms)."""

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000.0, 2)

    return [
        {
            "success": r.success,
            "error": r.error or None,
            "start_s": round(r.start, 4),
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "output_tokens": r.output_tokens,
            "output_tokens_source": r.output_tokens_source or None,
            "retokenized_tokens": r.retokenized_tokens if r.success else None,
            "num_chunks": len(r.chunks),
            "finish_reason": r.finish_reason,
            "ttft_ms": ms(r.ttft) if r.success else None,
            "tpot_ms": ms(r.tpot) if r.success else None,
            "e2el_ms": ms(r.e2el) if r.success else None,
            "itl_ms": [ms(g) for g in r.itl],
        }
        for r in results
    ]


# ---- plots ---------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def record_values(records: Sequence[dict[str, Any]], metric: str) -> list[float]:
    """ms values of a metric from request_records() (the JSON), successful requests only."""
    ok = [r for r in records if r["success"]]
    if metric == "itl":
        return [g for r in ok for g in r["itl_ms"] if g is not None]
    return [r[f"{metric}_ms"] for r in ok if r[f"{metric}_ms"] is not None]


def plot_cdfs(series: Mapping[str, Sequence[dict[str, Any]]], path: str, title: str = "") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E), one curve per series (a rate, a system)."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, metric in zip(axes.flat, METRICS):
        for name, records in series.items():
            values = np.sort(np.asarray(record_values(records, metric)))
            if values.size:
                ax.step(
                    values, np.arange(1, values.size + 1) / values.size, where="post", label=name
                )
        ax.set_xlabel(f"{METRIC_TITLES[metric]} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_sweep(series: Mapping[str, Sequence[dict[str, Any]]], path: str, title: str = "") -> None:
    """Output throughput, P99 TTFT and P99 TPOT against request rate, one line per series of
    summaries (each with its request_rate; inf rates are left out)."""
    plt = _pyplot()
    panels = [
        ("output_throughput", "output tokens/s"),
        ("p99_ttft_ms", "P99 TTFT (ms)"),
        ("p99_tpot_ms", "P99 TPOT (ms)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, ylabel) in zip(axes, panels):
        for name, summaries in series.items():
            points = [
                (s["request_rate"], s[key])
                for s in summaries
                if math.isfinite(s["request_rate"]) and s.get(key) is not None
            ]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "rate sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---- main ----------------------------------------------------------------------------------
def load_bench_tokenizer(path: str | None) -> Any:
    from pagoda.loading.model_files import resolve_model
    from pagoda.loading.tokenizer import load_tokenizer

    folder, gguf = resolve_model(path)
    return load_tokenizer(folder, gguf)


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def first_model_id(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    resp = httpx.get(url, headers=headers, timeout=30.0, trust_env=False)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"GET {url} lists no model; pass --model")
    return str(data[0]["id"])


def request_config(args: argparse.Namespace, model: str, tokenizer: Any) -> RequestConfig:
    headers = auth_headers(args.api_key)
    bias = None
    if args.logit_bias_eos:
        bias = {str(i): -100.0 for i in special_token_ids(tokenizer)}
    return RequestConfig(
        url=args.base_url.rstrip("/") + args.endpoint,
        endpoint=args.endpoint,
        model=model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        logit_bias=bias,
        extra_body=args.extra_body,
        headers=headers,
    )


def run_config(
    args: argparse.Namespace, cfg: RequestConfig, requests: list[ServeRequest]
) -> dict[str, Any]:
    return {
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": cfg.model,
        "num_prompts": len(requests),
        "input_len_range": list(args.input_len_range),
        "output_len_range": list(args.output_len_range),
        "shared_prefix_len": args.shared_prefix_len,
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "logit_bias_eos": args.logit_bias_eos,
        "extra_body": args.extra_body,
        "max_concurrency": args.max_concurrency,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "num_prompt_tokens": sum(r.prompt_len for r in requests),
        "num_output_tokens_asked": sum(r.output_len for r in requests),
    }


def rate_key(rate: float) -> float | str:
    """JSON has no inf: an infinite rate is written "inf"."""
    return "inf" if math.isinf(rate) else rate


def rate_label(rate: float | str) -> str:
    return f"{float(rate):g} req/s"


def check_server(requests: list[ServeRequest], cfg: RequestConfig) -> RequestResult:
    """One short request before the timed runs: checks the setup and warms the server."""

    async def go() -> RequestResult:
        async with http_client() as client:
            return await send_request(client, requests[0], cfg, max_tokens=4)

    return asyncio.run(go())


def run_rate(
    args: argparse.Namespace,
    tokenizer: Any,
    requests: list[ServeRequest],
    cfg: RequestConfig,
    rate: float,
) -> dict[str, Any]:
    """One timed run: {"summary": ..., "requests": per-request records}."""
    results, duration = asyncio.run(
        run_load(requests, cfg, rate, args.max_concurrency, args.seed, args.disable_tqdm)
    )
    count_output_tokens(results, tokenizer)
    summary = {
        "request_rate": rate_key(rate),
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms),
    }
    return {"summary": summary, "requests": request_records(results)}


def main(args: argparse.Namespace) -> int:
    check_args(args)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    headers = auth_headers(args.api_key)
    try:
        model = args.model or first_model_id(args.base_url, headers)
    except Exception as e:
        log(f"error: cannot list models at {args.base_url} ({e}); is the server up?")
        return 1
    cfg = request_config(args, model, tokenizer)
    requests = build_requests(
        tokenizer,
        args.num_prompts,
        args.input_len_range,
        args.output_len_range,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
    )
    check = check_server(requests, cfg)
    if not check.success:
        log(f"error: the test request to {cfg.url} failed: {check.error}")
        return 1
    runs = [
        run_rate(args, tokenizer, requests, cfg, rate)
        for rate in (args.sweep_rates or [args.request_rate])
    ]
    config = run_config(args, cfg, requests)
    head: dict[str, Any] = {
        "bench": NAME,
        "label": args.label,
        "model": model,
        "endpoint": args.endpoint,
    }
    if args.sweep_rates:
        line = {**head, "sweep": [r["summary"] for r in runs]}
    else:
        line = {**head, **runs[0]["summary"]}
    emit(line, None)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"bench": NAME, "config": config, "runs": runs}, f)
            f.write("\n")
    if args.plot_dir:
        write_plots(runs, args.plot_dir, args.label or model, bool(args.sweep_rates))
    return 0


def write_plots(runs: list[dict[str, Any]], plot_dir: str, name: str, sweep: bool) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    series = {rate_label(r["summary"]["request_rate"]): r["requests"] for r in runs}
    paths = [os.path.join(plot_dir, "latency_cdf.png")]
    plot_cdfs(series, paths[0], f"{name}: latency CDFs")
    if sweep:
        summaries = [
            {**r["summary"], "request_rate": float(r["summary"]["request_rate"])} for r in runs
        ]
        paths.append(os.path.join(plot_dir, "sweep.png"))
        plot_sweep({name: summaries}, paths[1], f"{name}: rate sweep")
    return paths


if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="pagoda bench serve", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
