"""`pagoda plan`: capacity planning from the goodput curve, against a running OpenAI-compatible
server (or one it starts with --serve-args), with `bench serve`'s load generator.

Every run (and each test request) sends prompts of a seed of its own, never prompts the server
has cached. The choices keep the P99s within (1 - --slo-margin) x the SLOs, since a P99 of tens
of requests varies from run to run; the check holds the full SLOs.

1. Batch size: prompts at saturation with at most c requests in flight, for each c of
   --concurrencies. The server then runs batches of at most c, so the largest c whose P99 TPOT
   meets its SLO (and every smaller c's) is the largest `--max-num-seqs` that keeps decode
   inside it.
2. Rate: Poisson arrivals at each rate of --rates (default: fractions of the request throughput
   measured at that batch size), against the server running that `--max-num-seqs` (with
   --serve-args it is restarted with it; a server at --base-url is used as it runs). Each run
   sends at least --min-run-seconds of arrivals, so P99 is measured in a steady state. While
   the highest rate is still inside the SLOs the sweep goes on by 1.25x steps
   (--max-extra-rates). The highest rate whose P99 TTFT and P99 TPOT, and every lower rate's,
   meet their SLOs with no failed request is the rate one server sustains.
3. Cost per 1K output tokens = --price-per-hour / 3600 / (output tokens/s at that rate) * 1000;
   replicas for --target-rate = ceil(target / that rate).
4. Check (unless --no-check): fresh prompts at that rate and at 1.5x it, the first expected
   inside the SLOs and the second outside.

Prints one JSON line (and --output-json), and draws the goodput curve (--plot PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import shlex
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pagoda.bench import serve
from pagoda.bench.common import emit, log, started_server, write_json
from pagoda.bench.serve_client import count_output_tokens, first_model_id
from pagoda.bench.serve_prompts import ServeRequest, load_bench_tokenizer
from pagoda.bench.serve_stats import summarize

NAME = "plan"
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)
DEFAULT_RATE_FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.2)
CHECK_FACTOR = 1.5
EXTRA_RATE_STEP = 1.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve._server_arguments(parser)
    serve._workload_arguments(parser)
    p = parser.add_argument_group("plan")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="P99 TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="P99 TPOT SLO")
    p.add_argument(
        "--slo-margin",
        type=float,
        default=0.1,
        help="the plan's choices keep their P99s within (1 - this) x the SLOs: a P99 of tens "
        "of requests varies from run to run, and the check holds the full SLOs",
    )
    p.add_argument("--price-per-hour", type=float, default=None, help="the machine's price")
    p.add_argument("--target-rate", type=float, default=None, help="req/s the service must take")
    p.add_argument(
        "--concurrencies",
        type=_positive_ints,
        default=DEFAULT_CONCURRENCIES,
        metavar="C1,C2,...",
        help="batch sizes to try (requests in flight)",
    )
    p.add_argument(
        "--rates",
        type=serve.parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="request rates to sweep (default: fractions of the measured throughput)",
    )
    p.add_argument(
        "--min-run-seconds",
        type=float,
        default=30.0,
        help="each rate run sends at least rate x this many requests (and --num-prompts)",
    )
    p.add_argument(
        "--max-extra-rates",
        type=int,
        default=4,
        help="rates added by 1.25x steps while the highest one is still inside the SLOs",
    )
    p.add_argument("--no-check", action="store_true", help="skip the run at the rate and 1.5x")
    p.add_argument(
        "--serve-args",
        default=None,
        metavar="ARGS",
        help="start `pagoda serve ARGS` on a free port for the plan (instead of --base-url)",
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="write the goodput curve here")
    p.add_argument("--disable-tqdm", action="store_true")
    # bench serve's checks and workload record read these; a plan sets its own rates.
    parser.set_defaults(request_rate=1.0, max_concurrency=None)


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected C1,C2,... (integers), got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return tuple(sorted(set(values)))


# ---- decisions (pure) ----------------------------------------------------------------------
def within_slo(summary: dict[str, Any], slo_ttft_ms: float | None, slo_tpot_ms: float) -> bool:
    """No failed request, P99 TPOT within its SLO, and P99 TTFT within its SLO if given."""
    if summary["failed"] or summary["completed"] == 0:
        return False
    tpot = summary["p99_tpot_ms"]
    if tpot is not None and tpot > slo_tpot_ms:
        return False
    return slo_ttft_ms is None or summary["p99_ttft_ms"] <= slo_ttft_ms


def largest_within(
    runs: Sequence[dict[str, Any]], key: str, slo_ttft_ms: float | None, slo_tpot_ms: float
) -> dict[str, Any] | None:
    """The run with the largest `key` such that it and every run with a smaller `key` are within
    the SLOs (a lucky pass above a miss is noise, not capacity); None if the smallest misses."""
    best = None
    for r in sorted(runs, key=lambda r: float(r[key])):
        if not within_slo(r, slo_ttft_ms, slo_tpot_ms):
            break
        best = r
    return best


def cost_per_1k_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        raise ValueError(f"tokens/s must be > 0, got {tokens_per_s}")
    return price_per_hour / 3600.0 / tokens_per_s * 1000.0


def replicas_for(target_rate: float, rate_per_replica: float) -> int:
    if rate_per_replica <= 0:
        raise ValueError(f"the rate per replica must be > 0, got {rate_per_replica}")
    return max(1, math.ceil(target_rate / rate_per_replica - 1e-9))


# ---- runs ----------------------------------------------------------------------------------
def _run(
    args: argparse.Namespace,
    requests: list[ServeRequest],
    cfg: Any,
    tokenizer: Any,
    rate: float,
    concurrency: int | None,
) -> dict[str, Any]:
    results, duration = asyncio.run(
        serve.run_load(requests, cfg, rate, concurrency, args.seed, args.disable_tqdm)
    )
    count_output_tokens(results, tokenizer)
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    return {"request_rate": serve.rate_key(rate), "max_concurrency": concurrency, **summary}


def planned_slo(slo: tuple[float, float], margin: float) -> tuple[float, float]:
    """The (TTFT, TPOT) P99 bounds the plan's choices keep: (1 - margin) x the SLOs."""
    if not 0 <= margin < 1:
        raise ValueError(f"--slo-margin must be in [0, 1), got {margin}")
    return slo[0] * (1 - margin), slo[1] * (1 - margin)


