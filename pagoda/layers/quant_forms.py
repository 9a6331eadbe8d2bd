"""The weight forms of quantized layers: how integer weights are quantized and packed, the
buffers a quantization method leaves on its layer, and the matmul over them. The methods that
choose a form per scheme are in pagoda/layers/quant.py.

Two kernel forms serve every integer scheme (torch's packed CPU ops; bf16 activations):

    int4 (group g):  w[n, k] = (code[n, k] - 8) * scale[n, k // g] + zero[n, k // g]
                     codes packed by _convert_weight_to_int4pack_for_cpu, (scale, zero) bf16
                     GGUF Q4_0 / Q4_1 / Q4_K (g = 32), int4 (g = 128, 64 or 32), AWQ, GPTQ
    int8 (group 32): w[n, k] = code[n, k] * scale[n, k // 32], code = 16 hi + lo, run as the
                     int4 op over both halves stacked along N: int8, GGUF Q8_0
    int8 (per row):  w[n, k] = code[n, k] * scale[n]   (_weight_int8pack_mm)
                     embeddings and LM heads, GGUF Q6_K / others (re-quantized per row)

On CUDA the same three forms run as Triton kernels (pagoda/kernels/quant_matmul.py), from codes
kept quantized; scales and zero points in the model's dtype:

    w4a16 (kernel "w4a16"):  qweight (N, K // 2) uint8, byte j = code[2j] | code[2j + 1] << 4,
                             scale, zero (N, K // g); every int4 form above
    w8a16 (kernel "w8a16"):  qweight (N, K) int8, scale (N, K // g); int8 and Q8_0 groups
    int8 rows (kernel "int8"): qweight (N, K) int8, weight_scale (N,), as on CPU

On CPU, where pagoda's C++ kernels build, GGUF layers and the int8 rows keep those kernels' forms
instead of torch's (pagoda/layers/cpu_forms.py).

GPTQ act-order (g_idx not sorted) permutes input channels so groups are contiguous and applies the
same permutation to x (`perm`). On devices other than CPU and CUDA the integer schemes dequantize
before the matmul (correct, not fast).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.cpu_forms import CPU_KERNELS, cpu_matmul, set_cpu_float16, set_cpu_q8

# ---------------------------------------------------------------------------------------------
# Kernels


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's packed int4 op takes this shape (rows in 16s, whole groups)."""
    return out_features % 16 == 0 and in_features % group_size == 0 and group_size % 32 == 0


def int4_pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) in [0, 15], scale / zero (N, K // g) -> (packed weight, scale_zeros (K // g, N, 2))."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).cpu().contiguous(), 1
    )
    scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_zeros


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    # x: (M, K) -> (M, N) in x's dtype
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_bf16(x), packed, group_size, scale_zeros)
    return y.to(x.dtype)


def int4_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The reference: float32 (N, K) from the unpacked form."""
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - 8) * s + z


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: (M, K), codes: (N, K) int8, scale: (N,) bf16 -> (M, N) in x's dtype
    return torch.ops.aten._weight_int8pack_mm(_bf16(x), codes, scale).to(x.dtype)


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes (N, K) int8, scale (N,) float32), w ~ codes * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quantize_int8_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int8: (codes (N, K) int8, scale (N, K // g)), w ~ codes * scale."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    codes = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale


def split_int8_groups(
    codes: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int8 as two int4 halves stacked along N, for the int4 kernel:
    c = 16 * hi + lo with hi in [-8, 7], lo in [0, 15], so
    w = c * s = (hi + 8 - 8) * 16 s + 0  +  (lo - 8) * s + 8 s.
    Returns (codes (2N, K), scale (2N, G), zero (2N, G)); y = y[:, :N] + y[:, N:]."""
    c = codes.to(torch.int16)
    hi = torch.div(c, 16, rounding_mode="floor")
    lo = c - 16 * hi
    half_codes = torch.cat([hi + 8, lo]).to(torch.uint8)
    half_scale = torch.cat([16 * scale, scale])
    half_zero = torch.cat([torch.zeros_like(scale), 8 * scale])
    return half_codes, half_scale, half_zero


