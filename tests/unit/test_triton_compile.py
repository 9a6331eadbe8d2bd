"""Ahead-of-time compile of every Triton kernel in pagoda/kernels for an H100 (sm_90), without a
GPU.

The numerical tests (test_triton_attention.py, test_triton_kernels.py) run in Triton's
interpreter, which checks none of what the compiler checks: tl.dot shapes and dtypes, casts
(fp8 included) per arch, code after a constexpr `if` that returns, shared memory. Here each kernel
goes the whole way, TTIR -> TTGIR -> LLVM IR -> PTX -> cubin (the wheel's bundled ptxas), for
GPUTarget("cuda", 90, 32), with exactly what its Python wrapper passes.

How: one subprocess per model (tests/conftest.py sets TRITON_INTERPRET in this process, and the
flag is read when pagoda.kernels is imported) runs with it unset and with a stand-in driver that
reports an sm_90 target. It calls the real wrappers (`paged_decode_attention`, `write_kv_cache`,
...) on CPU tensors laid out as the model's (q, k, v column views of one qkv tensor, block tables
views of a wider buffer), so each `kernel[grid](...)` goes through the JIT's own binder (argument
types, ints specialized when 1 or divisible by 16 unless the kernel says not to, constexprs, launch options such as
`enable_fp_fusion`) into `triton.compile(ASTSource(...), target)`, and returns the compiled kernel
instead of launching it. The subprocess prints one JSON line per (case, kernel): its constexprs,
shared memory from the kernel metadata (what the launch requests) and registers, stack and
spills from the ptxas log.

Configs: SmolLM2-135M (9 / 3 heads, head_dim 64), Qwen3-0.6B (16 / 8, 128), Llama-3.2-1B
(32 / 8, 64); bfloat16, float16 and float32; KV cache in the model dtype, int8 and
float8_e4m3fn; block_size 16 and 32; decode with one split (direct) and with `decode_num_splits` > 1 (stage 2 too, at
two split counts), prefill, KV write (alone, and fused with rotary and, for Qwen3, the per-head
q/k norm), rotary, RMSNorm (Qwen3's per-head q/k norm too), SiLU-and-mul, the fused small-batch linears
of a decode layer (RMSNorm prologue, residual-add and SiLU-and-mul epilogues); batched LoRA's
shrink and expand on the q/k/v slices (`LORA_RUNS`); weight-only w4a16 /
w8a16 GEMMs (SmolLM2 and Qwen3 layers, `QUANT_LAYERS`). The default suite compiles bfloat16
models with block_size 16; the slow tests add float16 and float32 models and block_size 32 for
SmolLM2 and Qwen3 (`SLOW_MODELS`: head_dim 64 and 128), and Llama-3.2-1B's bf16 default.

As a script, prints the table: python tests/unit/test_triton_compile.py [--slow] [model ...]
(another triton for the compile: PYTHONPATH=<dir with that triton> python tests/unit/...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# (heads, kv heads, head_dim, hidden size, intermediate size)
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "smollm2-135m": (9, 3, 64, 576, 1536),
    "qwen3-0.6b": (16, 8, 128, 1024, 3072),
    "llama3.2-1b": (32, 8, 64, 2048, 8192),
}
# DeepSeek-V3's latent attention (pagoda/kernels/latent_attention.py) at 8-way tensor
# parallelism: 16 heads a rank over one latent row of 512 + 64 values per token
LATENT_MODEL = "deepseek-v3"
LATENT_SHAPE = (16, 512, 64)  # (heads, kv_lora_rank, rope dim)
LATENT_CASES = [  # (mode, kernel) for every (block_size, kv dtype)
    ("latent_decode_direct", "_latent_decode_kernel"),
    ("latent_decode_split", "_latent_decode_kernel"),
    ("latent_decode_split", "_decode_stage2_kernel"),
    ("latent_prefill", "_latent_prefill_kernel"),
]
Config = dict[str, list[Any]]  # {"dtypes": [...], "block_sizes": [...]}
# The default suite compiles what a GPU run uses first (bf16, block 16); the slow tests compile
# the other model dtypes and block 32, so the three configs together cover every combination.
FAST: Config = {"dtypes": ["bfloat16"], "block_sizes": [16]}
SLOW: Config = {"dtypes": ["float16", "float32"], "block_sizes": [16, 32]}
SLOW_BLOCK32: Config = {"dtypes": ["bfloat16"], "block_sizes": [32]}
KV_DTYPES = ["auto", "int8", "fp8"]
H100_MAX_SHARED = (
    227 * 1024
)  # per block, the opt-in maximum (cudaDevAttrMaxSharedMemoryPerBlockOptin)
LAYER_KERNELS = ["_rms_norm_kernel", "_rotary_qk_kernel", "_silu_and_mul_kernel"]
# Weight-only quantized GEMMs (pagoda/kernels/quant_matmul.py) per model and model dtype:
# (format, group size or "row", N, K) of a real layer; the fused kernel at M = 1 and M = 16
# (M is not specialized, so both compile the one BLOCK_M = 16 variant: M = 1 was its own variant
# before) and the dequantize kernel of large M.
QUANT_LAYERS: dict[str, list[tuple[str, int | str, int, int]]] = {
    "smollm2-135m": [
        ("w4a16", 32, 3072, 576),
        ("w8a16", 32, 960, 576),
        ("w8a16", "row", 49152, 576),
    ],
    "qwen3-0.6b": [("w4a16", 128, 1024, 3072), ("w8a16", 128, 6144, 1024)],
}
QUANT_MODES = {
    "m1": "_quant_matmul_kernel",
    "m16": "_quant_matmul_kernel",
    "dequant": "_dequantize_kernel",
}
# The fused small-batch linears of a decode layer (pagoda/kernels/fused_linear.py), at M = 1:
# form -> (K, N) of the model's layer, from (hidden, q/k/v width, intermediate).
FUSED_FORMS = ["norm_qkv", "o_add", "norm_gate_up_silu", "down_add"]
# Batched LoRA (pagoda/kernels/lora.py) on the model's q/k/v slices: (tokens, rank) -> mode;
# 1 token splits K over the small token block, 200 tokens take the large block in one split.
LORA_RUNS = {(1, 8): "lora/t1_r8", (200, 64): "lora/t200_r64"}
LORA_KERNELS = ["_shrink_kernel", "_expand_kernel"]
CACHE_CASES = [  # (mode, kernel) for every (block_size, kv dtype)
    ("write", "_write_kv_cache_kernel"),
    ("rotary_write", "_rotary_write_kv_kernel"),
    ("decode_direct", "_decode_stage1_kernel"),
    ("decode_split", "_decode_stage1_kernel"),
    ("decode_split", "_decode_stage2_kernel"),
    ("prefill", "_prefill_kernel"),
]


# ---------------------------------------------------------------------------------------------
# Subprocess side: the wrappers compile for sm_90 instead of launching; JSON lines on stdout.
# ---------------------------------------------------------------------------------------------


def _ptxas_usage(log: str) -> dict[str, int]:
    import re

    usage = {}
    if m := re.search(r"Used (\d+) registers", log):
        usage["regs"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill", log):
        usage.update(stack=int(m.group(1)), spill_stores=int(m.group(2)))
        usage["spill_loads"] = int(m.group(3))
    if m := re.search(r"(\d+) bytes smem", log):
        usage["static_smem"] = int(m.group(1))
    return usage


def _worker(model: str, dtypes: list[str], kv_dtypes: list[str], block_sizes: list[int]) -> None:
    import contextlib
    import io

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "TRITON_INTERPRET must be unset"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # make_cubin prints ptxas -v; captured per kernel
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)

    class Sm90Driver:
        """All that JITFunction.run asks of the active driver up to the compile."""

        def get_current_target(self) -> GPUTarget:
            return target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

    driver.set_active(Sm90Driver())  # type: ignore[arg-type]
    case: dict[str, Any] = {}
    usage: dict[str, dict[str, int]] = {}  # kernel hash -> ptxas numbers (cache hits print no log)
    original_run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        row: dict[str, Any] = {**case, "kernel": self.fn.__name__, "triton": triton.__version__}
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):  # the ptxas log, printed by make_cubin
                kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # report it and go on with the other cases
            msg = f"{type(e).__name__}: {e}"
            if e.__cause__ is not None:
                msg += f"\ncaused by {type(e.__cause__).__name__}: {e.__cause__}"
            print(json.dumps({**row, "ok": False, "error": msg[-4000:]}), flush=True)
            return None
        usage.setdefault(kernel.hash, _ptxas_usage(log.getvalue()))
        md = kernel.metadata
        names = self.arg_names
        row.update(
            ok=len(kernel.asm.get("cubin", b"")) > 0,
            shared=md.shared,
            num_warps=md.num_warps,
            num_stages=md.num_stages,
            enable_fp_fusion=md.enable_fp_fusion,
            constexprs={
                names[k[0]]: v if isinstance(v, (int, float, str)) else str(v)
                for k, v in kernel.src.constants.items()
            },
            **usage[kernel.hash],
        )
        print(json.dumps(row), flush=True)
        return kernel

    JITFunction.run = compile_only  # type: ignore[method-assign]
    if model == LATENT_MODEL:
        _compile_latent(case, dtypes, kv_dtypes, block_sizes)
        return

    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.attention import (
        decode_num_splits,
        paged_decode_attention,
        paged_prefill_attention,
    )
    from pagoda.kernels.fused_linear import fused_linear
    from pagoda.kernels.kv_cache import write_kv_cache
    from pagoda.kernels.lora import lora_apply_triton
    from pagoda.kernels.norm import fused_add_rms_norm, rms_norm
    from pagoda.kernels.paged_cache import KVCache
    from pagoda.kernels.quant_matmul import (
        w4a16_dequantize,
        w4a16_matmul,
        w8a16_dequantize,
        w8a16_matmul,
    )
    from pagoda.kernels.rotary import rotary_qk
    from pagoda.kernels.rotary_kv_cache import rotary_write_kv_cache

    heads, kv_heads, head_dim, hidden, inter = MODELS[model]
    quant = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    n = 8  # tokens
    width = 256  # block table width: decode_num_splits caps at 32 splits
    scale = head_dim**-0.5
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        case.clear()
        case.update(model=model, dtype=dtype_name, mode="layers")
        x = torch.empty(n, hidden, dtype=dtype)
        w = torch.empty(hidden, dtype=dtype)
        rms_norm(x, w, 1e-6)
        fused_add_rms_norm(x, torch.empty_like(x), w, 1e-6)
        qkv = torch.empty(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        if model.startswith("qwen3"):  # per-head q / k norm, as Qwen3Attention.qk_transform
            rms_norm(q.reshape(-1, head_dim), torch.empty(head_dim, dtype=dtype), 1e-6)
        cos, sin = torch.empty(n, head_dim, dtype=dtype).chunk(2, dim=-1)  # as RotaryEmbedding
        rotary_qk(q, k, cos.unsqueeze(1), sin.unsqueeze(1), head_dim)
        silu_and_mul(torch.empty(n, 2 * inter, dtype=dtype))
        qkv_width = (heads + 2 * kv_heads) * head_dim
        h1 = torch.empty(1, hidden, dtype=dtype)
        norm = (torch.empty(hidden, dtype=dtype), 1e-6)
        case.update(mode="fused/norm_qkv")
        fused_linear(h1, torch.empty(qkv_width, hidden, dtype=dtype), norm=norm)
        case.update(mode="fused/o_add")
        attn1 = torch.empty(1, heads * head_dim, dtype=dtype)
        fused_linear(attn1, torch.empty(hidden, heads * head_dim, dtype=dtype), residual=h1)
        case.update(mode="fused/norm_gate_up_silu")
        fused_linear(h1, torch.empty(2 * inter, hidden, dtype=dtype), norm=norm, silu_mul=True)
        case.update(mode="fused/down_add")
        act1 = torch.empty(1, inter, dtype=dtype)
        fused_linear(act1, torch.empty(hidden, inter, dtype=dtype), residual=h1)
        offsets = [0, heads * head_dim, (heads + kv_heads) * head_dim, qkv_width]
        for (tokens, rank), mode in LORA_RUNS.items():
            case.update(mode=mode)
            lora_apply_triton(
                torch.empty(tokens, qkv_width, dtype=dtype),
                torch.empty(tokens, hidden, dtype=dtype),
                torch.empty(4, 3, rank, hidden, dtype=dtype),
                torch.empty(4, qkv_width, rank, dtype=dtype),
                torch.zeros(tokens, dtype=torch.int64),
                offsets,
            )
        case.update(mode="layers")
        for fmt, group, rows, cols in QUANT_LAYERS.get(model, []):
            g = cols if group == "row" else int(group)
            w_scale = torch.empty(rows, cols // g, dtype=dtype)
            w_zero = torch.empty_like(w_scale)
            if fmt == "w4a16":
                qw = torch.empty(rows, cols // 2, dtype=torch.uint8)
            else:
                qw = torch.empty(rows, cols, dtype=torch.int8)
            for m in (1, 16):
                case.update(mode=f"{fmt}/g{group}/m{m}")
                x = torch.empty(m, cols, dtype=dtype)
                if fmt == "w4a16":
                    w4a16_matmul(x, qw, w_scale, w_zero, g)
                else:
                    w8a16_matmul(x, qw, w_scale, g)
            case.update(mode=f"{fmt}/g{group}/dequant")
            if fmt == "w4a16":
                w4a16_dequantize(qw, w_scale, w_zero, g, dtype)
            else:
                w8a16_dequantize(qw, w_scale, g, dtype)

        q3 = q.view(n, heads, head_dim)
        k3, v3 = k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
        out = torch.empty_like(q3)
        tables = torch.zeros(16, width + 8, dtype=torch.int32)[:, :width]
        lens = torch.ones(16, dtype=torch.int32)
        for block_size in block_sizes:
            for kv in kv_dtypes:
                case.update(kv=kv, block_size=block_size, mode="write")
                cache = KVCache.allocate(4, block_size, kv_heads, head_dim, dtype, quant[kv], "cpu")
                write_kv_cache(k3, v3, cache, torch.zeros(n, dtype=torch.int64))
                case.update(mode="rotary_write")
                trig = (cos.unsqueeze(1), sin.unsqueeze(1))
                slots = torch.zeros(n, dtype=torch.int64)
                norm = None
                if model.startswith("qwen3"):  # the per-head q / k norm fused in
                    w = torch.empty(head_dim, dtype=dtype)
                    norm = (w, w, 1e-6)
                rotary_write_kv_cache(q3, k3, v3, *trig, cache, slots, norm)
                case.update(mode="decode_direct", num_splits=1)
                idx = torch.arange(4, dtype=torch.int64)
                paged_decode_attention(q3, out, cache, idx, tables[:4], lens[:4], scale, 1)
                # Batch 1 and 16: 32 splits (BLOCK_S 32) and a few (BLOCK_S 4 or 8).
                for batch in (1, 16):
                    splits = decode_num_splits(batch, kv_heads, width)
                    assert splits > 1
                    case.update(mode="decode_split", num_splits=splits)
                    q_b = torch.empty(batch, heads, head_dim, dtype=dtype)
                    idx = torch.arange(batch, dtype=torch.int64)
                    b_tables, b_lens = tables[:batch], lens[:batch]
                    out_b = torch.empty_like(q_b)
                    paged_decode_attention(q_b, out_b, cache, idx, b_tables, b_lens, scale, splits)
                del case["num_splits"]
                case.update(mode="prefill")
                starts = torch.zeros(2, dtype=torch.int32)
                ones = torch.ones(2, dtype=torch.int32)
                paged_prefill_attention(q3, out, cache, starts, ones, ones, tables[:2], n, scale)


def _compile_latent(
    case: dict[str, Any], dtypes: list[str], kv_dtypes: list[str], block_sizes: list[int]
) -> None:
    """The latent kernels' launches (subprocess side, JITFunction.run already compile-only)."""
    import torch

    from pagoda.kernels.latent_attention import latent_decode_attention, latent_prefill_attention
    from pagoda.kernels.paged_cache import KVCache

    heads, rank, rope = LATENT_SHAPE
    quant = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    n, width = 8, 256
    tables = torch.zeros(16, width + 8, dtype=torch.int32)[:, :width]
    lens = torch.ones(16, dtype=torch.int32)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        q = torch.empty(n, heads, rank + rope, dtype=dtype)
        out = torch.empty(n, heads, rank, dtype=dtype)
        for block_size in block_sizes:
            for kv in kv_dtypes:
                case.clear()
                case.update(model=LATENT_MODEL, dtype=dtype_name, kv=kv, block_size=block_size)
                cache = KVCache.allocate(
                    4, block_size, 1, rank + rope, dtype, quant[kv], "cpu", v_head_dim=0
                )
                idx = torch.arange(4, dtype=torch.int64)
                case.update(mode="latent_decode_direct", num_splits=1)
                latent_decode_attention(q, out, cache, idx, tables[:4], lens[:4], 0.1, 1)
                case.update(mode="latent_decode_split", num_splits=8)
                latent_decode_attention(q, out, cache, idx, tables[:4], lens[:4], 0.1, 8)
                del case["num_splits"]
                case.update(mode="latent_prefill")
                starts = torch.zeros(2, dtype=torch.int32)
                ones = torch.ones(2, dtype=torch.int32)
                latent_prefill_attention(q, out, cache, starts, ones, ones, tables[:2], n, 0.1)


