"""`bench throughput|latency --enable-lora` (pagoda/bench/lora_adapters.py, lora_runs.py): which
adapter each request takes, the engines' arguments, the rounds and ratios, and the generated
adapters as pagoda reads them. No benchmark runs here."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench import latency, lora_adapters, lora_runs, throughput
from pagoda.bench.common import BenchRequest
from pagoda.bench.lora_adapters import (
    ALL_LINEAR,
    AdapterShape,
    assign_adapters,
    bench_adapters,
    generated_shape,
    lora_engine_kwargs,
    num_loras,
)


def _args(module: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_round_robin_spreads_requests_evenly() -> None:
    assert assign_adapters(10, 4, "round-robin", 0) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert assign_adapters(3, 1, "round-robin", 5) == [0, 0, 0]


def test_random_assignment_is_seeded_and_leaves_global_random_alone() -> None:
    random.seed(123)
    state = random.getstate()
    first = assign_adapters(64, 4, "random", 0)
    assert random.getstate() == state
    assert first == assign_adapters(64, 4, "random", 0)
    assert first != assign_adapters(64, 4, "random", 1)
    assert set(first) == {0, 1, 2, 3}  # 64 draws over 4 adapters: each one drawn


def test_assignment_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one adapter"):
        assign_adapters(4, 0, "round-robin", 0)
    with pytest.raises(ValueError, match="--lora-assignment"):
        assign_adapters(4, 2, "by-length", 0)


def test_one_folder_serves_under_every_id_as_vllm_bench_does() -> None:
    adapters = bench_adapters(["/a"], 3)
    assert [(a.name, a.int_id, a.path) for a in adapters] == [
        ("lora-1", 1, "/a"),
        ("lora-2", 2, "/a"),
        ("lora-3", 3, "/a"),
    ]
    assert [a.path for a in bench_adapters(["/a", "/b"], 2)] == ["/a", "/b"]
    with pytest.raises(ValueError, match="--num-loras 3"):
        bench_adapters(["/a", "/b"], 3)


def test_the_base_engine_has_no_lora_flag_and_the_lora_engine_defaults_to_every_adapter() -> None:
    kwargs = {"seed": 0, "enable_lora": True, "max_cpu_loras": 8}
    base, lora = lora_engine_kwargs(kwargs, 4, 16)
    assert base == {"seed": 0}
    assert lora == {
        "seed": 0,
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 16,
        "max_cpu_loras": 8,
    }
    _, given = lora_engine_kwargs({"enable_lora": True, "max_loras": 2, "max_lora_rank": 32}, 4, 16)
    assert given["max_loras"] == 2 and given["max_lora_rank"] == 32


def test_flags_and_their_defaults() -> None:
    args = _args(throughput, ["--num-prompts", "64"])
    assert args.num_loras is None and args.lora_path is None
    assert args.lora_assignment == "round-robin" and args.lora_alpha is None
    assert num_loras(args, {}, default=4) == 4
    assert num_loras(args, {"max_loras": 2}, default=4) == 2
    assert generated_shape(args, {}) == AdapterShape(16, 32, ALL_LINEAR)
    args = _args(
        latency, ["--num-loras", "2", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"]
    )
    assert num_loras(args, {"max_loras": 4}, default=1) == 2
    assert generated_shape(args, {"max_lora_rank": 8}) == AdapterShape(8, 8, ("q_proj", "v_proj"))
    args.num_loras = 0
    with pytest.raises(ValueError, match="--num-loras"):
        num_loras(args, {}, default=1)
    assert _args(latency, ["--peer", "vllm"]).vllm_dtype == "auto"


def test_ratio_pairs_put_pagodas_lora_cost_first() -> None:
    assert lora_runs.ratio_pairs([]) == [("pagoda-lora", "pagoda")]
    assert lora_runs.ratio_pairs(["float32"]) == [
        ("pagoda-lora", "pagoda"),
        ("vllm-float32-lora", "vllm-float32"),
        ("pagoda-lora", "vllm-float32-lora"),
        ("pagoda", "vllm-float32"),
    ]


def test_rounds_alternate_the_order_and_draw_fresh_tokens() -> None:
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5], 2)]
    seen: list[tuple[str, int, list[list[int]]]] = []

    def runner(name: str) -> lora_runs.Runner:
        def run(r: int, work: list[BenchRequest]) -> dict[str, Any]:
            seen.append((name, r, [w.prompt_token_ids for w in work]))
            assert [w.output_len for w in work] == [4, 2]
            return {"output_tok_s": 10.0 if name == "pagoda" else 8.0, "num_output_tokens": 6}

        return run

    engines = {"pagoda": runner("pagoda"), "pagoda-lora": runner("pagoda-lora")}
    record: dict[str, Any] = {"rounds": lora_runs.run_rounds(engines, requests, 3, "output_tok_s")}
    assert [e["order"] for e in record["rounds"]] == [
        ["pagoda", "pagoda-lora"],
        ["pagoda-lora", "pagoda"],
        ["pagoda", "pagoda-lora"],
    ]
    by_round = {r: [ids for name, rr, ids in seen if rr == r] for r in range(3)}
    assert all(a == b for a, b in by_round.values())  # both engines, the same tokens
    assert by_round[0][0] == [[1, 2, 3], [4, 5]] and by_round[1][0] != by_round[0][0]
    lora_runs.summarize_ratios(record, lora_runs.ratio_pairs([]), "output_tok_s", "output tok/s")
    summary = record["ratios"]["pagoda-lora / pagoda output_tok_s"]
    assert summary["per_round"] == [0.8, 0.8, 0.8] and summary["median"] == 0.8
    assert record["ratio_lines"] == [
        "pagoda-lora / pagoda output tok/s: 0.80x median of 3 rounds (range 0.80-0.80)"
    ]


def test_generated_adapters_are_peft_all_linear_and_pagoda_reads_them(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """make_adapters over a tiny Llama: PEFT's files, rank 16, alpha 32, the seven projections
    of every layer, B not zero, each adapter its own; the model comes back without adapters."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.loading.lora import load_adapter

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    paths = lora_adapters.make_adapters(hf, str(tmp_path), 2, AdapterShape(16, 32), seed=0)
    assert [Path(p).name for p in paths] == ["lora-1", "lora-2"]
    assert not any("lora_" in name for name, _ in hf.named_parameters())
    config = lora_adapters.adapter_config(paths[0])
    assert config == {"rank": 16, "alpha": 32, "targets": sorted(ALL_LINEAR), "use_rslora": False}
    first, second = (load_adapter(p) for p in paths)
    leaves = {name.rpartition(".")[2] for name in first.weights}
    assert leaves == set(ALL_LINEAR) and first.rank == 16
    assert set(first.scaling.values()) == {2.0}
    module = "model.layers.0.self_attn.q_proj"
    assert first.weights[module][1].abs().sum() > 0
    assert not torch.equal(first.weights[module][1], second.weights[module][1])


def test_lora_sh_runs_both_benches_with_flags_the_cli_takes(tmp_path: Path) -> None:
    """benchmarks/lora.sh with a stand-in Python that records its arguments: each step's
    command parses with pagoda's own CLI parser, with LoRA on and the issue's shapes."""
    import os
    import shlex
    import subprocess

    from pagoda.cli import build_parser

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    fake.chmod(0o755)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": str(fake), "PEER": "none", "OUT": str(tmp_path / "out")}
    script = str(root / "benchmarks" / "lora.sh")
    run = subprocess.run(
        ["bash", script, "wcpu", "b1"], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    parsed = [build_parser().parse_args(shlex.split(line)[2:]) for line in lines]
    wcpu, b1 = parsed
    assert wcpu.bench == "throughput" and b1.bench == "latency"
    assert wcpu.num_prompts == 64 and wcpu.input_len_range == wcpu.output_len_range == (16, 256)
    assert wcpu.temperature == 0.6 and wcpu.seed == 0 and wcpu.num_loras == 4
    assert b1.input_len == b1.output_len == 128 and b1.num_loras == 1
    for args in parsed:
        assert args.enable_lora and args.max_lora_rank == 16 and args.peer == "none"
        assert args.output_json.startswith(str(tmp_path / "out"))
