"""Summary of benchmarks/before_after.sh: best of the rounds per side, and after / before.

    python benchmarks/before_after_summary.py OUT_DIR BEFORE_COMMIT AFTER_COMMIT

Prints one JSON line and writes it to OUT_DIR/summary.json. Both sides run the same weights
(the embedded SmolLM2-135M Q4_1 GGUF, kept quantized), the same workloads and -O2, on this
machine, alternately; higher is better for every figure listed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

FIGURES = {  # name -> (file prefix, path into the JSON)
    "w_cpu_O2_output_tok_s": ("w_cpu_O2", ("pagoda", "output_tok_s")),
    "b1_O2_decode_tok_s": ("b1_O2", ("pagoda", "decode_tok_s")),
    "host_w1_ceiling_tok_s": ("host", ("w1_host_ceiling_tok_s",)),
    "host_b1_ceiling_tok_s": ("host", ("b1_host_ceiling_tok_s",)),
}


def value(record: dict[str, Any], path: tuple[str, ...]) -> float:
    for key in path:
        record = record[key]
    return float(record)  # type: ignore[arg-type]


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


def main(out_dir: str, before: str, after: str) -> None:
    out = Path(out_dir)
    summary: dict[str, Any] = {
        "bench": "before_after",
        "before": before,
        "after": after,
        "like_with_like": "same weights (embedded SmolLM2-135M Q4_1 GGUF), workloads and -O2 "
        "on both sides; runs alternate before / after on one machine; best of the rounds, and "
        "the median of each round's after / before",
        "cpu_count": os.cpu_count(),
        "figures": {},
    }
    for name, (prefix, path) in FIGURES.items():
        got = {
            side: [value(r, path) for r in runs(out, prefix, side)] for side in ("before", "after")
        }
        best = {side: max(v) for side, v in got.items() if v}
        summary["figures"][name] = {
            "before_runs": got["before"],
            "after_runs": got["after"],
            "before": best.get("before"),
            "after": best.get("after"),
            "ratio_after_before": round(best["after"] / best["before"], 3)
            if len(best) == 2
            else None,
            "median_round_ratio": median_ratio(got["before"], got["after"]),
        }
    host_steps = {
        side: [r["w1_full_batch_ms_per_step"] for r in runs(out, "host", side)]
        for side in ("before", "after")
    }
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
