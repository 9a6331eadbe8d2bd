"""Benchmark workload builders and JSON/stat helpers; no model is loaded here."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from pagoda.bench import latency, throughput, throughput_runs
from pagoda.bench.common import (
    BenchRequest,
    batches,
    decode_tok_s,
    emit,
    hf_precision,
    hit_rate,
    left_pad,
    llama_cpp_precision,
    median,
    pagoda_precision,
    parse_range,
    peer_comparison,
    random_prompt,
    random_workload,
    ratio,
    throughput_stats,
)
from pagoda.kernels.cpu import built


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)  # the engine flag both benches reuse
    module.add_arguments(parser)
    return parser


def test_w1_matches_nano_vllm_recipe():
    # nano-vllm bench.py, drawn with the global random module.
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    outs = [random.randint(100, 1024) for _ in range(256)]
    w1 = random_workload(256, (100, 1024), (100, 1024), seed=0)
    assert [r.prompt_token_ids for r in w1] == prompts
    assert [r.output_len for r in w1] == outs
    assert sum(r.output_len for r in w1) == 133_966  # DESIGN.md section 5


def test_w_cpu_output_tokens():
    w = random_workload(64, (16, 256), (16, 256), seed=0)
    assert sum(r.output_len for r in w) == 8_224  # DESIGN.md section 5


def test_lengths_and_ids_within_ranges():
    w = random_workload(50, (3, 9), (5, 7), seed=123)
    assert len(w) == 50
    for r in w:
        assert 3 <= len(r.prompt_token_ids) <= 9
        assert 5 <= r.output_len <= 7
        assert all(0 <= t <= 10_000 for t in r.prompt_token_ids)
    assert {len(r.prompt_token_ids) for r in w} == set(range(3, 10))


def test_deterministic_with_seed():
    a = random_workload(20, (1, 50), (1, 50), seed=7)
    assert a == random_workload(20, (1, 50), (1, 50), seed=7)
    assert a != random_workload(20, (1, 50), (1, 50), seed=8)


def test_does_not_touch_global_random_state():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    random_workload(10, (1, 5), (1, 5), seed=0)
    assert random.random() == expected


def test_shared_prefix_prepended_rest_unchanged():
    base = random_workload(10, (4, 12), (2, 8), seed=0)
    shared = random_workload(10, (4, 12), (2, 8), seed=0, shared_prefix_len=32)
    prefix = shared[0].prompt_token_ids[:32]
    assert len(prefix) == 32
    for b, s in zip(base, shared):
        assert s.prompt_token_ids == prefix + b.prompt_token_ids
        assert s.output_len == b.output_len


def test_workload_rejects_bad_sizes():
    with pytest.raises(ValueError):
        random_workload(0, (1, 2), (1, 2))
    with pytest.raises(ValueError):
        random_workload(1, (1, 2), (1, 2), shared_prefix_len=-1)


def test_random_prompt():
    p = random_prompt(128, seed=3)
    assert len(p) == 128 and p == random_prompt(128, seed=3) and p != random_prompt(128, seed=4)


def test_parse_range():
    assert parse_range("100,1024") == (100, 1024)
    assert parse_range("5,5") == (5, 5)
    for bad in ("5", "a,b", "9,3", "0,4", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_range(bad)


def test_throughput_stats():
    s = throughput_stats(
        2.0, num_prompt_tokens=300, num_output_tokens=100, prefix_cache_hit_rate=0.5
    )
    assert s == {
        "elapsed_s": 2.0,
        "output_tok_s": 50.0,
        "total_tok_s": 200.0,
        "num_prompt_tokens": 300,
        "num_output_tokens": 100,
        "prefix_cache_hit_rate": 0.5,
    }
    with pytest.raises(ValueError):
        throughput_stats(0.0, 1, 1)


def test_small_helpers():
    assert hit_rate(25, 100) == 0.25
    assert hit_rate(0, 0) is None
    assert ratio(300.0, 100.0) == 3.0
    assert ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    with pytest.raises(ValueError):
        median([])
    assert decode_tok_s(11, 1.0, 2.0) == 10.0
    assert decode_tok_s(1, 1.0, 1.0) is None
    assert [list(b) for b in batches(list(range(5)), 2)] == [[0, 1], [2, 3], [4]]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_emit_prints_one_json_line_and_writes_file(tmp_path, capsys):
    path = tmp_path / "out.json"
    emit({"a": 1, "b": [1.5, None]}, str(path))
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == {"a": 1, "b": [1.5, None]}
    assert json.loads(path.read_text()) == {"a": 1, "b": [1.5, None]}


def test_throughput_defaults_are_w1():
    args = _parser(throughput).parse_args([])
    assert args.num_prompts == 256
    assert args.input_len_range == (100, 1024) and args.output_len_range == (100, 1024)
    assert args.temperature == 0.6 and args.seed == 0 and args.shared_prefix_len == 0
    assert args.peer == "none" and args.peer_batch_size == 16 and args.peer_num_prompts is None
    record = throughput.workload_record(args, [BenchRequest([1, 2, 3], 4)])
    assert record["num_prompt_tokens"] == 3 and record["num_output_tokens"] == 4


def test_throughput_warmup_is_shaped_like_the_workload():
    requests = random_workload(20, (16, 64), (4, 8), seed=0, shared_prefix_len=16)
    warmup = throughput_runs.warmup_requests(requests)
    assert [len(w.prompt_token_ids) for w in warmup] == [
        len(r.prompt_token_ids) for r in requests[:8]
    ]
    assert [w.output_len for w in warmup] == [4, 6, 8, 10, 12, 14, 16, 18]
    # No warm-up block (the first 16 tokens of a prompt) is one of the workload's.
    assert not {tuple(w.prompt_token_ids[:16]) for w in warmup} & {
        tuple(r.prompt_token_ids[:16]) for r in requests
    }


def test_throughput_flags():
    args = _parser(throughput).parse_args(
        [
            "--num-prompts",
            "8",
            "--input-len-range",
            "16,64",
            "--peer",
            "hf",
            "--peer-num-prompts",
            "4",
        ]
    )
    assert args.num_prompts == 8 and args.input_len_range == (16, 64)
    assert throughput._peer_num_prompts(args) == 4
    args.peer_num_prompts = 9
    with pytest.raises(ValueError):
        throughput._peer_num_prompts(args)


def test_latency_defaults_and_summary():
    args = _parser(latency).parse_args([])
    assert (args.input_len, args.output_len, args.num_iters) == (128, 256, 3)
    timings = [
        latency.IterTiming(0.1, 1.1, 11),
        latency.IterTiming(0.3, 2.3, 11),
        latency.IterTiming(0.2, 0.7, 11),
    ]
    s = latency.summarize(timings)
    assert s["ttft_ms"] == 200.0
    assert s["decode_tok_s"] == 10.0  # per-iteration 10, 5, 20
    assert s["e2e_ms"] == 1100.0
    assert s["iters_decode_tok_s"] == [10.0, 5.0, 20.0]
    # vLLM's way: output tokens over submission to last token, prefill included.
    assert s["iters_e2e_tok_s"] == [10.0, 4.78, 15.71]
    assert s["e2e_tok_s"] == 10.0
    line = latency.rates_line(s, 11)
    assert "decode 10.0 tok/s after the first token" in line
    assert "11 / end-to-end 10.0 tok/s" in line


def test_precision_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")  # torch's ops: bf16 activations
    assert pagoda_precision("gguf", "float32", "Q4_1", "cpu") == (
        "gguf Q4_1 (4-bit weights, bf16 activations)"
    )
    assert pagoda_precision("none", "float32", "Q4_1", "cpu") == (
        "float32 dequantized from the GGUF Q4_1"
    )
    assert pagoda_precision("none", "bfloat16", None, "cuda") == "bfloat16 (the checkpoint)"
    assert pagoda_precision("int8", "float32", None, "cpu") == (
        "int8 weights quantized from the checkpoint, bf16 activations"
    )
    assert pagoda_precision("gguf", "float32", "Q4_1", "cuda") == (
        "gguf Q4_1 (4-bit weights, float32 activations)"
    )
    if built() is not None:  # pagoda's CPU kernels: int8 activations
        monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
        assert pagoda_precision("gguf", "float32", "Q4_1", "cpu") == (
            "gguf Q4_1 (4-bit weights, int8 (pagoda's CPU kernels) activations)"
        )
    assert hf_precision("Q4_1") == "float32 dequantized from the GGUF Q4_1"
    assert llama_cpp_precision("Q4_1").startswith("gguf Q4_1, the same file")
    c = peer_comparison("gguf Q4_1 (...)", "hf", "float32 (...)", False, "output tok/s", 2.5)
    assert c["precisions"] == {"pagoda": "gguf Q4_1 (...)", "peer": "float32 (...)"}
    assert c["same_weights"] is False
    assert c["ratio_line"].startswith("pagoda / hf output tok/s: 2.50x (DIFFERENT")
    assert "gguf Q4_1 (...)" in c["ratio_line"] and "float32 (...)" in c["ratio_line"]


def _fake_weights(quantization: str) -> dict[str, object]:
    return {
        "quantization": quantization,
        "dtype": "float32",
        "weight_mib": 1.0,
        "precision": pagoda_precision(quantization, "float32", "Q4_1", "cpu"),
    }


@pytest.mark.parametrize(
    "extra, quantization, same",
    [([], "none", True), (["--quantization", "gguf"], "gguf", False)],
)
def test_throughput_peer_hf_record_names_both_precisions(
    monkeypatch, capsys, extra, quantization, same
):
    """--peer hf runs pagoda on HF's float32 weights unless --quantization says otherwise; the
    JSON and the ratio line on stderr name both precisions either way."""
    seen: dict[str, object] = {}

    def fake_pagoda(model, kwargs, requests, temperature, gguf_type):
        seen["kwargs"] = kwargs
        out = sum(r.output_len for r in requests)
        return {**_fake_weights(kwargs["quantization"]), **throughput_stats(2.0, 1, out)}

    def fake_hf(model, requests, temperature, batch_size, seed):
        out = sum(r.output_len for r in requests)
        return {"name": "hf-transformers", **throughput_stats(4.0, 1, out)}

    def fake_kwargs(args):  # what the user set, as pagoda.cli.engine_kwargs returns it
        return {"seed": 0, **({"quantization": args.quantization} if args.quantization else {})}

    monkeypatch.setattr(throughput, "token_id_engine_kwargs", fake_kwargs)
    monkeypatch.setattr(throughput, "gguf_weight_type", lambda model: "Q4_1")
    monkeypatch.setattr(throughput, "run_pagoda", fake_pagoda)
    monkeypatch.setattr(throughput, "run_hf", fake_hf)
    parser = _parser(throughput)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args(["--num-prompts", "4", "--peer", "hf"] + extra)
    args.model = None
    assert throughput.main(args) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert seen["kwargs"] == {"seed": 0, "quantization": quantization}
    assert record["pagoda"]["quantization"] == quantization
    pagoda = pagoda_precision(quantization, "float32", "Q4_1", "cpu")
    assert record["precisions"] == {
        "pagoda": pagoda,
        "peer": "float32 dequantized from the GGUF Q4_1",
    }
    assert record["peer"]["precision"] == "float32 dequantized from the GGUF Q4_1"
    assert record["same_weights"] is same and record["ratio_output_tok_s"] == 2.0
    assert record["ratio_line"] in captured.err
    assert pagoda in record["ratio_line"] and "float32 dequantized" in record["ratio_line"]


def test_latency_peer_llama_cpp_record_names_the_same_file(monkeypatch, capsys):
    timings = [latency.IterTiming(0.1, 1.1, 11)] * 2

    def fake_pagoda(model, kwargs, prompts, output_len, gguf_type, outputs=None):
        return timings, _fake_weights(kwargs.get("quantization", "gguf")), None

    monkeypatch.setattr(latency, "token_id_engine_kwargs", lambda args: {"seed": 0})
    monkeypatch.setattr(latency, "gguf_weight_type", lambda model: "Q4_1")
    monkeypatch.setattr(latency, "run_pagoda", fake_pagoda)
    monkeypatch.setattr(latency, "run_llama_cpp", lambda model, prompts, n, lookup=None: timings)
    line = {
        "bytes_per_step_mb": 100.0,
        "decode_weight_mb": 90.0,
        "decode_kv_mb": 10.0,
        "decode_ms_per_token": 100.0,
        "read_gb_s": 1.0,
        "machine_read_bandwidth_gb_s": 40.0,
        "fraction_of_bandwidth": 0.025,
        "bandwidth_bound_tok_s": 400.0,
    }
    seen: list[tuple[int, int, float]] = []

    def fake_roofline(llm, i, o, ms, path):
        assert path.endswith(".gguf")  # the file's tensor bytes are the weights counted
        return seen.append((i, o, ms)) or line

    monkeypatch.setattr(latency, "roofline", fake_roofline)
    args = _parser(latency).parse_args(["--peer", "llama.cpp"])
    args.model = None
    assert latency.main(args) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["roofline"] == line and seen == [(args.input_len, args.output_len, 100.0)]
    assert "2% of the 40.0 GB/s measured" in captured.err
    assert record["precisions"]["pagoda"] == pagoda_precision("gguf", "float32", "Q4_1", "cpu")
    assert record["precisions"]["peer"] == llama_cpp_precision("Q4_1")
    assert "the same file" in record["ratio_line"] and record["same_weights"] is True
    assert record["pagoda"]["decode_ms_per_token"] == 100.0
    assert record["pagoda"]["e2e_tok_s"] == record["peer"]["e2e_tok_s"] == 10.0
    assert record["ratio_e2e_tok_s"] == record["ratio_decode_tok_s"] == 1.0
    assert record["ratio_line"] in captured.err
    assert latency.rates_line(record["pagoda"], args.output_len) in captured.err


def test_latency_with_speculation_runs_its_own_baseline(monkeypatch, capsys):
    """With --speculative-config the record holds pagoda with and without it (same prompts),
    the ratio, whether the greedy outputs match, the acceptance totals, and HF's prompt-lookup
    arguments for --peer hf."""
    from types import SimpleNamespace

    from pagoda.scheduling.messages import SchedulerStats

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    runs: list[dict] = []
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 10, 40, 30, [10, 9, 7, 4])
    llm = SimpleNamespace(engine=SimpleNamespace(stats=lambda: stats))

    def fake_pair(model, kwargs, prompts, output_len, gguf_type, outputs):
        runs.extend(kwargs)
        for out in outputs:
            out.extend([[1, 2, 3]] * len(prompts))
        spec_timing = latency.IterTiming(0.1, 0.6, 11)
        plain_timing = latency.IterTiming(0.1, 1.1, 11)
        n = len(prompts)
        return [spec_timing] * n, [plain_timing] * n, _fake_weights("none"), llm

    hf_args: list = []

    def fake_hf(model, prompts, n, lookup=None):
        hf_args.append(lookup)
        return [latency.IterTiming(0.1, 2.1, 11)] * len(prompts)

    monkeypatch.setattr(
        latency, "token_id_engine_kwargs", lambda args: {"seed": 0, "speculative_config": spec}
    )
    monkeypatch.setattr(latency, "gguf_weight_type", lambda model: "Q4_1")
    monkeypatch.setattr(latency, "run_pagoda_pair", fake_pair)
    monkeypatch.setattr(latency, "run_hf", fake_hf)
    args = _parser(latency).parse_args(["--peer", "hf"])
    args.model = None
    assert latency.main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert ["speculative_config" in k for k in runs] == [True, False]
    assert record["spec_ratio_decode_tok_s"] == 2.0 and record["spec_output_identical"] is True
    assert record["spec_decode"]["acceptance_rate"] == 0.75
    assert record["spec_decode"]["mean_acceptance_length"] == 4.0
    assert hf_args == [{"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}]
    assert record["peer"]["name"].startswith("hf-transformers, prompt lookup")


def test_the_pair_takes_each_prompt_on_both_engines_in_turn(monkeypatch):
    """run_pagoda_pair: both engines up before the first prompt, which goes to the first engine
    first, the next one to the second engine first, and so on; outputs kept per engine."""
    from pagoda.bench import b1_runs

    order: list[tuple[str, int]] = []

    def fake_start(model, kwargs, gguf_type):
        order.append(("start", kwargs["name"]))
        return kwargs["name"], {"name": kwargs["name"]}

    def fake_time(llm, ids, output_len):
        order.append((llm, ids[0]))
        return b1_runs.IterTiming(0.1, 0.2, output_len), [ids[0], llm]

    monkeypatch.setattr(b1_runs, "start_pagoda", fake_start)
    monkeypatch.setattr(b1_runs, "time_prompt", fake_time)
    outputs: tuple[list, list] = ([], [])
    spec, plain, weights, llm = b1_runs.run_pagoda_pair(
        None, ({"name": "a"}, {"name": "b"}), [[0], [1], [2]], 4, None, outputs
    )
    assert order == [
        ("start", "a"),
        ("start", "b"),
        ("a", 0),
        ("b", 0),
        ("b", 1),
        ("a", 1),
        ("a", 2),
        ("b", 2),
    ]
    assert outputs == ([[0, "a"], [1, "a"], [2, "a"]], [[0, "b"], [1, "b"], [2, "b"]])
    assert len(spec) == len(plain) == 3 and weights == {"name": "a"} and llm == "a"


def test_copy_workload_prompts(smollm2_tokenizer) -> None:
    from pagoda.bench.copy_workload import PASSAGES, copy_prompts

    prompts = copy_prompts(smollm2_tokenizer, len(PASSAGES) + 1)
    assert prompts[0] == prompts[-1] and len({tuple(p) for p in prompts}) == len(PASSAGES)
    text = smollm2_tokenizer.decode(prompts[1])
    assert PASSAGES[1] in text and "Repeat the following text exactly" in text


@pytest.mark.slow
def test_cli_benches_run_end_to_end(capsys):
    from pagoda.cli import main

    argv = ["bench", "throughput", "--num-prompts", "2", "--input-len-range", "8,16"]
    assert main(argv + ["--output-len-range", "4,8"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["pagoda"]["output_tok_s"] > 0
    assert (
        main(["bench", "latency", "--input-len", "16", "--output-len", "8", "--num-iters", "1"])
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["pagoda"]["num_output_tokens"] == [8]