def prompts_for_rate(num_prompts: int, rate: float, min_run_seconds: float) -> int:
    """Requests a rate run sends: --num-prompts, and at least rate x --min-run-seconds."""
    return max(num_prompts, math.ceil(rate * min_run_seconds - 1e-9))


def next_rate(runs: Sequence[dict[str, Any]], slo: tuple[float, float]) -> float | None:
    """The rate to add to a sweep whose highest rate is still within the SLOs (1.25x it), or
    None once the highest rate misses."""
    top = max(runs, key=lambda r: float(r["request_rate"]))
    if not within_slo(top, *slo):
        return None
    return round(float(top["request_rate"]) * EXTRA_RATE_STEP, 4)


ServerAt = Callable[[int | None], contextlib.AbstractContextManager[str]]


def server_at(args: argparse.Namespace) -> ServerAt:
    """For a phase of the plan: the URL of a server running `--max-num-seqs n` (None: as
    configured). With --serve-args a server is started for the phase; a --base-url server is
    used as it runs, whatever its --max-num-seqs."""

    @contextlib.contextmanager
    def at(max_num_seqs: int | None) -> Iterator[str]:
        if args.serve_args is None:
            if max_num_seqs is not None:
                log(f"plan: the server at {args.base_url} should run --max-num-seqs {max_num_seqs}")
            yield args.base_url
            return
        extra = [] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]
        with started_server([*shlex.split(args.serve_args), *extra]) as server:
            yield server.url

    return at


def plan(args: argparse.Namespace, server: ServerAt) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    planned = planned_slo(slo, args.slo_margin)

    def prompts(seed: int, n: int = args.num_prompts) -> list[ServeRequest]:
        return serve.workload_prompts(args, tokenizer, seed, n)

    # Every run sends prompts of its own seed: a run of prompts the server has seen before
    # would measure its prefix cache, not its capacity.
    seeds = itertools.count(args.seed)

    def fresh(n: int = args.num_prompts) -> list[ServeRequest]:
        return prompts(next(seeds), n)

    def at_rate(rate: float, cfg: Any) -> dict[str, Any]:
        n = prompts_for_rate(args.num_prompts, rate, args.min_run_seconds)
        log(f"plan: rate {rate:g} req/s, {n} requests")
        return _run(args, fresh(n), cfg, tokenizer, rate, None)

    with server(None) as url:
        cfg, model = _connect(args, url, tokenizer, fresh(1))
        batch_runs = []
        for c in args.concurrencies:
            log(f"plan: batch {c}")
            batch_runs.append(_run(args, fresh(), cfg, tokenizer, math.inf, c))
    # The batch choice bounds TPOT only: at saturation TTFT is queueing, which the rate sets.
    batch = largest_within(batch_runs, "max_concurrency", None, planned[1])
    saturated = batch or batch_runs[0]
    rates = args.rates or [
        round(f * saturated["request_throughput"], 4) for f in DEFAULT_RATE_FRACTIONS
    ]
    batch_size = batch["max_concurrency"] if batch else None
    with server(batch_size) as url:
        cfg, _ = _connect(args, url, tokenizer, fresh(1))
        rate_runs = _sweep_rates(
            rates, lambda rate: at_rate(rate, cfg), args.max_extra_rates, planned
        )
        best = largest_within(rate_runs, "request_rate", *planned)
        checks: list[dict[str, Any]] = []
        if best is not None and not args.no_check:
            checks = _check_runs(best["request_rate"], lambda rate: at_rate(rate, cfg), slo)
    workload = serve.run_config(args, cfg, prompts(args.seed))
    return {
        **_decisions(args, model, workload, batch_size, best),
        "batch_sweep": batch_runs,
        "rate_sweep": rate_runs,
        "check": checks,
    }


