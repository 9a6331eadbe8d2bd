"""Ahead-of-time compile of every Triton kernel in pagoda/kernels for an H100 (sm_90), on a
machine without a GPU.

The numerical tests (test_triton_attention.py, test_triton_kernels.py) run in Triton's
interpreter, which checks none of what the real compiler checks: tl.dot shapes and dtypes,
constexpr typing, fp8 conversions per arch, shared memory. Here each kernel goes through the whole
CUDA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin by the wheel's bundled ptxas) for
GPUTarget("cuda", 90, 32) with exactly what its Python wrapper passes.

How: a subprocess per model config (the interpreter flag is read when pagoda.kernels is imported,
and tests/conftest.py sets it in this process) with TRITON_INTERPRET unset and a stand-in driver
that reports an sm_90 target. It calls the real wrappers (`paged_decode_attention`, ...) on CPU
tensors shaped like the model's (q, k, v as column views of one qkv tensor, block tables as views
of wider buffers); every `kernel[grid](...)` then runs the JIT's own binder - argument types,
int == 1 / divisible-by-16 specialization, constexprs, launch options such as
`enable_fp_fusion` - and compiles through `triton.compile(ASTSource(...), target=sm_90)`, but
returns instead of launching. The subprocess prints one JSON line per compiled kernel: its
constexprs, shared memory from the kernel metadata, and registers / spills from the cubin
(`cuobjdump --dump-resource-usage`).

Configs: SmolLM2-135M (9 / 3 heads, head_dim 64), Qwen3-0.6B (16 / 8, 128), Llama-3.2-1B
(32 / 8, 64); bfloat16 and float16 (float32 with the slow ones); KV cache in the model dtype,
int8 and float8_e4m3fn; block_size 16 (32 slow); decode with one split (direct) and with
`decode_num_splits` > 1 (stage 2 too), prefill, KV write, rotary, RMSNorm, SiLU-and-mul.

Run as a script to see the table: python tests/unit/test_triton_compile.py [model ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Heads, kv heads, head_dim, hidden size, intermediate size.
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "smollm2-135m": (9, 3, 64, 576, 1536),
    "qwen3-0.6b": (16, 8, 128, 1024, 3072),
    "llama3.2-1b": (32, 8, 64, 2048, 8192),
}
# H100: 227 KB of shared memory per block (opt-in maximum), 255 registers per thread.
H100_MAX_SHARED = 227 * 1024
MAX_REGS = 255
DTYPES = ("bfloat16", "float16")
SLOW_DTYPES = ("float32",)
KV_DTYPES = ("auto", "int8", "fp8")
BLOCK_SIZES = (16,)
SLOW_BLOCK_SIZES = (32,)


# ------------------------------------------------------------------------------------------
# Subprocess side: compile with the real wrappers, print JSON lines.
# ------------------------------------------------------------------------------------------


def _resource_usage(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's one kernel, from cuobjdump."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _compile_model(model: str, dtypes: list[str], kv_dtypes: list[str], block_sizes: list[int]):
    """Run every wrapper for `model` with the kernel launches replaced by sm_90 compiles; one
    JSON line per (case, kernel) on stdout."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run with TRITON_INTERPRET unset"
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)

    class _Sm90Driver:
        """What JITFunction.run asks of the active driver before it compiles."""

        def get_current_target(self) -> GPUTarget:
            return target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

    driver.set_active(_Sm90Driver())  # type: ignore[arg-type]
    cuobjdump = str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")

    case: dict[str, Any] = {}
    original_run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any):
        name = self.fn.__name__
        t0 = time.perf_counter()
        try:
            kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # report, and go on with the other cases
            msg = f"{type(e).__name__}: {e}"
            if e.__cause__ is not None:
                msg += f"\ncaused by {type(e.__cause__).__name__}: {e.__cause__}"
            print(json.dumps({**case, "kernel": name, "ok": False, "error": msg[-3000:]}))
            sys.stdout.flush()
            return None
        md = kernel.metadata
        src = kernel.src
        names = self.arg_names
        constexprs = {
            names[k[0]]: (v if isinstance(v, (int, float, bool, str)) else str(v))
            for k, v in src.constants.items()
        }
        row = {
            **case,
            "kernel": name,
            "ok": "cubin" in kernel.asm and len(kernel.asm["cubin"]) > 0,
            "seconds": round(time.perf_counter() - t0, 2),
            "shared": md.shared,
            "num_warps": md.num_warps,
            "num_stages": md.num_stages,
            "enable_fp_fusion": md.enable_fp_fusion,
            "constexprs": constexprs,
            "signature": {k: v for k, v in src.signature.items() if v != "constexpr"},
            **_resource_usage(kernel.asm["cubin"], cuobjdump),
        }
        print(json.dumps(row))
        sys.stdout.flush()
        return kernel

    JITFunction.run = compile_only  # type: ignore[method-assign]

    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.attention import (
        decode_num_splits,
        paged_decode_attention,
        paged_prefill_attention,
    )
    from pagoda.kernels.kv_cache import write_kv_cache
    from pagoda.kernels.norm import fused_add_rms_norm, rms_norm
    from pagoda.kernels.rotary import rotary_qk
    from pagoda.layers.attention import KVCache

    heads, kv_heads, head_dim, hidden, inter = MODELS[model]
    quant = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    num_tokens = 8
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        case.clear()
        case.update(model=model, dtype=dtype_name)
        # Layers: as the model calls them (qkv columns, Qwen3's per-head q/k norm).
        x = torch.empty(num_tokens, hidden, dtype=dtype)
        w = torch.empty(hidden, dtype=dtype)
        rms_norm(x, w, 1e-6)
        fused_add_rms_norm(x, x.clone(), w, 1e-6)
        qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        if model.startswith("qwen3"):
            rms_norm(q.reshape(-1, head_dim), torch.empty(head_dim, dtype=dtype), 1e-6)
        cos, sin = torch.empty(num_tokens, head_dim, dtype=dtype).chunk(2, dim=-1)
        rotary_qk(q, k, cos.unsqueeze(1), sin.unsqueeze(1), head_dim)
        silu_and_mul(torch.empty(num_tokens, 2 * inter, dtype=dtype))

        q3 = q.view(num_tokens, heads, head_dim)
        k3 = k.view(num_tokens, kv_heads, head_dim)
        v3 = v.view(num_tokens, kv_heads, head_dim)
        out = torch.empty_like(q3)
        for block_size in block_sizes:
            for kv_name in kv_dtypes:
                case.update(kv=kv_name, block_size=block_size)
                cache = KVCache.allocate(4, block_size, kv_heads, head_dim, dtype, quant[kv_name], "cpu")
                case.update(mode="write")
                write_kv_cache(k3, v3, cache, torch.zeros(num_tokens, dtype=torch.int64))
                # Decode: 4 sequences, tables as views of a wider buffer.
                width = 256
                tables = torch.zeros(4, width + 8, dtype=torch.int32)[:, :width]
                token_idx = torch.arange(4, dtype=torch.int64)
                seq_lens = torch.ones(4, dtype=torch.int32)
                scale = head_dim**-0.5
                case.update(mode="decode_direct", num_splits=1)
                paged_decode_attention(q3, out, cache, token_idx, tables, seq_lens, scale, 1)
                splits = decode_num_splits(1, kv_heads, width)
                case.update(mode="decode_split", num_splits=splits)
                paged_decode_attention(q3, out, cache, token_idx, tables, seq_lens, scale, splits)
                del case["num_splits"]
                case.update(mode="prefill")
                paged_prefill_attention(
                    q3,
                    out,
                    cache,
                    torch.zeros(2, dtype=torch.int32),
                    torch.ones(2, dtype=torch.int32),
                    torch.ones(2, dtype=torch.int32),
                    tables[:2],
                    num_tokens,
                    scale,
                )
                for key in ("kv", "block_size", "mode"):
                    del case[key]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    spec = json.loads(sys.argv[2])
    _compile_model(spec["model"], spec["dtypes"], spec["kv_dtypes"], spec["block_sizes"])
    sys.exit(0)
