"""Linear layers whose parameters load from HF checkpoints, including packed projections.

`Linear` holds one HF projection. `MergedLinear` packs several projections that read the same
input (q/k/v, gate/up) into one weight, so one GEMM replaces several; each HF shard is copied
into its row slice by `weight_loader(param, loaded, shard_id)`:

    weight rows:  [0, n_q) q | [n_q, n_q + n_k) k | [n_q + n_k, n_q + n_k + n_v) v

Under tensor parallelism (layers/parallel.py) a layer holds a slice of the checkpoint's matrix:
`in_part` (row-parallel: its input columns; the partial products are all-reduced in forward)
or `out_parts` (column-parallel: each shard's output rows). Sizes are the rank's own; `load`
cuts each checkpoint tensor to the slice before it is stored or quantized.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.cpu_forms import (
    CPU_KERNELS,
    cpu_matmul,
    cpu_matmul_norm,
    cpu_matmul_norm_silu,
    cpu_matmul_silu,
)
from pagoda.layers.lora import LoRAWeights
from pagoda.layers.parallel import SINGLE, TensorParallel
from pagoda.layers.quant import QuantMethod
from pagoda.layers.quant_forms import apply_stored, keep_cpu_float16

Part = tuple[int, int]  # (start, length) along one dimension of a checkpoint tensor


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(src.shape)}, "
            f"the model expects {tuple(dst.shape)}: does the checkpoint match its config?"
        )
    with torch.no_grad():
        dst.copy_(src)


class Linear(nn.Module):
    """y = x W^T + b with W: (output_size, input_size), as torch.nn.Linear and HF store it.

    With a quantization method set (`set_quant_method`, before loading) the method owns the
    weight: it stores it in its own form and runs the matmul; the bias stays float.
    """

    quant_method: QuantMethod | None = None
    # A float layer's stored form when it has one (quant_forms.keep_cpu_float16), else None.
    kernel: str | None = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
        in_part: Part | None = None,
        out_part: Part | None = None,
    ) -> None:
        """in_part: row-parallel, the checkpoint's input columns this rank holds; out_part:
        column-parallel, its output rows (sizes are the rank's own)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype)) if bias else None
        self.tp = tp
        # The adapter slots of an engine serving LoRA (layers/lora.py; runner/lora.py sets
        # them): a submodule once set, so an instance attribute, not a class one.
        self.lora: LoRAWeights | None = None
        self.in_part = in_part if tp.size > 1 else None
        self.out_parts: dict[str | None, Part] | None = None
        if out_part is not None and tp.size > 1:
            assert out_part[1] == output_size
            self.out_parts = {None: out_part}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, input_size) -> (num_tokens, output_size)
        plain = self.quant_method is None and self.kernel is None and self.in_part is None
        if plain and self.lora is None:
            return F.linear(x, self.weight, self.bias)
        lora = self.lora
        if self._lora_cpu():  # the adapters' products inside the matmul's call
            y, lora = cpu_matmul(self, x, lora).to(x.dtype), None
        elif self.quant_method is not None:
            y = self.quant_method.apply(self, x)
        elif self.kernel is not None:
            y = apply_stored(self, x)
        else:
            y = F.linear(x, self.weight)
        if lora is not None:  # before the sum: sum over ranks of B (A_r x_r) is B A x
            y = lora.add_to(y, x)
        if self.in_part is not None:  # row-parallel: sum the ranks' partial products, then bias
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def after_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), as a decoder layer feeds its projections:
        `norm` an RMSNorm, residual None for the first layer (then x itself is returned). On
        pagoda's CPU kernels the norm runs inside the matmul's call (cpu_forms.cpu_matmul_norm):
        one op in a compiled step."""
        if self._fused_cpu(x) and getattr(norm, "cpu_kernel", False):
            y, hidden = cpu_matmul_norm(self, x, residual, norm, self.lora)
            return self._finish(y.to(x.dtype)), hidden
        if residual is None:
            return self(norm(x)), x
        normed, hidden = norm(x, residual)
        return self(normed), hidden

    def gated_after_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, act: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(act(self(norm(x + residual))), x + residual) in one call where this gate | up
        layer's CPU kernels can run the SiLU after the matmul (cpu_forms.cpu_matmul_norm_silu:
        no adapters, no bias, a nibble form); None elsewhere, for after_norm and the next
        projection's after_act."""
        fusable = (
            self._fused_cpu(x)
            and self.lora is None
            and self.bias is None
            and getattr(norm, "cpu_kernel", False)
            and isinstance(act, SiluAndMul)
            and act.cpu_kernel
        )
        if not fusable:
            return None
        return cpu_matmul_norm_silu(self, x, residual, norm)

    def after_act(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """self(act(x)); a SiluAndMul `act` in the same call on pagoda's CPU kernels."""
        if self._fused_cpu(x) and isinstance(act, SiluAndMul) and act.cpu_kernel:
            return self._finish(cpu_matmul_silu(self, x, self.lora).to(x.dtype))
        return self(act(x))

    def _fused_cpu(self, x: torch.Tensor) -> bool:
        """Whether a row op can run inside this layer's CPU-kernel matmul: its weight is in the
        kernels' form, it is whole (no row-parallel sum), its adapters (if it serves any) take
        the C++ route (their products join the call) and x is float32."""
        return (
            getattr(self, "kernel", None) in CPU_KERNELS
            and self.in_part is None
            and (self.lora is None or self.lora.cpu_kernel)
            and x.dtype == torch.float32
        )

    def _lora_cpu(self) -> bool:
        """Whether this layer's adapters run inside its CPU-kernel matmul's call (cpu_forms.
        cpu_matmul): its weight is in the kernels' form and its adapters take the C++ route."""
        return (
            self.lora is not None
            and self.lora.cpu_kernel
            and getattr(self, "kernel", None) in CPU_KERNELS
        )

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def lora_slice(self, shard_id: str | None) -> int:
        """The index of a shard's slice in this layer's adapter slots (0: a plain layer)."""
        return 0

    def shard(self, name: str, tensor: Any, shard_id: str | None) -> Any:
        """The rank's slice of checkpoint tensor `name`: output rows of `shard_id` (column-
        parallel) or input columns (row-parallel; a bias is whole). Raw quantized tensors are
        cut by their method, which knows their layout."""
        if self.in_part is None and self.out_parts is None:
            return tensor
        if name == "bias":
            if self.out_parts is None:
                return tensor
            start, length = self.out_parts[shard_id]
            return tensor.narrow(0, start, length)
        if self.in_part is not None:
            dim, (start, length) = 1, self.in_part
        else:
            assert self.out_parts is not None
            dim, (start, length) = 0, self.out_parts[shard_id]
        if self.quant_method is not None and self.quant_method.loads_raw:
            return self.quant_method.narrow(name, tensor, dim, start, length)
        return tensor.narrow(dim, start, length)

    def set_quant_method(self, method: QuantMethod) -> None:
        self.device = self.weight.device
        self.dtype = self.weight.dtype
        self.quant_method = method
        method.prepare(self)

    def required_tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors this layer needs besides its bias."""
        return ("weight",) if self.quant_method is None else self.quant_method.required_names

    def load(self, name: str, tensor: Any, shard_id: str | None = None) -> None:
        """Take checkpoint tensor `<layer>.<name>` (of shard `shard_id` in a packed layer)."""
        tensor = self.shard(name, tensor, shard_id)
        if self.quant_method is not None and self.quant_method.loads_raw and name != "bias":
            if name not in self.quant_method.tensor_names:
                raise ValueError(
                    f"a {self.quant_method.name} layer takes {self.quant_method.tensor_names}, "
                    f"not {name!r}: does the checkpoint match --quantization?"
                )
            self.quant_method.load(self, name, tensor, shard_id)
            return
        param = getattr(self, name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"a linear layer has no tensor {name!r}")
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()  # a GGUF block tensor for a float layer
        self.weight_loader(param, tensor, shard_id)

    def finalize(self) -> None:
        """After every tensor is loaded: let the method build its stored form; a half-precision
        float weight on CPU takes the CPU kernels' float16 form."""
        if self.quant_method is not None:
            self.quant_method.finalize(self)
        else:
            keep_cpu_float16(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        assert shard_id is None, "Linear holds a single projection"
        _copy_checked(param.data, loaded, "a linear layer")

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quant={self.quant_method.name}"
        return f"{self.input_size}, {self.output_size}, bias={self.bias is not None}{quant}"


class MergedLinear(Linear):
    """Several column projections of the same input, packed along the output dimension.

    `output_sizes` maps each shard id (e.g. "q", "k", "v") to its number of output rows, in
    packing order. `forward` returns the packed output; callers split it with `output_sizes`.
    Column-parallel: `out_parts` maps each shard id to the (start, length) of its checkpoint
    rows this rank holds (length == output_sizes[shard]).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: dict[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
        out_parts: dict[str, Part] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias=bias, dtype=dtype, tp=tp)
        if out_parts is not None and tp.size > 1:
            assert {s: n for s, (_, n) in out_parts.items()} == output_sizes
            self.out_parts = {shard: part for shard, part in out_parts.items()}
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size

    def lora_slice(self, shard_id: str | None) -> int:
        return list(self.output_sizes).index(str(shard_id))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id not in self.output_sizes:
            raise ValueError(
                f"unknown shard {shard_id!r} for a packed layer with shards {list(self.output_sizes)}"
            )
        start = self.shard_offsets[shard_id]
        rows = param.data.narrow(0, start, self.output_sizes[shard_id])
        _copy_checked(rows, loaded, f"shard {shard_id!r} of a packed layer")

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quant={self.quant_method.name}"
        return f"{self.input_size}, {self.output_sizes}, bias={self.bias is not None}{quant}"
