"""`pagoda bench serve` plots (matplotlib, Agg): latency CDFs per series of request records,
and throughput / P99 latencies against request rate for a sweep."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.bench.serve_stats import METRICS

METRIC_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


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


def plot_plan(result: Mapping[str, Any], path: str) -> None:
    """`pagoda plan`'s goodput curve: throughput and goodput against the offered rate (the rate
    chosen marked), P99 TTFT against rate with its SLO, and P99 TPOT against the batch size
    with its SLO (the batch chosen marked)."""
    plt = _pyplot()
    slo = result["slo"]
    rates = [r for r in result["rate_sweep"] if r["request_rate"] != "inf"]
    xs = [float(r["request_rate"]) for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(xs, [r["request_throughput"] for r in rates], marker="o", label="throughput")
    ax.plot(xs, [r["request_goodput"] for r in rates], marker="s", label="goodput (within SLOs)")
    ax.plot(xs, xs, ls=":", color="gray", label="offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax = axes[1]
    ax.plot(xs, [r["p99_ttft_ms"] for r in rates], marker="o")
    ax.axhline(slo["p99_ttft_ms"], color="red", ls="--", label="SLO")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("P99 TTFT (ms)")
    if result["max_request_rate"] is not None:
        for a in axes[:2]:
            a.axvline(float(result["max_request_rate"]), color="green", ls="--", label="chosen")
    ax = axes[2]
    batches = result["batch_sweep"]
    ax.plot(
        [b["max_concurrency"] for b in batches], [b["p99_tpot_ms"] for b in batches], marker="o"
    )
    ax.axhline(slo["p99_tpot_ms"], color="red", ls="--", label="SLO")
    if result["max_num_seqs"] is not None:
        ax.axvline(result["max_num_seqs"], color="green", ls="--", label="chosen")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("P99 TPOT (ms)")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"{result.get('label') or result['model']}: capacity plan")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
