"""One screen from a benchmarks/gpu.sh step's folder: each command's exit code and time, the
benches' figures beside vLLM's anchors, the tests' counts and failures, and the log tail of
every command that failed.

    python benchmarks/gpu_summary.py STEP_DIR

STEP_DIR holds commands.tsv (exit code, seconds, name, command per line), NAME.log per command,
the benches' NAME.json and the tests' NAME.xml (JUnit). Exits 1 if a command failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# vLLM 0.24.0 on one H100 80GB, bf16, random weights (shared DESIGN.md section 5): W1 output
# tok/s and B1 tok/s (512 output tokens over the end-to-end time, prefill included).
ANCHORS = {
    "SmolLM2-135M-Instruct": (29_034, 537),
    "Qwen3-0.6B": (18_401, 460),
    "Llama-3.2-1B": (29_430, 533),
}
TAIL_LINES = 15
WIDTH = 150


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def versus(value: float | None, anchor: float) -> str:
    return "" if value is None else f" ({value / anchor:.2f}x vLLM's {anchor:,})"


def commands(folder: Path) -> list[tuple[int, int, str, str]]:
    rows = []
    path = folder / "commands.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        rc, secs, name, cmd = line.split("\t", 3)
        rows.append((int(rc), int(secs), name, cmd))
    return rows


def bench_line(name: str, r: dict[str, Any]) -> str:
    model = Path(str(r.get("model", "?"))).name
    anchor_w1, anchor_b1 = ANCHORS.get(model, (None, None))
    p = r.get("pagoda") or {}
    scheme = p.get("quantization", "?")
    scheme = p.get("dtype", "?") if scheme == "none" else scheme
    if r.get("bench") == "throughput":
        w = r.get("workload", {})
        rate = p.get("output_tok_s")
        return (
            f"W1 {model} {scheme}: {fmt(rate)} output tok/s"
            + (versus(rate, anchor_w1) if anchor_w1 else "")
            + f", {fmt(p.get('elapsed_s'), 1)} s for {w.get('num_prompts')} requests, startup "
            f"{fmt(p.get('startup_s'), 1)} s, preemptions {p.get('num_preemptions')}"
        )
    if r.get("bench") == "latency":
        e2e = p.get("e2e_tok_s")
        line = (
            f"B1 {name.removeprefix('b1_')} ({scheme}): {fmt(e2e)} tok/s end to end"
            + (versus(e2e, anchor_b1) if anchor_b1 else "")
            + f", decode {fmt(p.get('decode_tok_s'))} tok/s after the first token, TTFT "
            f"{fmt(p.get('ttft_ms'), 1)} ms"
        )
        prof = r.get("decode_step_profile")
        if prof:
            busy = prof.get("gpu_busy_fraction")
            line += (
                f"\n   decode-step profile: step {fmt(prof.get('step_ms'), 3)} ms, GPU busy "
                f"{'-' if busy is None else f'{busy:.0%}'}, host "
                f"{fmt(prof.get('host_ms_per_step'), 3)} ms/step"
            )
        return line
    if r.get("bench") == "host_overhead":
        return (
            f"host ceiling ({'async' if r.get('async_scheduling') else 'sync'}, "
            f"{r.get('device')}): W1 {fmt(r.get('w1_host_ceiling_tok_s'))} tok/s, B1 "
            f"{fmt(r.get('b1_host_ceiling_tok_s'))} tok/s ({r.get('b1_host_us_per_token')} "
            "us/token)"
        )
    return f"{name}: {json.dumps(r)[:WIDTH]}"


def tests_lines(path: Path) -> list[str]:
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        return [f"{path.stem}: no JUnit report ({e})"]
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    count["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    lines = [
        f"{path.stem}: {passed} passed, {count['failures']} failed, {count['errors']} errors, "
        f"{count['skipped']} skipped"
    ]
    reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = (bad.get("message") or "").splitlines()[:1]
            lines.append(f"  FAILED {test}: {' '.join(message)}"[:WIDTH])
        for skip in case.findall("skipped"):
            reason = skip.get("message") or ""
            reasons[reason] = reasons.get(reason, 0) + 1
    lines += [f"  skipped {n}: {reason}"[:WIDTH] for reason, n in sorted(reasons.items())]
    return lines


def summarize(folder: Path) -> tuple[list[str], bool]:
    rows = commands(folder)
    failed = [row for row in rows if row[0] != 0]
    lines = [
        f"== {folder.name}: {len(rows)} commands, {len(failed)} failed, {sum(r[1] for r in rows)} s"
    ]
    for rc, secs, name, _ in rows:
        status = "ok" if rc == 0 else ("TIMEOUT" if rc in (124, 137) else f"FAIL {rc}")
        lines.append(f"  {status:<8} {secs:>4} s  {name}")
    gpu = folder / "gpu.txt"
    if gpu.exists():
        lines.append("  " + " | ".join(gpu.read_text().split("\n")[1:2]))
    for rc, _, name, _ in rows:
        if rc != 0:
            continue
        path = folder / f"{name}.json"
        if path.exists():
            record = json.loads(path.read_text().strip().splitlines()[-1])
            lines += [line[:WIDTH] for line in bench_line(name, record).split("\n")]
    for path in sorted(folder.glob("*.xml")):
        lines += tests_lines(path)
    for rc, _, name, cmd in failed:
        log = folder / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:] if log.exists() else []
        lines.append(f"-- {name} exited {rc}: {cmd}"[:WIDTH])
        lines += ["   " + t[: WIDTH - 3] for t in tail]
    return lines, not rows or bool(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a gpu.sh step's folder (STEP/ inside $OUT/STEP.tar.gz)")
    args = parser.parse_args(argv)
    lines, failed = summarize(Path(args.folder))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