def quantize_int4_groups(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit (min-max, float zero point, as GGUF Q4_1) in the int4
    kernel's form: (codes, scale, zero) with w ~ (codes - 8) * scale + zero."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1)
    scale = ((g.amax(dim=-1) - lo) / 15.0).clamp(min=1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, lo + 8 * scale


# ---------------------------------------------------------------------------------------------
# Stored forms a method leaves on its layer (buffers, so .to(device) and memory counts see them)


def triton_weights(device: torch.device) -> bool:
    """Whether integer weights on `device` take the Triton kernels' forms (CUDA)."""
    return device.type == "cuda"


def set_int4(
    layer: Any,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> None:
    device = layer.device
    if triton_weights(device):
        from pagoda.kernels.quant_matmul import pack_int4

        layer.register_buffer("qweight", pack_int4(codes).to(device))
        layer.register_buffer("scale", scale.to(layer.dtype).to(device).contiguous())
        layer.register_buffer("zero", zero.to(layer.dtype).to(device).contiguous())
        layer.register_buffer("perm", None if perm is None else perm.to(device))
        layer.group_size = group_size
        layer.kernel = "w4a16"
        return
    if device.type == "cpu":
        packed, scale_zeros = int4_pack(codes, scale, zero)
        layer.register_buffer("qweight", packed)
        layer.register_buffer("scale_zeros", scale_zeros)
    else:  # no packed kernel here yet: keep the dequantized weight
        set_dense(layer, int4_dequantize(codes, scale, zero, group_size))
    layer.register_buffer("perm", None if perm is None else perm.to(device))
    layer.group_size = group_size
    layer.kernel = "int4"


def set_int8_groups(layer: Any, codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    """Group-wise int8 (Q8_0-like): on CPU run as two int4 halves in one packed matrix."""
    device = layer.device
    if triton_weights(device):
        layer.register_buffer("qweight", codes.to(torch.int8).to(device).contiguous())
        layer.register_buffer("scale", scale.to(layer.dtype).to(device).contiguous())
        layer.group_size = group_size
        layer.kernel = "w8a16"
        return
    if device.type != "cpu":
        set_dense(layer, codes.float() * scale.repeat_interleave(group_size, dim=1))
        return
    set_int4(layer, *split_int8_groups(codes, scale), group_size)
    layer.kernel = "int8x2"


def set_dense(layer: Any, w: torch.Tensor) -> None:
    """A dequantized weight, for devices without a packed op (kernel "int4", no scales)."""
    layer.register_buffer("qweight", w.to(layer.dtype).to(layer.device))
    layer.register_buffer("scale_zeros", None)
    layer.register_buffer("perm", None)
    layer.kernel = "int4"


def set_int8(layer: Any, w: torch.Tensor) -> None:
    codes, scale = quantize_int8_rows(w)
    if cpu_kernels_for(layer) is not None:
        set_cpu_q8(layer, codes, scale[:, None])
        return
    device = layer.device
    # The CPU op takes bf16 scales; the CUDA kernel any float (kept in the model's dtype).
    scale_dtype = layer.dtype if triton_weights(device) else torch.bfloat16
    layer.register_buffer("qweight", codes.to(device))
    layer.register_buffer("weight_scale", scale.to(scale_dtype).to(device))
    layer.kernel = "int8"


def cpu_kernels_for(layer: Any) -> Any | None:
    """torch.ops.pagoda_cpu where the layer lives on CPU in torch's forms (not the Triton
    kernels') and the kernels are built and enabled, else None."""
    if layer.device.type != "cpu" or triton_weights(layer.device):
        return None
    from pagoda.kernels.cpu import kernels

    return kernels()


HALF_DTYPES = (torch.bfloat16, torch.float16)
# Opt-in: half-precision float layers on pagoda's CPU kernels (keep_cpu_float16).
HALF_KERNELS_SWITCH = "PAGODA_CPU_HALF_KERNELS"


def keep_cpu_float16(module: Any) -> bool:
    """With PAGODA_CPU_HALF_KERNELS=1: move a float layer's bfloat16 / float16 `weight` into
    pagoda's CPU kernels' float16 form (cpu_forms: cpu_bf16 / cpu_f16, 2 bytes a weight as
    before) where the layer lives on CPU and the kernels are built. Whether it did. The kernels
    compute each row alone (float32 accumulation in a fixed order), so a position's output does
    not depend on the rows beside it, as torch's half GEMMs' does (they block rows by the
    batch): a token verified among drafts or decoded in a batch gets the bits it gets alone.
    Opt-in because prefill pays: without AMX tiles the kernels' float32 FMAs take the 1.5B's
    TTFT at 512 tokens from 1.64 to 8.42 s on an AMX CPU (docs/determinism.md)."""
    w = module.weight
    if os.environ.get(HALF_KERNELS_SWITCH, "0") != "1":
        return False
    if w.dtype not in HALF_DTYPES or w.device.type != "cpu":
        return False
    from pagoda.kernels.cpu import kernels

    if kernels() is None:
        return False
    set_cpu_float16(module, take_float_weight(module))
    return True


def take_float_weight(module: Any) -> torch.Tensor:
    """Remove a module's float `weight` parameter and return its data; the module keeps its
    device and dtype (`device`, `dtype`) for the stored form that replaces it."""
    w = module.weight.data
    module.device = w.device
    module.dtype = w.dtype
    del module.weight
    return w


def apply_stored(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The matmul of whatever `set_int4` / `set_int8` left on the layer (no bias)."""
    if layer.kernel in CPU_KERNELS:
        return cpu_matmul(layer, x).to(x.dtype)
    if layer.kernel == "float":
        return F.linear(x, layer.weight)
    if layer.kernel == "w4a16":
        from pagoda.kernels.quant_matmul import w4a16_matmul

        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return w4a16_matmul(x, layer.qweight, layer.scale, layer.zero, layer.group_size)
    if layer.kernel == "w8a16":
        from pagoda.kernels.quant_matmul import w8a16_matmul

        return w8a16_matmul(x, layer.qweight, layer.scale, layer.group_size)
    if layer.kernel == "int8x2":
        y = int4_matmul(x, layer.qweight, layer.scale_zeros, layer.group_size)
        n = y.shape[-1] // 2
        return y[..., :n] + y[..., n:]
    if layer.kernel == "int4":
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        if layer.scale_zeros is None:
            return F.linear(x, layer.qweight)
        return int4_matmul(x, layer.qweight, layer.scale_zeros, layer.group_size)
    if triton_weights(x.device):
        from pagoda.kernels.quant_matmul import w8a16_matmul

        scale = layer.weight_scale[:, None]  # (N, 1): one group of K per row
        return w8a16_matmul(x, layer.qweight, scale, layer.qweight.shape[1])
    if x.device.type == "cpu":
        return int8_matmul(x, layer.qweight, layer.weight_scale)
    return F.linear(x, layer.qweight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None])


def stored_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of a module tree, each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
