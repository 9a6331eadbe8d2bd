"""`pagoda bench serve` results: latency percentiles (TTFT, TPOT, ITL, E2E), throughput and
goodput under SLOs, in vLLM's summary keys, and the per-request records of the JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.bench.serve_client import COUNT_SOURCES, RequestResult

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; e2el is end-to-end latency


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
