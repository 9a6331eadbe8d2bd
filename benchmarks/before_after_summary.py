"""Summary of benchmarks/before_after.sh: best of the rounds per side, and after / before.

    python benchmarks/before_after_summary.py OUT_DIR BEFORE_COMMIT AFTER_COMMIT

Prints one JSON line and writes it to OUT_DIR/summary.json. Both sides run the same weights
(the embedded SmolLM2-135M Q4_1 GGUF, kept quantized; the matmuls step the 1.5B's shapes on
random codes), the same workloads and -O level, on this machine, alternately; higher is better
for every figure listed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

FIGURES = {  # name -> (file prefix, path into the JSON); a figure without runs is left out
    **{
        f"w_cpu_O{level}_output_tok_s": (f"w_cpu_O{level}", ("pagoda", "output_tok_s"))
        for level in (2, 3)
    },
    **{
        f"b1_O{level}_decode_tok_s": (f"b1_O{level}", ("pagoda", "decode_tok_s"))
        for level in (2, 3)
    },
    "host_w1_ceiling_tok_s": ("host", ("w1_host_ceiling_tok_s",)),
    "host_b1_ceiling_tok_s": ("host", ("b1_host_ceiling_tok_s",)),
}


def value(record: dict[str, Any], path: tuple[str, ...]) -> float:
    for key in path:
        record = record[key]
    return float(record)  # type: ignore[arg-type]


def matmul_rates(record: dict[str, Any]) -> dict[str, float]:
    """prefill_matmuls.py's GB/s of weights read, per shape (the "matmuls" step)."""
    return {s["shape"]: float(s["weight_gb_s_median"]) for s in record["shapes"]}


def runs(out: Path, prefix: str, side: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{prefix}_{side}_*.json"))]


def median_ratio(before: list[float], after: list[float]) -> float | None:
    """The median over rounds of after / before (round i's two runs ran back to back)."""
    ratios = sorted(a / b for b, a in zip(before, after))
    if not ratios:
        return None
    mid = len(ratios) // 2
    middle = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return round(middle, 3)


def figure(before: list[float], after: list[float]) -> dict[str, Any]:
    """Both sides' runs, the best of each, their ratio and the median of the rounds' ratios."""
    return {
        "before_runs": before,
        "after_runs": after,
        "before": max(before),
        "after": max(after),
        "ratio_after_before": round(max(after) / max(before), 3),
        "median_round_ratio": median_ratio(before, after),
    }


def main(out_dir: str, before: str, after: str) -> None:
    out = Path(out_dir)
    summary: dict[str, Any] = {
        "bench": "before_after",
        "before": before,
        "after": after,
        "like_with_like": "same weights (embedded SmolLM2-135M Q4_1 GGUF; the matmuls: the "
        "1.5B's shapes on random codes), workloads and -O level on both sides; runs alternate "
        "before / after on one machine; best of the rounds, and the median of each round's "
        "after / before",
        "cpu_count": os.cpu_count(),
        "figures": {},
    }
    sides = ("before", "after")
    for name, (prefix, path) in FIGURES.items():
        got = {side: [value(r, path) for r in runs(out, prefix, side)] for side in sides}
        if got["before"] and got["after"]:
            summary["figures"][name] = figure(got["before"], got["after"])
    rates = {side: [matmul_rates(r) for r in runs(out, "matmuls", side)] for side in sides}
    for shape in rates["after"][0] if rates["after"] and rates["before"] else ():
        got = {side: [r[shape] for r in rates[side]] for side in sides}
        summary["figures"][f"matmul_{shape}_weights_gb_s"] = figure(got["before"], got["after"])
    host_steps = {
        side: [r["w1_full_batch_ms_per_step"] for r in runs(out, "host", side)] for side in sides
    }
    if host_steps["before"]:
        summary["host_w1_ms_per_step"] = host_steps
    line = json.dumps(summary)
    (out / "summary.json").write_text(line + "\n")
    print(line)
    for name, f in summary["figures"].items():
        print(
            f"{name}: before {f['before']} after {f['after']} -> {f['ratio_after_before']}x "
            f"(median of the rounds' ratios {f['median_round_ratio']}x)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
