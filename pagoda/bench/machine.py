"""What a peer comparison records of the machine and the engines it ran, and how its rounds are
summed up.

A 2-core cloud machine drifts by 10-15% within minutes, so two engines timed one after the other
can land in different speed phases. A comparison therefore runs the engines in alternating order
over several rounds (pagoda first in even rounds, the peer first in odd ones), takes each round's
ratio, and reports the median ratio and the range; the machine record says what it ran on (CPU,
instruction-set flags, cores, load) so that figures from different machines are not mixed up.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagoda.bench.common import median
from pagoda.version import __version__

# The flags that decide which kernels run (ggml's, torch's, pagoda's).
SIMD_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name, vendor, family / model numbers and which of SIMD_FLAGS it lists
    (Linux; the model name alone elsewhere)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {"model": platform.processor() or None, "simd_flags": []}
    first: dict[str, str] = {}  # the first processor's fields
    for line in text.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    return {
        "model": first.get("model name"),
        # vendor, family and model number tell the core (AMD family 25 model 1: Zen 3)
        "vendor": first.get("vendor_id"),
        "family_model": f"{first.get('cpu family')}/{first.get('model')}",
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
    }


def machine_record() -> dict[str, Any]:
    """The CPU, its flags, the cores this process may use, the 1/5/15-minute load and the
    instruction sets torch and pagoda's kernels run at (ATEN_CPU_CAPABILITY caps both)."""
    import torch

    from pagoda.kernels.cpu import ISA_NAMES, built

    ops = built()
    return {
        **cpu_info(),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "pagoda_kernels_isa": None if ops is None else ISA_NAMES[ops.isa()],
        # the quantized matmuls' passes of 16+ rows on the tile unit (kernels/cpu/quant_gemm.cpp)
        "pagoda_kernels_amx": None if ops is None else bool(ops.amx()),
    }


def pagoda_version() -> dict[str, Any]:
    """pagoda's version, the commit of the checkout it runs from (where there is one; "-dirty"
    with changes not committed), torch's version and its thread count."""
    import torch

    return {
        "name": "pagoda",
        "version": __version__,
        "commit": _git_commit(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def round_order(round_index: int, engines: Sequence[str]) -> list[str]:
    """The engines in the order round `round_index` runs them: as given in even rounds,
    reversed in odd ones."""
    return list(engines) if round_index % 2 == 0 else list(reversed(engines))


def ratio_summary(ours: Sequence[float | None], theirs: Sequence[float | None]) -> dict[str, Any]:
    """Round-by-round ratios ours / theirs, their median and range (rounds where either side
    has no value are left out of the median)."""
    if len(ours) != len(theirs):
        raise ValueError("both sides need one value a round")
    rounds = [
        None if a is None or b is None or b == 0 else round(a / b, 3)
        for a, b in zip(ours, theirs, strict=True)
    ]
    known = [r for r in rounds if r is not None]
    return {
        "per_round": rounds,
        "median": round(median(known), 3) if known else None,
        "min": min(known) if known else None,
        "max": max(known) if known else None,
    }


def ratio_words(metric: str, summary: dict[str, Any], peer: str) -> str:
    """One line: the median ratio of `metric`, pagoda / peer, with its range over the rounds."""
    if summary["median"] is None:
        return f"pagoda / {peer} {metric}: -"
    n = len([r for r in summary["per_round"] if r is not None])
    return (
        f"pagoda / {peer} {metric}: {summary['median']:.2f}x median of {n} rounds "
        f"(range {summary['min']:.2f}-{summary['max']:.2f})"
    )
