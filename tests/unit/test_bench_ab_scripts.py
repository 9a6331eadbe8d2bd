"""The in-process A/B benchmarks run from a checkout: benchmarks/attention_ab.py builds another
commit's paged attention beside this tree's and finds the same bits (HEAD against itself here),
and benchmarks/gated_silu_ab.py runs the embedded SmolLM2's burst with the gate | up projection's
SiLU in its own call and without, the same first tokens, and benchmarks/decode_guards.py
compiles its two engines' batch >= 2 graphs with and without the module guards; and
benchmarks/before_after_summary.py's reading of before_after.sh's runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.kernels.cpu import built

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(script: str, args: list[str], out: Path) -> dict:
    assert built() is not None, "needs pagoda's CPU kernels built (a C++ compiler)"
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_attention_ab_builds_the_other_commit_and_compares_bits(tmp_path: Path) -> None:
    record = _run(
        "attention_ab.py",
        ["--before", "HEAD", "--rounds", "3", "--only", "smollm2 decode 1 x 256"],
        tmp_path / "ab.json",
    )
    rows = record["rows"]
    assert [r["case"] for r in rows] == ["smollm2 decode 1 x 256"] * len(rows)
    assert {r["isa"] for r in rows} == set(range(1, built().isa() + 1))
    assert all(r["bits_equal"] and r["before_over_after_median"] > 0 for r in rows)


def test_gated_silu_ab_gives_the_same_first_tokens(tmp_path: Path) -> None:
    record = _run(
        "gated_silu_ab.py", ["-O", "0", "--rounds", "2", "--prompts", "4"], tmp_path / "g.json"
    )
    assert record["first_tokens_equal"] is True
    assert len(record["rounds"]) == 2 and all(r["ratio"] > 0 for r in record["rounds"])


def test_decode_guards_compares_the_filtered_graph_with_the_unfiltered(tmp_path: Path) -> None:
    record = _run(
        "decode_guards.py",
        ["--rounds", "1", "--steps", "3", "--batches", "1,2"],
        tmp_path / "guards.json",
    )
    lines = record["guard_tree_lines"]
    assert lines["filtered"]["_decode_one"] == lines["unfiltered"]["_decode_one"]
    assert lines["filtered"]["_decode_many"] * 3 < lines["unfiltered"]["_decode_many"]
    for batch in ("1", "2"):
        summary = record["summary"][batch]
        assert summary["filtered"]["step_ms"] > 0 and summary["unfiltered"]["guard_ms"] > 0


def test_before_after_summary_reads_each_step_it_finds(tmp_path: Path) -> None:
    """before_after_summary.py: the best run of each side, their ratio and the median of the
    rounds' ratios, for the b1 runs at -O3 and the matmuls step's shapes; steps not run are left
    out."""

    def write(name: str, record: dict[str, object]) -> None:
        (tmp_path / name).write_text(json.dumps(record))

    for side, rates, gb_s in (("before", (80.0, 84.0), 12.0), ("after", (88.0, 84.0), 15.0)):
        for i, rate in enumerate(rates, 1):
            write(f"b1_O3_{side}_{i}.json", {"pagoda": {"decode_tok_s": rate}})
            shapes = [{"shape": s, "weight_gb_s_median": gb_s + i} for s in ("qkv", "down_q6k")]
            write(f"matmuls_{side}_{i}.json", {"shapes": shapes})
    script = ROOT / "benchmarks" / "before_after_summary.py"
    args = [sys.executable, str(script), str(tmp_path), "aaa", "bbb"]
    subprocess.run(args, check=True, capture_output=True)
    figures = json.loads((tmp_path / "summary.json").read_text())["figures"]
    assert set(figures) == {
        "b1_O3_decode_tok_s",
        "matmul_qkv_weights_gb_s",
        "matmul_down_q6k_weights_gb_s",
    }
    b1 = figures["b1_O3_decode_tok_s"]
    assert (b1["before"], b1["after"], b1["ratio_after_before"]) == (84.0, 88.0, round(88 / 84, 3))
    assert b1["median_round_ratio"] == round((88 / 80 + 84 / 84) / 2, 3)
    assert figures["matmul_qkv_weights_gb_s"]["ratio_after_before"] == round(17 / 14, 3)
