"""Prometheus metrics, named as vLLM names them with the `pagoda:` prefix, so dashboards carry over.

Latencies are observed in the API process as outputs arrive; gauges and engine counters come from
the engine stats (scheduling/messages.py, SchedulerStats) the client hands on with every message;
the server reads them through the EngineStats protocol, so it imports nothing of the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pagoda.client.output_processor import RequestState


class EngineStats(Protocol):
    """What the metrics read of the engine's stats (SchedulerStats has these fields)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def spec_num_drafts(self) -> int: ...
    @property
    def spec_num_draft_tokens(self) -> int: ...
    @property
    def spec_num_accepted_tokens(self) -> int: ...
    @property
    def spec_accepted_per_position(self) -> list[int]: ...
    @property
    def kv_transfer(self) -> dict[str, float]: ...
    @property
    def rank_steps(self) -> list[int]: ...
    @property
    def rank_step_seconds(self) -> list[float]: ...
    @property
    def running_lora_ids(self) -> list[int]: ...
    @property
    def waiting_lora_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class _NoStats:
    """The engine's stats before its first message: all zero."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    kv_transfer: dict[str, float] = field(default_factory=dict)
    rank_steps: list[int] = field(default_factory=list)
    rank_step_seconds: list[float] = field(default_factory=list)
    running_lora_ids: list[int] = field(default_factory=list)
    waiting_lora_ids: list[int] = field(default_factory=list)


# pagoda:kv_transfer_* (disaggregation): counter -> (KVTransferStats field, label value)
_KV_TRANSFER = {
    "kv_transfer_bytes": (("bytes_received", "received"), ("bytes_sent", "sent")),
    "kv_transfer_blocks": (("blocks_received", "received"), ("blocks_sent", "sent")),
    "kv_transfer_seconds": (("receive_seconds", "received"), ("send_seconds", "sent")),
    "kv_transfer_fetches": (
        ("fetches", "asked"),
        ("fetch_retries", "retried"),
        ("fetch_failures", "failed"),
        ("fetches_served", "served"),
    ),
}

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values

disable_created_metrics()  # no `_created` series, as in vLLM's exposition


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # Called with every finished request (the Ray Serve replica's SLO window listens).
        self.finished_listeners: list[Callable[[RequestState], None]] = []
        # /metrics lists the metrics in the order they are declared.
        self._declare_latencies()
        self._declare_engine_gauges()
        self._declare_token_counters()
        self._declare_spec_decode()
        self._declare_kv_transfer_and_ranks()
        success = self._counter(
            "request_success", "Finished requests (samples) by finish reason.", ("finished_reason",)
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._last_stats: EngineStats = _NoStats()
        self._prompt_total = 0  # mirrors of the token counters, for the log line
        self._generation_total = 0
        self._last_log = (time.monotonic(), 0, 0)
        self._lora: tuple[Gauge, int, Callable[[int], str]] | None = None  # serve_loras

    def serve_loras(self, max_loras: int, name_of: Callable[[int], str]) -> None:
        """--enable-lora: vLLM's lora_requests_info, a gauge whose labels name the adapters of
        the running and of the waiting requests (comma-separated) and whose value is the time
        they were read; `name_of` names an adapter id."""
        gauge = Gauge(
            "pagoda:lora_requests_info",
            "Running and waiting LoRA adapters (labels); the value is when they were read.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._lora = (gauge, max_loras, name_of)
        gauge.labels(str(max_loras), "", "").set(time.time())

    # ---- declarations: each metric has the model_name label first ----------------------------
    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            f"pagoda:{name}", doc, ["model_name"], registry=self.registry, buckets=buckets
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"pagoda:{name}", doc, ["model_name"], registry=self.registry)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(f"pagoda:{name}", doc, ["model_name", *extra], registry=self.registry)

    def _declare_latencies(self) -> None:
        name, hist = self.model_name, self._histogram
        self.ttft = hist(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        ).labels(name)
        self.itl = hist(
            "inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        ).labels(name)
        self.e2e = hist(
            "e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        ).labels(name)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", _LATENCY_BUCKETS
        ).labels(name)

    def _declare_engine_gauges(self) -> None:
        name = self.model_name
        self.running = self._gauge("num_requests_running", "Requests in the running batch.").labels(
            name
        )
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to run.").labels(name)
        self.kv_usage = self._gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."
        ).labels(name)

    def _declare_token_counters(self) -> None:
        name, counter = self.model_name, self._counter
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(name)
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(name)
        self.preemptions = counter("num_preemptions", "Preemptions in the engine.").labels(name)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(
            name
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(name)

    def _declare_spec_decode(self) -> None:
        # Speculative decoding (vLLM's names): verifications with drafts, draft tokens,
        # accepted drafts, and accepted drafts by position in the draft.
        name, counter = self.model_name, self._counter
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Requests' steps that verified draft tokens."
        ).labels(name)
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(name)
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(name)
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ("position",),
        )

    def _declare_kv_transfer_and_ranks(self) -> None:
        # Disaggregation: what a decode instance received and a prefill instance sent (bytes,
        # blocks, seconds), and fetches asked / retried / failed (computed locally) / served.
        self.kv_transfer = {
            name: self._counter(name, doc, (label,))
            for name, doc, label in (
                ("kv_transfer_bytes", "KV bytes transferred.", "direction"),
                ("kv_transfer_blocks", "KV blocks transferred.", "direction"),
                ("kv_transfer_seconds", "Seconds spent transferring KV.", "direction"),
                ("kv_transfer_fetches", "KV fetches by outcome.", "outcome"),
            )
        }
        # Tensor/pipeline-parallel ranks: steps and seconds in them, per rank.
        self.rank_steps = self._counter("rank_steps", "Steps a worker rank ran.", ("rank",))
        self.rank_step_seconds = self._counter(
            "rank_step_seconds", "Seconds a worker rank spent in steps.", ("rank",)
        )

    # ---- updates ---------------------------------------------------------------------------
    def set_engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.spec_drafts.inc(max(0, stats.spec_num_drafts - last.spec_num_drafts))
        self.spec_draft_tokens.inc(max(0, stats.spec_num_draft_tokens - last.spec_num_draft_tokens))
        self.spec_accepted.inc(
            max(0, stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
        )
        before = last.spec_accepted_per_position
        for pos, total in enumerate(stats.spec_accepted_per_position):
            new = total - (before[pos] if pos < len(before) else 0)
            if new > 0:
                self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(new)
        for name, fields in _KV_TRANSFER.items():
            for key, label in fields:
                delta = stats.kv_transfer.get(key, 0) - last.kv_transfer.get(key, 0)
                if delta > 0:
                    self.kv_transfer[name].labels(self.model_name, label).inc(delta)
        for rank, (steps, seconds) in enumerate(zip(stats.rank_steps, stats.rank_step_seconds)):
            old = rank < len(last.rank_steps)
            new_steps = steps - (last.rank_steps[rank] if old else 0)
            new_seconds = seconds - (last.rank_step_seconds[rank] if old else 0.0)
            if new_steps > 0:
                self.rank_steps.labels(self.model_name, str(rank)).inc(new_steps)
                self.rank_step_seconds.labels(self.model_name, str(rank)).inc(new_seconds)
        if self._lora is not None:
            gauge, max_loras, name_of = self._lora
            waiting = ",".join(name_of(i) for i in stats.waiting_lora_ids)
            running = ",".join(name_of(i) for i in stats.running_lora_ids)
            gauge.clear()  # one series: the adapters now
            gauge.labels(str(max_loras), waiting, running).set(time.time())
        self._last_stats = stats

    def observe_tokens(
        self, state: RequestState, num_new: int, previous_token_time: float | None, now: float
    ) -> None:
        """`num_new` tokens of `state` arrived at `now`; the one before came at
        `previous_token_time` (None: these are the request's first)."""
        if num_new == 0:
            return
        self.generation_tokens.inc(num_new)
        self._generation_total += num_new
        if previous_token_time is None:
            self.ttft.observe(now - state.metrics.arrival_time)
        else:
            self.itl.observe(now - previous_token_time)

    def observe_finished(self, state: RequestState) -> None:
        m = state.metrics
        end = m.finished_time or time.time()
        self.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        self.prompt_tokens.inc(len(state.prompt_token_ids))
        self._prompt_total += len(state.prompt_token_ids)
        for sample in state.samples:
            reason = sample.finish_reason if sample.finish_reason in self.success else "abort"
            self.success[reason].inc()
        for listener in self.finished_listeners:
            listener(state)

    # ---- reading ---------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict[str, float]:
        """Token totals since start, the queues and KV usage of the engine's last stats."""
        stats = self._last_stats
        return {
            "prompt_tokens_total": self._prompt_total,
            "generation_tokens_total": self._generation_total,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
        }

    def stats_line(self) -> str | None:
        """vLLM's periodic log line: throughputs since the last call, queues, KV usage; None
        when the server has been idle since the last call."""
        now = time.monotonic()
        prompt, gen = self._prompt_total, self._generation_total
        then, last_prompt, last_gen = self._last_log
        self._last_log = (now, prompt, gen)
        dt = max(now - then, 1e-9)
        stats = self._last_stats
        if prompt == last_prompt and gen == last_gen and not stats.num_running + stats.num_waiting:
            return None
        hit_rate = stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)
        return (
            f"Avg prompt throughput: {(prompt - last_prompt) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(gen - last_gen) / dt:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%" + _spec_line(stats)
        )


def _spec_line(stats: EngineStats) -> str:
    """The log line's speculative decoding part, as vLLM's SpecDecoding metrics line: totals
    since start; empty when nothing was drafted."""
    drafts, tokens = stats.spec_num_drafts, stats.spec_num_draft_tokens
    if not tokens:
        return ""
    accepted = stats.spec_num_accepted_tokens
    per_position = ", ".join(f"{n / drafts:.3f}" for n in stats.spec_accepted_per_position)
    return (
        f", SpecDecoding: draft acceptance rate {accepted / tokens * 100:.1f}%, "
        f"mean acceptance length {1 + accepted / drafts:.2f}, accepted {accepted} of {tokens} "
        f"draft tokens, per-position acceptance rate {per_position}"
    )