def _sweep_rates(
    rates: Sequence[float],
    run_at: Callable[[float], dict[str, Any]],
    max_extra_rates: int,
    planned: tuple[float, float],
) -> list[dict[str, Any]]:
    """A run at each rate, then at 1.25x steps while the highest is still within `planned`."""
    runs = [run_at(rate) for rate in rates]
    for _ in range(max_extra_rates):
        extra = next_rate(runs, planned)
        if extra is None:
            break
        runs.append(run_at(extra))
    return runs


def _check_runs(
    rate: float, run_at: Callable[[float], dict[str, Any]], slo: tuple[float, float]
) -> list[dict[str, Any]]:
    """Fresh runs at the planned rate and at 1.5x it, each marked within the full SLOs or not."""
    checks = []
    for factor in (1.0, CHECK_FACTOR):
        run = run_at(round(rate * factor, 4))
        run["factor"] = factor
        run["within_slo"] = within_slo(run, *slo)
        checks.append(run)
    return checks


def _decisions(
    args: argparse.Namespace,
    model: str,
    workload: dict[str, Any],
    batch_size: int | None,
    best: dict[str, Any] | None,
) -> dict[str, Any]:
    """The plan's record without its runs: the SLOs, the workload and the decisions."""
    result: dict[str, Any] = {
        "bench": NAME,
        "label": args.label,
        "model": model,
        "slo": {"p99_ttft_ms": args.slo_ttft_ms, "p99_tpot_ms": args.slo_tpot_ms},
        "slo_margin": args.slo_margin,
        "workload": workload,
        "min_run_seconds": args.min_run_seconds,
        "rate_sweep_server": "restarted with --max-num-seqs max_num_seqs"
        if args.serve_args is not None
        else "the --base-url server as it runs",
        "max_num_seqs": batch_size,
        "max_request_rate": best["request_rate"] if best else None,
        "output_tokens_per_s_at_max_rate": best["output_throughput"] if best else None,
        "price_per_hour": args.price_per_hour,
        "cost_per_1k_output_tokens": None,
        "target_rate": args.target_rate,
        "replicas_for_target_rate": None,
    }
    if best is not None:
        if args.price_per_hour is not None:
            result["cost_per_1k_output_tokens"] = round(
                cost_per_1k_tokens(args.price_per_hour, best["output_throughput"]), 6
            )
        if args.target_rate is not None:
            result["replicas_for_target_rate"] = replicas_for(
                args.target_rate, best["request_rate"]
            )
    return result


def _connect(
    args: argparse.Namespace, url: str, tokenizer: Any, requests: list[ServeRequest]
) -> tuple[Any, str]:
    """The request config for the server at `url`, after a test request (requests[0])
    succeeded."""
    args.base_url = url
    model = args.model or first_model_id(url, serve.auth_headers(args.api_key))
    cfg = serve.request_config(args, model, tokenizer)
    check = serve.check_server(requests, cfg)
    if not check.success:
        raise RuntimeError(f"the test request to {cfg.url} failed: {check.error}")
    return cfg, model


def main(args: argparse.Namespace) -> int:
    serve.check_args(args)
    if args.min_run_seconds < 0 or args.max_extra_rates < 0:
        raise ValueError("--min-run-seconds and --max-extra-rates must be >= 0")
    planned_slo((args.slo_ttft_ms, args.slo_tpot_ms), args.slo_margin)  # checks the margin
    result = plan(args, server_at(args))
    emit(headline(result), None)
    if args.output_json:
        write_json(result, args.output_json)
    if args.plot:
        from pagoda.bench.serve_plots import plot_plan

        plot_plan(result, args.plot)
    return 0 if result["max_request_rate"] is not None else 1


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The printed line: the decisions, and each check's rate, P99s and verdict."""
    keys = ("request_rate", "p99_ttft_ms", "p99_tpot_ms", "within_slo")
    line = {k: v for k, v in result.items() if k not in ("batch_sweep", "rate_sweep", "workload")}
    line["check"] = [{k: run[k] for k in keys} for run in result["check"]]
    return line
