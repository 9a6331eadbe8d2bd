"""Prometheus metrics: vLLM's names with the pagoda: prefix, fed from engine stats and outputs."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagoda.client.output_processor import RequestState
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineCoreOutput, SchedulerStats
from pagoda.server.metrics import Metrics

NAMES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
)


def _samples(m: Metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


def test_every_metric_is_exported_under_its_vllm_name() -> None:
    families = {f.name for f in text_string_to_metric_families(Metrics("m").render().decode())}
    assert {f"pagoda:{n}" for n in NAMES} <= families


def test_engine_stats_set_gauges_and_advance_counters_by_deltas() -> None:
    m = Metrics("m")
    m.set_engine_stats(SchedulerStats(3, 2, 0.5, 100, 40, 1))
    m.set_engine_stats(SchedulerStats(1, 0, 0.25, 150, 60, 1))
    s = _samples(m)
    assert s["pagoda:num_requests_running"] == 1 and s["pagoda:num_requests_waiting"] == 0
    assert s["pagoda:kv_cache_usage_perc"] == 0.25
    assert s["pagoda:prefix_cache_queries_total"] == 150
    assert s["pagoda:prefix_cache_hits_total"] == 60
    assert s["pagoda:num_preemptions_total"] == 1


def test_request_latencies_and_tokens() -> None:
    m = Metrics("m")
    state = RequestState(
        "r", None, [1, 2, 3], SamplingParams(max_tokens=2), None, arrival_time=10.0
    )
    out = EngineCoreOutput("r", [7], [], [], first_scheduled_time=10.5, parent_id="r")
    state.add(out)
    m.observe_tokens(state, 1, None, 11.0)
    state.add(EngineCoreOutput("r", [8], [], [], finish_reason="length", parent_id="r"))
    m.observe_tokens(state, 1, 11.0, 11.25)
    state.metrics.finished_time = 11.25
    m.observe_finished(state)
    s = _samples(m)
    assert s["pagoda:time_to_first_token_seconds_sum"] == 1.0
    assert s["pagoda:inter_token_latency_seconds_sum"] == 0.25
    assert s["pagoda:e2e_request_latency_seconds_sum"] == 1.25
    assert s["pagoda:request_queue_time_seconds_sum"] == 0.5
    assert s["pagoda:prompt_tokens_total"] == 3 and s["pagoda:generation_tokens_total"] == 2
    assert s["pagoda:request_success_total[length]"] == 1
    assert s["pagoda:request_success_total[stop]"] == 0
    line = m.stats_line()
    assert line is not None and "Avg generation throughput: " in line
    assert m.stats_line() is None  # idle since the last line


def _labelled(m: Metrics, name: str, label: str) -> dict[str, float]:
    """Samples of `name` by the value of `label`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[s.labels[label]] = s.value
    return out


def test_kv_transfer_and_rank_counters_advance_by_deltas() -> None:
    """Disaggregation's pagoda:kv_transfer_* and the parallel ranks' step counters follow the
    engine's running totals."""
    m = Metrics("m")
    kv = {"fetches": 2, "fetch_failures": 1, "bytes_received": 1000, "blocks_received": 4}
    m.set_engine_stats(
        SchedulerStats(0, 0, 0.0, 0, 0, 0, kv_transfer=kv, rank_steps=[5, 5],
                       rank_step_seconds=[0.5, 0.25])
    )  # fmt: skip
    kv2 = {**kv, "fetches": 3, "bytes_received": 1500, "bytes_sent": 700}
    m.set_engine_stats(
        SchedulerStats(0, 0, 0.0, 0, 0, 0, kv_transfer=kv2, rank_steps=[8, 8],
                       rank_step_seconds=[0.75, 0.5])
    )  # fmt: skip
    assert _labelled(m, "pagoda:kv_transfer_bytes_total", "direction") == {
        "received": 1500,
        "sent": 700,
    }
    fetches = _labelled(m, "pagoda:kv_transfer_fetches_total", "outcome")
    assert fetches == {"asked": 3, "failed": 1}
    assert _labelled(m, "pagoda:rank_steps_total", "rank") == {"0": 8, "1": 8}
    assert _labelled(m, "pagoda:rank_step_seconds_total", "rank") == {"0": 0.75, "1": 0.5}