# ---------------------------------------------------------------------------------------------
# Test side.
# ---------------------------------------------------------------------------------------------


def _bundled_ptxas() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas if ptxas.is_file() else None


def compile_model(model: str, config: Config, cache_dir: str) -> list[dict[str, Any]]:
    """Rows of the subprocess for `model`: one per (case, kernel) compiled."""
    spec = {"model": model, "kv_dtypes": KV_DTYPES, **config}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir  # a fresh cache: every kernel really compiles
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=900,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"compile worker failed:\n{proc.stderr[-6000:]}"
    return rows


def expected_cases(model: str, config: Config) -> set[tuple]:
    cases: set[tuple] = set()
    if model == LATENT_MODEL:
        for dtype in config["dtypes"]:
            for block_size in config["block_sizes"]:
                for kv in KV_DTYPES:
                    cases |= {(dtype, kv, block_size, m, kernel) for m, kernel in LATENT_CASES}
        return cases
    for dtype in config["dtypes"]:
        cases |= {(dtype, None, None, "layers", kernel) for kernel in LAYER_KERNELS}
        cases |= {(dtype, None, None, f"fused/{f}", "_fused_linear_kernel") for f in FUSED_FORMS}
        cases |= {(dtype, None, None, m, k) for m in LORA_RUNS.values() for k in LORA_KERNELS}
        for fmt, group, _, _ in QUANT_LAYERS.get(model, []):
            for mode, kernel in QUANT_MODES.items():
                cases.add((dtype, None, None, f"{fmt}/g{group}/{mode}", kernel))
        for block_size in config["block_sizes"]:
            for kv in KV_DTYPES:
                cases |= {(dtype, kv, block_size, m, kernel) for m, kernel in CACHE_CASES}
    return cases


