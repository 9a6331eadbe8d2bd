"""pagoda's CPU kernels: a C++ extension (quant_gemm.cpp, float_gemm.cpp, paged_attention.cpp,
row_ops.cpp, lora.cpp, race.cpp) built on first use with torch's cpp_extension and cached
(TORCH_EXTENSIONS_DIR, by default under ~/.cache/torch_extensions), with a log line saying so;
`python -m pagoda.kernels.cpu` builds it ahead (the Makefile's setup does). Where there is no C++
compiler, `kernels()` is None and pagoda keeps its torch path, with a warning. Where a compiler
is there but the build fails (a compile error, missing Python headers), that is an error, logged
with the compiler's output, and pagoda keeps its torch path too.

PAGODA_CPU_KERNELS: `1` (the default) uses them where they build; `0` turns them off (the
quantized layers keep torch's packed forms instead, bf16 activations; read at load, so the
switch takes effect for engines built after it is set); `require` raises where they cannot be
built, for whatever reason (`make test` and CI set it). `built()` gives the ops whatever the
switch says (the tests use it).

The kernels are torch custom ops (torch.ops.pagoda_cpu, so torch.compile keeps them in its
graph): `q4x16_matmul(x, packed, n, isa_limit, form)` and `q8x16_matmul(x, packed, scales, n,
isa_limit)`, y = x @ w^T in float32 for the nibble forms (4- to 6-bit codes, GGUF's types as the
file holds them; `form` names one, layers/cpu_forms.NIBBLE_FORMS) and 8-bit codes in tiles of 16
rows (laid out in quant_gemm.cpp, packed by layers/cpu_forms.py), with x quantized per 32-wide
group to int8; `f16x16_matmul(x, packed, n, isa_limit, bf16)` (float_gemm.cpp) for GGUF's F16 and
BF16 weights as the file holds them, x float32;
`paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, isa_limit,
value_dim=0, k_scale=None, v_scale=None)` (one query row per request) and `paged_attention(q,
k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, isa_limit, value_dim=0,
k_scale=None, v_scale=None)` (any mix of prefill chunks and
decodes) over a paged cache read as stored (float32 in place; bfloat16, float16, and int8 or
float8_e4m3fn with k_scale / v_scale per token and kv head, converted a chunk of positions at a
time by kv_rows.h), each row reduced the same way whatever the
rows beside it (window > 0: a sliding window, the row at position p attending to its last
`window` positions; 0: full causal attention; value_dim > 0: a latent cache, MLA's, whose values
are the first value_dim of each key row); `rms_norm`, `add_rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul` and `rotary` (row_ops.cpp), which eager
and compiled steps share, so that the two compute the same bits, and `q4x16_matmul_norm` /
`q8x16_matmul_norm` / `q4x16_matmul_silu` / `q8x16_matmul_silu`, the matmuls with the norm or
the activation before them in one call, and `q4x16_matmul_norm_silu(x, residual, weight, eps,
packed, n, isa_limit, form)`, a gate | up projection with its norm before and SiLU-and-mul after
(-> (silu(gate) * up, x + residual), the bits of the norm op, the matmul and silu_and_mul, without
the (T, n) product written out); `lora_apply(y, x, a, b, slots, offsets, isa_limit)`
(lora.cpp), layers/lora.py's batched LoRA product added into y in place, x and y float32, A and
B float32, bfloat16 or float16 (widened as they are read), each slot's A and B read once a step
for all its tokens, which the six quantized matmuls also take inside their own call through
their optional trailing `lora_a, lora_b, lora_slots, lora_offsets` (lora.h: the same bits);
`race_sample(logits, inv_temperature, seed, isa_limit)` (race.cpp), the sampler's exponential
race for rows without a seed of their own, its noise counter-based (a function of seed, a
one-element int64 tensor, row and token), so the rows split across threads; `isa()` names the instruction set picked at run time (0
scalar, 1 AVX2 + FMA, 2 AVX-512 VNNI, under which the attention runs AVX-512 F); `isa_limit`
caps it (tests run every path). The quantized matmuls also take isa_limit 3: their passes of
16 rows and more then run on the tile unit (AMX-INT8, where the CPU has it and Linux grants it;
`amx()` says whether it does, PAGODA_CPU_AMX=0 turns it off) with the VNNI path's bits, every
quantized form (the integer dot products are exact, the float epilogue VNNI's).
ATEN_CPU_CAPABILITY, torch's switch, caps it for the whole
process (`avx2`: AVX2 + FMA, `default`: scalar), as it caps torch's kernels and the code
torch.compile generates: so an AVX-512 machine runs and measures the AVX2 path end to end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "quant_gemm.cpp",
        "float_gemm.cpp",
        "paged_attention.cpp",
        "row_ops.cpp",
        "lora.cpp",
        "race.cpp",
    )
]
HEADERS = [Path(__file__).with_name(n) for n in ("common.h", "kv_rows.h", "lora.h")]
ISA_NAMES = ("scalar", "AVX2 + FMA", "AVX-512 VNNI")
_lock = threading.Lock()
_state: dict[str, Any] = {}


SWITCH = "PAGODA_CPU_KERNELS"


class KernelBuildError(RuntimeError):
    """The kernels could not be built and PAGODA_CPU_KERNELS=require asks for them."""


def kernels() -> Any | None:
    """The ops for the layers to use: None with PAGODA_CPU_KERNELS=0 or where they cannot be
    built; with PAGODA_CPU_KERNELS=require, a KernelBuildError where they cannot be."""
    switch = os.environ.get(SWITCH, "1")
    if switch == "0":
        return None
    ops = built()
    if ops is None and switch == "require":
        raise KernelBuildError(f"{SWITCH}=require, but {_state['why']}")
    return ops


def built() -> Any | None:
    """torch.ops.pagoda_cpu once built (or loaded from the cache), None where they cannot be
    (logged once: a warning without a compiler, an error where the build failed)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def compiler() -> str | None:
    """The C++ compiler torch's cpp_extension runs ($CXX, else c++), where it is installed."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _build() -> Any | None:
    cxx = compiler()
    if cxx is None:
        _state["why"] = f"there is no C++ compiler ({os.environ.get('CXX', 'c++')} not found)"
        logger.warning(
            "CPU kernels not built: %s; using torch's quantized ops (install g++ for pagoda's "
            "kernels)",
            _state["why"],
        )
        return None
    try:
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        cpp_extension.load(
            name="pagoda_cpu_kernels",
            sources=[str(p) for p in SOURCES],
            # the headers' hash among the flags: the extension cache rebuilds when it changes
            extra_cflags=["-O3", "-fopenmp", "-std=c++17", f"-DPAGODA_COMMON_H={_header_hash()}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - a compile error, no headers: the torch path stays
        _state["why"] = f"the build with {cxx} failed: {e}"
        logger.error("CPU kernels failed to build; using torch's quantized ops. %s", _state["why"])
        return None
    ops = torch.ops.pagoda_cpu
    _register_fakes()
    logger.info(
        "CPU kernels ready (%s, %.1f s: built or loaded from the extension cache)",
        ISA_NAMES[ops.isa()],
        time.perf_counter() - t0,
    )
    return ops


def _header_hash() -> str:
    return hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing."""
    _register_matmul_fakes()
    _register_fused_matmul_fakes()
    _register_attention_fakes()
    _register_row_op_fakes()
    _register_lora_fake()
    _register_race_fake()


