"""Quantized linear layers: one method object per scheme, chosen by `--quantization`.

A method attaches to a `Linear` before the checkpoint is read (`prepare`), takes the checkpoint's
tensors for it (`load`, once per tensor and shard of a packed layer), turns them into the layout its
kernel wants once all are in (`finalize`), and runs the matmul (`apply`). Float weights that are
quantized at load (int8, int4, fp8) arrive through the layer's ordinary float `weight`; GGUF blocks
and AWQ / GPTQ tensors replace it.

The integer schemes leave one of the stored forms of pagoda/layers/quant_forms.py on their layer
(int4 groups, int8 groups, int8 rows; packed for torch's CPU ops or for the Triton kernels on
CUDA). fp8 uses torch._scaled_mm with per-row weight and per-token activation scales.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.config import QUANTIZATION_METHODS
from pagoda.layers import gguf
from pagoda.layers.cpu_forms import (
    KernelPart,
    pack_groups16,
    set_cpu_float16,
    set_cpu_k,
    set_cpu_packed,
    set_cpu_parts,
    set_cpu_q4,
    set_cpu_q5,
    set_cpu_q8,
)
from pagoda.layers.quant_forms import (
    apply_stored,
    cpu_kernels_for,
    int4_supported,
    quantize_int4_groups,
    quantize_int8_groups,
    quantize_int8_rows,
    set_int4,
    set_int8,
    set_int8_groups,
    take_float_weight,
)

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# Methods


class QuantMethod:
    """Base: float weights quantized after loading. Subclasses override what differs."""

    name: ClassVar[str]
    # Checkpoint tensors a layer takes (AWQ / GPTQ: in place of `weight`), and those it needs.
    tensor_names: ClassVar[tuple[str, ...]] = ("weight",)
    required_names: ClassVar[tuple[str, ...]] = ("weight",)
    # Whether the float `weight` parameter is dropped before loading (raw tensors replace it).
    loads_raw: ClassVar[bool] = False

    def prepare(self, layer: Any) -> None:
        if self.loads_raw:
            del layer.weight
            layer.pending = {}

    def load(self, layer: Any, name: str, tensor: Any, shard_id: str | None) -> None:
        """Keep one raw checkpoint tensor until `finalize` (only for `loads_raw` methods)."""
        layer.pending.setdefault(shard_id, {})[name] = tensor

    def finalize(self, layer: Any) -> None:
        raise NotImplementedError

    def narrow(self, name: str, tensor: Any, dim: int, start: int, length: int) -> Any:
        """A raw checkpoint tensor's tensor-parallel slice, [start, start + length) along `dim`
        of the float weight it stands for (0: output rows, 1: input columns)."""
        raise ValueError(f"{self.name} checkpoints cannot be split for tensor parallelism yet")

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return apply_stored(layer, x)

    def _pending_shards(self, layer: Any) -> list[tuple[str | None, dict[str, Any]]]:
        """Loaded tensors in packing order; ValueError if a shard is missing."""
        shards = list(getattr(layer, "output_sizes", {None: layer.output_size}))
        missing = [
            f"{s}.{n}" if s else n
            for s in shards
            for n in self.required_names
            if n not in layer.pending.get(s, {})
        ]
        if missing:
            raise ValueError(f"the checkpoint lacks quantized tensors {missing} of a layer")
        out = [(s, layer.pending[s]) for s in shards]
        del layer.pending
        return out


class Int8Method(QuantMethod):
    """Weight-only int8, symmetric with one scale per 32 input channels (as GGUF Q8_0), quantized
    from float weights at load; per output channel where the int4 op cannot take the shape."""

    name = "int8"
    group_size = 32

    def finalize(self, layer: Any) -> None:
        w = take_float_weight(layer)
        if not int4_supported(2 * layer.output_size, layer.input_size, self.group_size):
            set_int8(layer, w)
            return
        set_int8_groups(layer, *quantize_int8_groups(w, self.group_size), self.group_size)


class Int4Method(QuantMethod):
    """Weight-only int4, asymmetric group-wise with a float zero point per group of 32 inputs
    (as GGUF Q4_1), quantized from float weights at load; int8 per row where the int4 op cannot
    take the shape. On SmolLM2, groups of 64 / 128 with integer zero points gave 74% top-1
    agreement with float32; this gives the figure in tests/models/test_quant_quality.py."""

    name = "int4"

    def finalize(self, layer: Any) -> None:
        w = take_float_weight(layer)
        group = INT4_GROUP_SIZE
        if layer.input_size % group:
            raise ValueError(
                f"int4 needs an input width divisible by {group}; this layer has "
                f"{layer.input_size}: use --quantization int8"
            )
        if not int4_supported(layer.output_size, layer.input_size, group):
            logger.warning("int4: %s rows do not fit the kernel; using int8", layer.output_size)
            set_int8(layer, w)
            return
        codes, scale, zero = quantize_int4_groups(w, group)
        set_int4(layer, codes, scale, zero, group)


class FP8Method(QuantMethod):
    """float8 e4m3 weights with one scale per output channel; activations quantized per token at
    run time; torch._scaled_mm (H100 and CPU)."""

    name = "fp8"

    def finalize(self, layer: Any) -> None:
        w = take_float_weight(layer).float()
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX).to(torch.float32)
        codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        device = layer.device
        layer.register_buffer("qweight", codes.to(device))
        layer.register_buffer("weight_scale", scale[None, :].contiguous().to(device))  # (1, N)
        layer.kernel = "fp8"

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        x8 = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            x8,
            layer.qweight.t(),
            scale_a=x_scale,
            scale_b=layer.weight_scale,
            out_dtype=torch.bfloat16,
        )
        return y.to(x.dtype)


class GGUFMethod(QuantMethod):
    """GGUF blocks kept quantized.

    On pagoda's CPU kernels every type keeps its own form (cpu_forms.py): Q4_0, Q4_1, Q5_0,
    Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS the file's own numbers and bytes
    (the nibble forms), F16 / BF16 as they are (cpu_f16, cpu_bf16), Q8_0 8-bit groups
    (cpu_q8). A merged layer whose shards differ in type (Q4_K_M files store attn_v, and so
    qkv's third shard, as Q6_K) keeps each shard's form and concatenates their outputs
    (cpu_parts). Elsewhere Q4_0 / Q4_1 / Q4_K are repacked for torch's int4 op and Q8_0 / Q5_0
    / IQ4_NL as int8 codes (group 32, no re-quantization); F16 / BF16 become float; the other
    types and layers mixing the kinds re-quantized per row to int8. F32 tensors stay float."""

    name = "gguf"
    loads_raw = True

    def narrow(self, name: str, tensor: Any, dim: int, start: int, length: int) -> Any:
        return tensor.narrow(dim, start, length)  # GGUFWeight or a float tensor (F32)

    def finalize(self, layer: Any) -> None:
        parts = [tensors["weight"] for _, tensors in self._pending_shards(layer)]
        qtypes = {p.qtype if isinstance(p, gguf.GGUFWeight) else "float" for p in parts}
        if cpu_kernels_for(layer) is not None and "float" not in qtypes:
            if len(qtypes) == 1 and gguf_cpu_form(layer, parts):
                return
            if len(qtypes) > 1:
                holders = [KernelPart(layer) for _ in parts]
                if all(gguf_cpu_form(h, [p]) for h, p in zip(holders, parts)):
                    set_cpu_parts(layer, holders)
                    return
        if qtypes <= {"float", *gguf.FLOAT16_TYPES}:  # F32 tensors, F16 / BF16 blocks: float
            floats = [p.dequantize() if isinstance(p, gguf.GGUFWeight) else p for p in parts]
            w = torch.cat(floats, dim=0).to(layer.dtype)
            layer.weight = nn.Parameter(w.to(layer.device), requires_grad=False)
            layer.kernel = "float"
            return
        four_bit = qtypes <= set(gguf.FOUR_BIT_TYPES)
        if four_bit or qtypes <= set(gguf.EIGHT_BIT_TYPES):
            codes, scale, offset = _stacked_groups(parts, four_bit)
            rows = layer.output_size if four_bit else 2 * layer.output_size
            if int4_supported(rows, layer.input_size, gguf.GROUP):
                if offset is None:
                    set_int8_groups(layer, codes, scale, gguf.GROUP)
                else:  # scale * c + offset == (c - 8) * scale + (offset + 8 * scale)
                    set_int4(layer, codes, scale, offset + 8 * scale, gguf.GROUP)
                return
        floats = [p.dequantize() if isinstance(p, gguf.GGUFWeight) else p.float() for p in parts]
        set_int8(layer, torch.cat(floats, dim=0))


def _stacked_groups(
    parts: list[Any], four_bit: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The parts' group codes (layers/gguf.decode), stacked: (codes, scale, offset or None)."""
    groups = [gguf.decode(p) for p in parts]
    codes = torch.cat([g.codes for g in groups])
    scale = torch.cat([g.scale for g in groups])
    offsets = [g.offset for g in groups if g.offset is not None]
    return codes, scale, torch.cat(offsets) if four_bit else None


def _gguf_group_form(qtype: str, parts: list[Any]) -> tuple[str, torch.Tensor]:
    """Q4_0, Q5_1 or IQ4_NL parts in their nibble form: (kernel, packed)."""
    groups = [gguf.decode(p) for p in parts]
    codes = torch.cat([g.codes for g in groups])
    scale = torch.cat([g.scale for g in groups])
    if qtype == "Q4_0":  # codes in [0, 15], the offset -8 * scale
        return "cpu_q4_0", pack_groups16(codes, [scale], fifth=False)
    if qtype == "Q5_1":
        offset = torch.cat([g.offset for g in groups if g.offset is not None])
        return "cpu_q5_1", pack_groups16(codes, [scale, offset], fifth=True)
    values = torch.tensor(gguf.IQ4_VALUES, dtype=torch.int8)  # IQ4_NL: its values back to nibbles
    return "cpu_iq4nl", pack_groups16(torch.searchsorted(values, codes), [scale], fifth=False)


def gguf_cpu_form(holder: Any, parts: list[Any]) -> bool:
    """The parts (GGUFWeight, all of one type) in the CPU kernels' form for their type, on
    `holder` (a layer, a KernelPart of one, or an LM head), where quant_forms.cpu_kernels_for
    serves it; False where a 4-bit scale does not fit fp16 (the caller keeps torch's forms)."""
    qtype = parts[0].qtype
    if qtype in gguf.K_TYPES:
        ks = [gguf.decode_k(p) for p in parts]

        def stacked(name: str) -> Any:
            first = getattr(ks[0], name)
            return None if first is None else torch.cat([getattr(k, name) for k in ks])

        k = gguf.KQuantCodes(
            qtype, stacked("codes"), stacked("sc"), stacked("m"), stacked("d"), stacked("dmin")
        )
        set_cpu_k(holder, k)
        return True
    if qtype == "Q5_0":  # its own 5 bits: codes [-16, 15] back to [0, 31]
        codes, scale, _ = _stacked_groups(parts, False)
        set_cpu_q5(holder, codes.to(torch.int16) + 16, scale)
        return True
    if qtype in gguf.FLOAT16_TYPES:
        set_cpu_float16(holder, torch.cat([gguf.float16_weights(p) for p in parts]))
        return True
    if qtype in ("Q4_0", "Q5_1", "IQ4_NL"):
        kernel, packed = _gguf_group_form(qtype, parts)
        set_cpu_packed(holder, kernel, packed, sum(p.shape[0] for p in parts))
        return True
    if qtype in gguf.FOUR_BIT_TYPES:
        codes, scale, offset = _stacked_groups(parts, True)
        assert offset is not None
        return set_cpu_q4(holder, codes, scale, offset)
    if qtype in gguf.EIGHT_BIT_TYPES:
        codes, scale, _ = _stacked_groups(parts, False)
        set_cpu_q8(holder, codes, scale)
        return True
    codes, row_scale = quantize_int8_rows(torch.cat([p.dequantize() for p in parts]))
    set_cpu_q8(holder, codes, row_scale[:, None])
    return True


# (dimension of the stored tensor, indices of the float weight per entry: "1", "8" or "group")
Along = tuple[int, str] | None

# codes (N, K) uint8, scale (N, G), zero point (N, G), g_idx (K,) or None
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


class _Int4CheckpointMethod(QuantMethod):
    """AWQ / GPTQ: 4-bit codes, fp16 scales and packed zero points from the checkpoint."""

    loads_raw = True
    tensor_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    required_names: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int, bits: int = 4) -> None:
        if bits != 4:
            raise ValueError(f"{self.name} checkpoints with {bits} bits are not supported; only 4")
        if group_size <= 0:
            raise ValueError(f"{self.name} group_size must be > 0 (per-channel -1 is unsupported)")
        self.group_size = group_size

    # Each tensor's dimension (of its stored shape) for the float weight's output rows (dim 0)
    # and input columns (dim 1), and how many of the float weight's indices one entry spans
    # along it: 8 where 8 nibbles pack an int32, group_size for a per-group tensor. None: the
    # tensor is whole on every rank.
    layout: ClassVar[dict[str, tuple[Along, Along]]] = {}

    def decode(self, tensors: dict[str, torch.Tensor]) -> Decoded:
        raise NotImplementedError

    def narrow(self, name: str, tensor: Any, dim: int, start: int, length: int) -> Any:
        """Cut on whole packed ints and whole groups; the rows of a tensor-parallel shard and
        the columns of a row-parallel one."""
        along = self.layout[name][dim]
        if along is None:
            return tensor
        tensor_dim, per = along
        span = self.group_size if per == "group" else int(per)
        if start % span or length % span:
            raise ValueError(
                f"{self.name}: a tensor-parallel shard of [{start}, {start + length}) does not "
                f"fall on whole {'groups' if per == 'group' else 'packed ints'} of {span}; "
                "choose another tensor_parallel_size"
            )
        return tensor.narrow(tensor_dim, start // span, length // span)

    def finalize(self, layer: Any) -> None:
        decoded = []
        for shard, tensors in self._pending_shards(layer):
            codes, scale, zero_point, g_idx = self.decode(tensors)
            rows = layer.output_sizes[shard] if shard else layer.output_size
            k, groups = layer.input_size, layer.input_size // self.group_size
            for name, t, shape in [
                ("qweight", codes, (rows, k)),
                ("scales", scale, (rows, groups)),
                ("qzeros", zero_point, (rows, groups)),
                ("g_idx", g_idx, (k,)),
            ]:
                if t is not None and tuple(t.shape) != shape:
                    raise ValueError(
                        f"{self.name} tensor {name} of shard {shard} decodes to shape "
                        f"{tuple(t.shape)}, the layer needs {shape} with group_size "
                        f"{self.group_size}: does quantization_config match the checkpoint?"
                    )
            decoded.append((codes, scale, zero_point, g_idx))
        codes = torch.cat([d[0] for d in decoded])
        scale = torch.cat([d[1] for d in decoded]).float()
        zero_point = torch.cat([d[2] for d in decoded]).float()
        perm = _act_order_perm([d[3] for d in decoded], self.group_size, layer.input_size)
        if perm is not None:
            codes = codes[:, perm]
        if not int4_supported(layer.output_size, layer.input_size, self.group_size):
            raise ValueError(
                f"{self.name}: a layer of shape {layer.output_size}x{layer.input_size} with group "
                f"{self.group_size} does not fit the int4 kernel (rows in 16s, groups of 32k)"
            )
        # (c - z) * s == (c - 8) * s + (8 - z) * s
        set_int4(layer, codes, scale, (8 - zero_point) * scale, self.group_size, perm)


def unpack_int32(packed: torch.Tensor, dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`; nibble i (bits 4i..4i+3) holds element order[i]
    of each group of eight."""
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(dim + 1 if dim >= 0 else dim)
    shape = [1] * p.dim()
    shape[dim + 1 if dim >= 0 else dim] = 8
    vals = (p >> shifts.view(shape)) & 0xF
    out_shape = list(packed.shape)
    out_shape[dim] *= 8
    return vals.reshape(out_shape).to(torch.uint8)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column AWQ_ORDER[i]
SEQUENTIAL = (0, 1, 2, 3, 4, 5, 6, 7)


class AWQMethod(_Int4CheckpointMethod):
    """AutoAWQ GEMM checkpoints: qweight (K, N/8), qzeros (G, N/8) packed along N in AWQ's
    interleaved order, scales (G, N); w = (q - z) * s."""

    name = "awq"
    layout = {  # name: (along output rows, along input columns)
        "qweight": ((1, "8"), (0, "1")),
        "qzeros": ((1, "8"), (0, "group")),
        "scales": ((1, "1"), (0, "group")),
    }

    def decode(self, tensors: dict[str, torch.Tensor]) -> Decoded:
        q = unpack_int32(tensors["qweight"], 1, AWQ_ORDER)  # (K, N)
        z = unpack_int32(tensors["qzeros"], 1, AWQ_ORDER)  # (G, N)
        return q.t().contiguous(), tensors["scales"].t(), z.t(), None


class GPTQMethod(_Int4CheckpointMethod):
    """GPTQ (AutoGPTQ / GPTQModel): qweight (K/8, N) packed along K, qzeros (G, N/8) packed along
    N storing z - 1 (checkpoint_format gptq) or z (gptq_v2), scales (G, N), g_idx (K,) the group
    of each input channel."""

    name = "gptq"
    tensor_names = ("qweight", "qzeros", "scales", "g_idx")
    layout = {  # name: (along output rows, along input columns)
        "qweight": ((1, "1"), (0, "8")),
        "qzeros": ((1, "8"), (0, "group")),
        "scales": ((1, "1"), (0, "group")),
        "g_idx": (None, (0, "1")),
    }

    def narrow(self, name: str, tensor: Any, dim: int, start: int, length: int) -> Any:
        part = super().narrow(name, tensor, dim, start, length)
        if name != "g_idx" or dim == 0:
            return part
        # A row-parallel shard holds groups [start / g, ...) only if its channels are in order.
        first = start // self.group_size
        if not torch.equal(
            part.to(torch.int64), torch.arange(start, start + length) // self.group_size
        ):
            raise ValueError(
                "gptq: an act-order checkpoint (desc_act) cannot be split by input channels "
                "yet; run it on one rank"
            )
        return part - first

    def __init__(self, group_size: int, bits: int = 4, checkpoint_format: str = "gptq") -> None:
        super().__init__(group_size, bits)
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; gptq or gptq_v2"
            )
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0  # v1 stores z - 1

    def decode(self, tensors: dict[str, torch.Tensor]) -> Decoded:
        q = unpack_int32(tensors["qweight"], 0, SEQUENTIAL)  # (K, N)
        z = unpack_int32(tensors["qzeros"], 1, SEQUENTIAL).float() + self.zero_offset  # (G, N)
        return q.t().contiguous(), tensors["scales"].t(), z.t(), tensors.get("g_idx")


def _act_order_perm(
    g_idxs: list[torch.Tensor | None], group_size: int, in_features: int
) -> torch.Tensor | None:
    """The input permutation that makes GPTQ groups contiguous; None when they already are."""
    present = [g for g in g_idxs if g is not None]
    if not present:
        return None
    g_idx = present[0].to(torch.int64)
    if any(not torch.equal(g.to(torch.int64), g_idx) for g in present[1:]):
        raise ValueError("the shards of a packed GPTQ layer have different g_idx")
    if torch.equal(g_idx, torch.arange(in_features) // group_size):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(in_features) // group_size):
        raise ValueError(f"GPTQ g_idx does not give every group {group_size} channels")
    return perm


# ---------------------------------------------------------------------------------------------
# Whole model


def make_method(name: str, quant_config: dict[str, Any] | None = None) -> QuantMethod | None:
    """The method object for --quantization `name` (None for "none")."""
    cfg = quant_config or {}
    if name == "none":
        return None
    if name == "int8":
        return Int8Method()
    if name == "int4":
        return Int4Method()
    if name == "fp8":
        return FP8Method()
    if name == "gguf":
        return GGUFMethod()
    if name == "awq":
        return AWQMethod(int(cfg.get("group_size", 128)), int(cfg.get("bits", cfg.get("w_bit", 4))))
    if name == "gptq":
        fmt = str(cfg.get("checkpoint_format", cfg.get("format", "gptq")))
        return GPTQMethod(int(cfg.get("group_size", 128)), int(cfg.get("bits", 4)), fmt)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {name!r}")


# Schemes whose embedding and LM head are stored as int8 rows too. int8 keeps them float (as
# vLLM's weight-only schemes do): per-row int8 there costs 1% of top-1 agreement on SmolLM2;
# AWQ / GPTQ checkpoints keep them float; fp8 has no gather kernel.
QUANTIZED_EMBEDDING_METHODS = ("int4", "gguf")