def case_of(row: dict[str, Any]) -> tuple:
    return row["dtype"], row.get("kv"), row.get("block_size"), row["mode"], row["kernel"]


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        head = f"{r['model']:13} {r['dtype']:8} {r.get('kv', '-'):4} {r.get('block_size', '-')!s:3}"
        head += f" {r['mode'] + '/' + str(r.get('num_splits', '')):16} {r['kernel']:22}"
        if not r["ok"]:
            lines.append(f"{head} FAILED: {r.get('error', 'no cubin')}")
            continue
        lines.append(
            f"{head} shared={r['shared']:6} warps={r['num_warps']} regs={r.get('regs', '?'):>3} "
            f"stack={r.get('stack', '?')} spill={r.get('spill_stores', '?')}/"
            f"{r.get('spill_loads', '?')}"
        )
    return "\n".join(lines)


needs_ptxas = pytest.mark.skipif(
    _bundled_ptxas() is None,
    reason="triton's wheel has no bundled ptxas (triton/backends/nvidia/bin/ptxas) to build cubins",
)


def check(model: str, config: Config, rows: list[dict[str, Any]]) -> None:
    table = format_rows(rows)
    print(f"\ntriton {rows[0]['triton'] if rows else '?'}, sm_90\n{table}")
    failed = [r for r in rows if not r["ok"]]
    assert not failed, f"kernels failed to compile for sm_90:\n{format_rows(failed)}"
    missing = expected_cases(model, config) - {case_of(r) for r in rows}
    assert not missing, f"wrappers never launched: {sorted(missing, key=str)}\n{table}"
    for r in rows:
        shared = r["shared"] + r.get("static_smem", 0)
        assert shared <= H100_MAX_SHARED, f"{shared} B shared > H100's {H100_MAX_SHARED}:\n{r}"
        assert r["num_warps"] * 32 <= 1024


