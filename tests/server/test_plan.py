"""`pagoda plan` end to end on the tiny Llama: it starts its own `pagoda serve`, sweeps batch
sizes and rates, and writes its JSON and the goodput curve's PNG; its decisions agree with its
own sweeps (the checks of each decision are tests/unit/test_plan_decisions.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagoda.bench.plan import within_slo


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
    assert [b["max_concurrency"] for b in result["batch_sweep"]] == [1, 4]
    # 8 req/s was inside the SLOs, so the sweep went on to 1.25x it (one extra rate allowed).
    assert [r["request_rate"] for r in result["rate_sweep"]] == [8.0, 10.0]
    # A run sends rate x --min-run-seconds requests, and at least --num-prompts.
    assert [r["completed"] for r in result["rate_sweep"]] == [8, 10]
    slo = (5000.0, 1000.0)
    # The SLOs are loose enough for every run: the largest of each sweep is chosen.
    assert all(within_slo(r, *slo) for r in result["rate_sweep"])
    assert line["max_num_seqs"] == result["max_num_seqs"] == 4
    assert line["max_request_rate"] == 10.0
    best = result["rate_sweep"][1]
    assert line["output_tokens_per_s_at_max_rate"] == best["output_throughput"] > 0
    assert line["cost_per_1k_output_tokens"] == round(
        2.0 / 3600 / best["output_throughput"] * 1000, 6
    )
    assert line["replicas_for_target_rate"] == 2
    assert [c["request_rate"] for c in line["check"]] == [10.0, 15.0]
    assert [c["completed"] for c in result["check"]] == [10, 15]
