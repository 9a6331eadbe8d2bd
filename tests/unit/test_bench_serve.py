"""`pagoda bench serve`: prompt building, SSE parsing, summary math, and whole runs against a fake
OpenAI streaming server (FastAPI under uvicorn in a thread); no model is loaded."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.bench import serve
from pagoda.bench.serve import arrival_times, parse_rates
from pagoda.bench.serve_client import (
    DONE,
    RequestConfig,
    RequestResult,
    chunk_text,
    count_output_tokens,
    finish_reason,
    parse_sse_line,
    request_body,
    tpot,
)
from pagoda.bench.serve_prompts import (
    ServeRequest,
    build_requests,
    fit_prompt,
    ordinary_vocab,
    special_token_ids,
)
from pagoda.bench.serve_stats import goodput, latency_stats, summarize


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def _result(ttft: float, e2el: float, n: int, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=10,
        output_len=n,
        output_tokens=n,
        ttft=ttft,
        e2el=e2el,
        itl=itl or [],
    )


# ---- pure functions ------------------------------------------------------------------------
def test_tpot():
    assert tpot(e2el=1.1, ttft=0.1, output_tokens=11) == pytest.approx(0.1)
    assert tpot(1.0, 0.5, 1) is None and tpot(1.0, 0.5, 0) is None
    assert _result(0.2, 0.6, 5).tpot == pytest.approx(0.1)


def test_latency_stats_in_ms():
    s = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean"] == 50.5 and s["median"] == 50.5
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert latency_stats([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_goodput_with_slos():
    results = [
        _result(0.1, 1.1, 11),  # TTFT 100 ms, TPOT 100 ms
        _result(0.5, 1.5, 11),  # TTFT 500 ms, TPOT 100 ms
        _result(0.1, 3.1, 11),  # TTFT 100 ms, TPOT 300 ms
        _result(0.1, 0.1, 1),  # TTFT 100 ms, no TPOT: meets any TPOT SLO
        RequestResult(success=False, error="HTTP 500"),
    ]
    assert goodput(results, 2.0, None, None) is None
    assert goodput(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=None) == 1.5
    assert goodput(results, 2.0, slo_ttft_ms=None, slo_tpot_ms=200) == 1.5
    assert goodput(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=200) == 1.0
    assert goodput(results, 1.0, slo_ttft_ms=1000, slo_tpot_ms=1000) == 4.0


def test_summarize():
    results = [
        _result(0.1, 1.1, 11, itl=[0.1] * 10),
        _result(0.3, 2.3, 11, itl=[0.2] * 10),
        RequestResult(success=False, error="HTTP 503: busy"),
    ]
    s = summarize(results, duration_s=4.0, slo_ttft_ms=200, slo_tpot_ms=None)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 22)
    assert s["request_throughput"] == 0.5 and s["request_goodput"] == 0.25
    assert s["output_throughput"] == 5.5 and s["total_token_throughput"] == 10.5
    assert s["mean_ttft_ms"] == 200.0 and s["median_tpot_ms"] == 150.0
    assert s["mean_itl_ms"] == 150.0 and s["p99_e2el_ms"] == pytest.approx(2288.0)
    assert s["errors"] == ["HTTP 503: busy"] and s["early_stops"] == 0
    assert s["total_output_tokens_asked"] == 22 and s["length_count_mismatches"] == 0
    results[0].finish_reason, results[1].finish_reason = "stop", "length"
    assert summarize(results, 4.0)["early_stops"] == 1
    results[1].output_tokens = 10  # finished at its length, yet counted one short
    assert summarize(results, 4.0)["length_count_mismatches"] == 1
    with pytest.raises(ValueError):
        summarize(results, 0.0)


def test_arrival_times():
    assert arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(2000, 4.0, seed=1) != arrival_times(2000, 4.0, seed=2)
    assert times[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate


def test_parse_rates_and_flags():
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, math.inf]
    for bad in ("", "a", "1,0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    args = _parse([])
    assert args.base_url == "http://127.0.0.1:8000" and args.endpoint == "/v1/completions"
    assert math.isinf(args.request_rate) and args.max_concurrency is None
    assert args.ignore_eos and not args.logit_bias_eos and args.temperature == 0.0
    args = _parse(["--no-ignore-eos", "--sweep-rates", "1,2", "--extra-body", '{"top_k": 1}'])
    assert not args.ignore_eos and args.sweep_rates == [1.0, 2.0]
    assert args.extra_body == {"top_k": 1}


def test_request_body():
    cfg = RequestConfig(
        url="http://x/v1/completions",
        endpoint="/v1/completions",
        model="m",
        temperature=0.0,
        ignore_eos=True,
        logit_bias={"2": -100.0},
        extra_body={"repeat_penalty": 1.0},
        headers={},
    )
    req = ServeRequest("hi", 1, 7)
    body = request_body(req, cfg, 7)
    assert body["prompt"] == "hi" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["repeat_penalty"] == 1.0
    # logit_bias replaces min_tokens (llama-cpp-python drops both when both are sent)
    assert body["ignore_eos"] is True and body["logit_bias"] == {"2": -100.0}
    assert "min_tokens" not in body
    vllm = RequestConfig(**{**cfg.__dict__, "logit_bias": None})
    body = request_body(req, vllm, 7)
    assert body["ignore_eos"] is True and body["min_tokens"] == 7 and "logit_bias" not in body
    chat = RequestConfig(**{**cfg.__dict__, "endpoint": "/v1/chat/completions"})
    assert request_body(req, chat, 7)["messages"] == [{"role": "user", "content": "hi"}]
    assert "prompt" not in request_body(req, chat, 7)
    plain = RequestConfig(**{**cfg.__dict__, "ignore_eos": False, "logit_bias": None})
    body = request_body(req, plain, 7)
    assert "ignore_eos" not in body and "min_tokens" not in body and "logit_bias" not in body


def test_sse_parsing():
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    for other in ("", ": ping - 2024-01-01", "event: message", "id: 3", "data: "):
        assert parse_sse_line(other) is None
    assert chunk_text({"choices": [{"index": 0, "text": " the"}]}) == " the"
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": None}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert finish_reason({"choices": [{"text": "", "finish_reason": "length"}]}) == "length"
    assert finish_reason({"choices": [{"text": "a"}]}) is None
    assert finish_reason({"choices": []}) is None


# ---- prompts and counts (SmolLM2's tokenizer) ----------------------------------------------
def test_count_output_tokens_prefers_what_the_server_reports(smollm2_tokenizer):
    # " hel" and "lo" are one token each, and " hello" is one token too: a model that streams
    # them as two tokens produced two, while re-tokenizing the text counts one.
    chunks = [" hel", "lo"] * 3
    usage = RequestResult(success=True, chunks=chunks, usage_output_tokens=6, usage_prompt_tokens=9)
    timed = RequestResult(success=True, chunks=chunks, server_output_tokens=6)
    bare = RequestResult(success=True, chunks=chunks + ["!"])
    failed = RequestResult(success=False, chunks=chunks)
    count_output_tokens([usage, timed, bare, failed], smollm2_tokenizer)
    assert (usage.output_tokens, usage.output_tokens_source, usage.prompt_len) == (6, "usage", 9)
    assert (timed.output_tokens, timed.output_tokens_source) == (6, "server_timings")
    assert (bare.output_tokens, bare.output_tokens_source) == (7, "chunks")
    assert [r.retokenized_tokens for r in (usage, timed, bare)] == [3, 3, 4]  # the lossy way
    assert (failed.output_tokens, failed.output_tokens_source) == (0, "")


# ---- prompts (SmolLM2's tokenizer) ---------------------------------------------------------
def test_vocab_and_special_ids(smollm2_tokenizer):
    vocab = ordinary_vocab(smollm2_tokenizer)
    specials = special_token_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.eos_token_id in specials and 0 in specials
    assert not set(specials) & set(vocab)
    assert len(vocab) > 40_000


def test_fit_prompt_hits_target(smollm2_tokenizer):
    tok = smollm2_tokenizer
    vocab = ordinary_vocab(tok)
    rng = random.Random(0)
    for target in (1, 16, 100, 300):
        ids = [rng.choice(vocab) for _ in range(target)]
        text, n = fit_prompt(tok, ids, target, rng, vocab)
        assert n == len(tok.encode(text, add_special_tokens=False))
        assert abs(n - target) <= max(1, target // 50)


def test_build_requests_lengths_and_determinism(smollm2_tokenizer):
    tok = smollm2_tokenizer
    reqs = build_requests(tok, 20, (32, 64), (5, 9), seed=3)
    assert reqs == build_requests(tok, 20, (32, 64), (5, 9), seed=3)
    assert reqs != build_requests(tok, 20, (32, 64), (5, 9), seed=4)
    for r in reqs:
        assert 31 <= r.prompt_len <= 65 and 5 <= r.output_len <= 9
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
    shared = build_requests(tok, 5, (8, 16), (4, 4), seed=0, shared_prefix_len=40)
    prefix = shared[0].prompt[:40]
    assert all(r.prompt.startswith(prefix) for r in shared)
    assert all(46 <= r.prompt_len <= 58 for r in shared)
    with pytest.raises(ValueError):
        build_requests(tok, 0, (1, 2), (1, 2))


# ---- whole runs against a fake streaming server --------------------------------------------
def _fake_app(state: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        state["bodies"].append(body)
        n = len(state["bodies"])
        if state["fail_every"] and n % state["fail_every"] == 0:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        chat = "messages" in body

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
            else:
                choice = {"index": 0, "text": text or ""}
            choice["finish_reason"] = finish
            return "data: " + json.dumps({"choices": [choice]}) + "\n\n"

        async def events() -> Any:
            if chat:
                yield "data: " + json.dumps({"choices": [{"delta": {"role": "assistant"}}]})
                yield "\n\n"
            await asyncio.sleep(0.02)  # "prefill"
            pieces = state["chunks"]
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(0.002)
                yield chunk(pieces[i % len(pieces)])
            yield chunk(None if chat else "", "length")
            if state["timings"]:  # llama.cpp's llama-server, without include_usage
                timings = {"predicted_n": body["max_tokens"]}
                yield "data: " + json.dumps({"choices": [], "timings": timings}) + "\n\n"
            if state["usage"]:
                usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, dict[str, Any]]]:
    state: dict[str, Any] = {
        "bodies": [],
        "fail_every": 0,
        "usage": True,
        "timings": False,
        "chunks": [" hello"],
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(_fake_app(state), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def server_state(fake_server):
    url, state = fake_server
    state.update(bodies=[], fail_every=0, usage=True, timings=False, chunks=[" hello"])
    return url, state


def _run(
    capsys: pytest.CaptureFixture[str], smollm2_path: str, url: str, *extra: str
) -> dict[str, Any]:
    argv = ["--base-url", url, "--tokenizer", smollm2_path, "--disable-tqdm"]
    argv += ["--num-prompts", "6", "--input-len-range", "8,24", "--output-len-range", "4,8"]
    assert serve.main(_parse(argv + list(extra))) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # the bench convention: one JSON line on stdout
    return json.loads(out)


def test_main_end_to_end(capsys, tmp_path, smollm2_path, server_state):
    url, state = server_state
    path = tmp_path / "serve.json"
    plots = tmp_path / "plots"
    line = _run(
        capsys,
        smollm2_path,
        url,
        "--max-concurrency",
        "2",
        "--slo-ttft-ms",
        "10000",
        "--slo-tpot-ms",
        "10000",
        "--label",
        "fake",
        "--output-json",
        str(path),
        "--plot-dir",
        str(plots),
    )
    assert line["bench"] == "serve" and line["label"] == "fake" and line["model"] == "fake-model"
    assert (line["completed"], line["failed"]) == (6, 0)
    assert line["request_goodput"] == line["request_throughput"] > 0
    assert line["request_rate"] == "inf" and line["max_concurrency"] == 2
    assert 0 < line["mean_ttft_ms"] < line["mean_e2el_ms"]
    assert line["mean_tpot_ms"] > 0 and line["p99_itl_ms"] > 0
    assert line["total_input_tokens"] == 6 * 7  # usage from the server wins
    assert line["early_stops"] == 0 and line["output_tokens_source"] == {"usage": 6}
    assert line["total_output_tokens"] == line["total_output_tokens_asked"]
    assert line["length_count_mismatches"] == 0

    record = json.loads(path.read_text())
    assert record["config"]["num_prompts"] == 6 and record["config"]["label"] == "fake"
    (run,) = record["runs"]
    asked = [r["output_len"] for r in run["requests"]]
    assert line["total_output_tokens"] == sum(asked)
    assert all(len(r["itl_ms"]) == r["output_tokens"] - 1 for r in run["requests"])
    assert all(r["ttft_ms"] < r["e2el_ms"] for r in run["requests"])
    body = state["bodies"][-1]  # the server saw vLLM's fields
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
    assert body["stream"] is True and body["model"] == "fake-model" and "logit_bias" not in body
    png = plots / "latency_cdf.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_sweep_chat_and_chunk_counts(capsys, tmp_path, smollm2_path, server_state):
    url, state = server_state
    state["usage"] = False
    path = tmp_path / "sweep.json"
    plots = tmp_path / "plots"
    line = _run(
        capsys,
        smollm2_path,
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--sweep-rates",
        "50,inf",
        "--logit-bias-eos",
        "--output-json",
        str(path),
        "--plot-dir",
        str(plots),
    )
    assert [s["request_rate"] for s in line["sweep"]] == [50.0, "inf"]
    assert all(s["completed"] == 6 and s["failed"] == 0 for s in line["sweep"])
    record = json.loads(path.read_text())
    assert len(record["runs"]) == 2
    for run in record["runs"]:  # no usage: " hello" chunks, one token each
        assert [r["output_tokens"] for r in run["requests"]] == [
            r["output_len"] for r in run["requests"]
        ]
        assert {r["output_tokens_source"] for r in run["requests"]} == {"chunks"}
    prompts = [b["messages"][0]["content"] for b in state["bodies"]]
    # Prompts of their own at every rate and for the test request: none of a run's prompts was
    # sent before, so none is a prefix cache hit.
    assert len(prompts) == 13 and len(set(prompts)) == 13
    assert state["bodies"][-1]["logit_bias"]["2"] == -100.0  # SmolLM2's EOS
    assert (plots / "latency_cdf.png").exists() and (plots / "sweep.png").exists()


def test_main_counts_split_tokens_without_usage(capsys, smollm2_path, server_state):
    """A server without usage (llama-cpp-python) streaming tokens that re-tokenize into fewer:
    counted per chunk, every request has the tokens it asked for; the re-tokenized text, kept as
    the cross-check, comes out short (as in the first llama.cpp serve comparison)."""
    url, state = server_state
    state.update(usage=False, chunks=[" hel", "lo"])
    line = _run(capsys, smollm2_path, url, "--max-concurrency", "3")
    asked = line["total_output_tokens_asked"]
    assert line["output_tokens_source"] == {"chunks": 6}
    assert line["total_output_tokens"] == asked and line["length_count_mismatches"] == 0
    assert line["total_output_tokens_retokenized"] < asked
    state["timings"] = True  # llama-server's timings.predicted_n outranks the chunk count
    line = _run(capsys, smollm2_path, url)
    assert line["output_tokens_source"] == {"server_timings": 6}
    assert line["total_output_tokens"] == line["total_output_tokens_asked"]


def test_main_counts_failures(capsys, smollm2_path, server_state):
    url, state = server_state
    state["fail_every"] = 3  # the test request is the 1st; the 3rd and 6th answer 503
    line = _run(capsys, smollm2_path, url, "--request-rate", "100")
    assert (line["completed"], line["failed"]) == (4, 2)
    assert line["errors"] and line["errors"][0].startswith("HTTP 503")
    assert line["request_goodput"] is None


def test_main_reports_unreachable_server(capsys, smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _parse(["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", smollm2_path])
    assert serve.main(args) == 1
    assert capsys.readouterr().out == ""
