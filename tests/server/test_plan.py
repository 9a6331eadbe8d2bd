"""`pagoda plan` end to end on the tiny Llama: it starts its own `pagoda serve`, sweeps batch
sizes and rates, and writes its JSON and the goodput curve's PNG; its decisions agree with its
own sweeps, whatever the machine's load made of them (the checks of each decision are
tests/unit/test_plan_decisions.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagoda.bench.plan import (
    CHECK_FACTOR,
    largest_within,
    planned_slo,
    prompts_for_rate,
    replicas_for,
    within_slo,
)


def test_plan_on_a_server_it_starts(tiny_llama_dir: str, tmp_path: Path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    cmd = [
        sys.executable, "-m", "pagoda.cli", "plan",
        "--serve-args", f"{tiny_llama_dir} --num-gpu-blocks-override 512",
        "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000",
        "--price-per-hour", "2.0", "--target-rate", "20",
        "--num-prompts", "4", "--input-len-range", "16,32", "--output-len-range", "4,8",
        "--concurrencies", "1,4", "--rates", "8", "--min-run-seconds", "1",
        "--max-extra-rates", "1",
        "--output-json", str(out), "--plot", str(png), "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # Every decision follows from the plan's own runs, whichever of them the machine's load
    # put inside the SLOs (loose here: 5 s TTFT, 1 s TPOT, so on an idle machine all).
    assert [b["max_concurrency"] for b in result["batch_sweep"]] == [1, 4]
    planned = planned_slo((5000.0, 1000.0), result["slo_margin"])
    batch = largest_within(result["batch_sweep"], "max_concurrency", None, planned[1])
    assert result["max_num_seqs"] == line["max_num_seqs"] == (batch and batch["max_concurrency"])
    sweep = result["rate_sweep"]
    rates = [r["request_rate"] for r in sweep]
    # 8 req/s first; one extra rate (1.25x) only if 8 was inside the planned SLOs.
    assert rates == ([8.0, 10.0] if within_slo(sweep[0], *planned) else [8.0])
    # A run sends rate x --min-run-seconds requests, and at least --num-prompts; each ends.
    for run in [*sweep, *result["check"]]:
        sent = prompts_for_rate(4, run["request_rate"], 1.0)
        assert run["completed"] + run["failed"] == sent, run
    best = largest_within(sweep, "request_rate", *planned)
    assert line["max_request_rate"] == (best and best["request_rate"])
    if best is None:
        assert result["check"] == [] and line["cost_per_1k_output_tokens"] is None
        return
    assert line["output_tokens_per_s_at_max_rate"] == best["output_throughput"] > 0
    assert line["cost_per_1k_output_tokens"] == round(
        2.0 / 3600 / best["output_throughput"] * 1000, 6
    )
    assert line["replicas_for_target_rate"] == replicas_for(20.0, best["request_rate"])
    checked = [c["request_rate"] for c in line["check"]]
    assert checked == [best["request_rate"], round(best["request_rate"] * CHECK_FACTOR, 4)]