def _register_matmul_fakes() -> None:
    """The matmuls: y = x @ w^T in float32 (the quantized ones' optional lora_a, lora_b,
    lora_slots, lora_offsets: `*lora`, the dispatcher passes them by position)."""

    @torch.library.register_fake("pagoda_cpu::q4x16_matmul")  # type: ignore[misc]
    def _q4(x: Any, packed: Any, n: int, isa_limit: int, form: int, *lora: Any) -> Any:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("pagoda_cpu::f16x16_matmul")  # type: ignore[misc]
    def _f16(x: Any, packed: Any, n: int, isa_limit: int, bf16: bool) -> Any:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("pagoda_cpu::q8x16_matmul")  # type: ignore[misc]
    def _q8(x: Any, packed: Any, scales: Any, n: int, isa_limit: int, *lora: Any) -> Any:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)


def _register_fused_matmul_fakes() -> None:
    """The matmuls with the norm or the activation before them in one call."""

    @torch.library.register_fake("pagoda_cpu::q4x16_matmul_norm")  # type: ignore[misc]
    def _q4_norm(
        x: Any,
        residual: Any,
        weight: Any,
        eps: float,
        packed: Any,
        n: int,
        isa_limit: int,
        form: int,
        *lora: Any,
    ) -> Any:
        return x.new_empty((x.shape[0], n)), x.new_empty(x.shape)

    @torch.library.register_fake("pagoda_cpu::q8x16_matmul_norm")  # type: ignore[misc]
    def _q8_norm(
        x: Any,
        residual: Any,
        weight: Any,
        eps: float,
        packed: Any,
        scales: Any,
        n: int,
        isa_limit: int,
        *lora: Any,
    ) -> Any:
        return x.new_empty((x.shape[0], n)), x.new_empty(x.shape)

    @torch.library.register_fake("pagoda_cpu::q4x16_matmul_norm_silu")  # type: ignore[misc]
    def _q4_norm_silu(
        x: Any, residual: Any, w: Any, eps: float, packed: Any, n: int, *rest: Any
    ) -> Any:
        return x.new_empty((x.shape[0], n // 2)), x.new_empty(x.shape)  # (silu(gate) * up, h)

    @torch.library.register_fake("pagoda_cpu::q4x16_matmul_silu")  # type: ignore[misc]
    def _q4_silu(x: Any, packed: Any, n: int, isa_limit: int, form: int, *lora: Any) -> Any:
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("pagoda_cpu::q8x16_matmul_silu")  # type: ignore[misc]
    def _q8_silu(x: Any, packed: Any, scales: Any, n: int, isa_limit: int, *lora: Any) -> Any:
        return x.new_empty((x.shape[0], n))


def _register_attention_fakes() -> None:
    """The paged attentions: (rows, heads, value_dim or head_dim)."""

    @torch.library.register_fake("pagoda_cpu::paged_decode_attention")  # type: ignore[misc]
    def _attention(
        q: Any,
        k: Any,
        v: Any,
        tables: Any,
        lens: Any,
        scale: float,
        window: int,
        isa_limit: int,
        value_dim: int = 0,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> Any:
        return q.new_empty((*q.shape[:2], value_dim or q.shape[2]))

    @torch.library.register_fake("pagoda_cpu::paged_attention")  # type: ignore[misc]
    def _rows(
        q: Any,
        k: Any,
        v: Any,
        tables: Any,
        starts: Any,
        lens: Any,
        scale: float,
        window: int,
        isa_limit: int,
        value_dim: int = 0,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> Any:
        return q.new_empty((*q.shape[:2], value_dim or q.shape[2]))


def _register_row_op_fakes() -> None:
    """The row ops of row_ops.cpp."""

    @torch.library.register_fake("pagoda_cpu::rms_norm")  # type: ignore[misc]
    def _rms_norm(x: Any, weight: Any, eps: float, isa_limit: int) -> Any:
        return x.new_empty(x.shape)

    @torch.library.register_fake("pagoda_cpu::add_rms_norm")  # type: ignore[misc]
    def _add_rms_norm(x: Any, residual: Any, weight: Any, eps: float, isa_limit: int) -> Any:
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("pagoda_cpu::silu_and_mul")  # type: ignore[misc]
    def _silu_and_mul(x: Any, isa_limit: int) -> Any:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("pagoda_cpu::gelu_tanh_and_mul")  # type: ignore[misc]
    def _gelu_tanh_and_mul(x: Any, isa_limit: int) -> Any:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("pagoda_cpu::rotary")  # type: ignore[misc]
    def _rotary(x: Any, cos: Any, sin: Any, head_dim: int, isa_limit: int) -> Any:
        return x.new_empty(x.shape)


def _register_lora_fake() -> None:
    """lora_apply (lora.cpp) writes y in place and returns nothing."""

    @torch.library.register_fake("pagoda_cpu::lora_apply")  # type: ignore[misc]
    def _lora_apply(
        y: Any, x: Any, a: Any, b: Any, slots: Any, offsets: list[int], isa_limit: int
    ) -> None:
        return None


def _register_race_fake() -> None:
    """race_sample (race.cpp): one token id per row."""

    @torch.library.register_fake("pagoda_cpu::race_sample")  # type: ignore[misc]
    def _race(logits: Any, inv_temperature: Any, seed: Any, isa_limit: int) -> Any:
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)