def _job_key(model: str, config: Config) -> str:
    return f"{model}:{json.dumps(config, sort_keys=True)}"


@pytest.fixture(scope="module")
def compiled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[list[dict[str, Any]]]]]:
    """Every compile this run selected from this module, started at once on a pool of one
    subprocess per core (a compile is one thread: LLVM, then ptxas); each test waits for its own."""
    jobs = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec"):
            params = item.callspec.params
            jobs.append((params["model"], params.get("config", FAST)))
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        futures = {
            _job_key(model, config): pool.submit(
                compile_model, model, config, str(tmp_path_factory.mktemp("triton-cache"))
            )
            for model, config in jobs
        }
        yield futures
        for future in futures.values():
            future.cancel()


# The default suite compiles SmolLM2's kernels (head_dim 64); Llama-3.2-1B (head_dim 64 too)
# and Qwen3-0.6B (head_dim 128) run with the slow tests, for the suite's time.
@needs_ptxas
@pytest.mark.parametrize(
    "model",
    [m if m == "smollm2-135m" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
    + [LATENT_MODEL],
)
def test_kernels_compile_for_h100(
    model: str, compiled: dict[str, Future[list[dict[str, Any]]]]
) -> None:
    check(model, FAST, compiled[_job_key(model, FAST)].result())


# The other model dtypes and block 32: for both head sizes (SmolLM2's 64, Qwen3's 128, the most
# shared memory); Llama-3.2-1B (head_dim 64 too, another GQA ratio) compiles the bf16 default
# above, for the suite's time.
SLOW_MODELS = ["smollm2-135m", "qwen3-0.6b"]


@pytest.mark.slow
@needs_ptxas
@pytest.mark.parametrize("model", SLOW_MODELS)
@pytest.mark.parametrize("config", [SLOW, SLOW_BLOCK32], ids=["float32", "block32"])
def test_kernels_compile_for_h100_slow(
    model: str, config: Config, compiled: dict[str, Future[list[dict[str, Any]]]]
) -> None:
    check(model, config, compiled[_job_key(model, config)].result())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        spec = json.loads(sys.argv[2])
        _worker(spec["model"], spec["dtypes"], spec["kv_dtypes"], spec["block_sizes"])
        sys.exit(0)
    args = sys.argv[1:]
    slow = "--slow" in args
    models = [a for a in args if a != "--slow"] or [*MODELS, LATENT_MODEL]
    configs = [FAST, SLOW, SLOW_BLOCK32] if slow else [FAST]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, config) in enumerate((m, c) for m in models for c in configs):
            # A fresh cache each time: a cache hit compiles nothing, so prints no ptxas numbers.
            print(format_rows(compile_model(model, config, f"{tmp}/{i}")), flush=True)
