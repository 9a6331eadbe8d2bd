"""Batched LoRA: the products of many adapters in one step, grouped by adapter.

Every decoder projection (layers/linear.py) of an engine started with LoRA holds a
`LoRAWeights`: the adapter slots' A and B matrices, stacked, one slot per loaded adapter
(runner/lora.py fills and evicts them). A step tells each token's slot in one shared index
tensor (`slots`, -1: the base model alone), and the layer adds

    y[t, o0:o1] += B[s, o0:o1] @ (A[s, l] @ x[t])        s = slots[t], slice l = [o0, o1)

to its base product `y`, before a row-parallel layer's all-reduce (the sum over ranks of
B (A_r x_r) is B (A x)). A packed layer (q/k/v, gate/up) has one slice per shard: `offsets`
holds the slices' first output rows, then the layer's width. B holds the adapter's scaling
(alpha / r, or alpha / sqrt(r) for rsLoRA) and ranks below the table's are zero-padded, so a
padded rank adds exact zeros.

Shapes: x (T, K); y (T, N), contiguous; a (S, L, R, K); b (S, N, R); slots (T,) int64. For
the C++ kernel, `LoRAWeights` stores b by rank (the transpose of an (S, R, N) tensor).
`lora_reference` is the torch reference; `lora_apply` runs pagoda's C++ kernel on CPU
(kernels/cpu/lora.cpp) and the Triton kernel on CUDA (kernels/lora.py), both tested against
the reference. A layer whose weight is in a quantized CPU-kernel form hands its slots to its
matmul's own op instead (layers/cpu_forms.cpu_matmul; kernels/cpu/lora.h), with the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

# a and b's dtypes pagoda's CPU kernel reads as stored (widened to float32 as it loads them; x
# and y float32)
CPU_KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: list[int],
) -> None:
    """In place on y: each token's adapter product (module docstring), one masked product
    per slot; computed in float32."""
    xf = x.float()
    for s in range(a.shape[0]):
        mask = (slots == s).unsqueeze(1)  # (T, 1)
        h = torch.einsum("tk,lrk->tlr", xf, a[s].float())  # (T, L, R)
        for j, (o0, o1) in enumerate(zip(offsets[:-1], offsets[1:])):
            delta = h[:, j] @ b[s, o0:o1].float().T  # (T, o1 - o0)
            y[:, o0:o1] += torch.where(mask, delta, 0.0).to(y.dtype)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: list[int],
) -> None:
    """lora_reference, on the fastest path the tensors' device has: the Triton kernel on CUDA
    (kernels/lora.py); pagoda_cpu.lora_apply (kernels/cpu/lora.cpp) on CPU for float32 x and y
    and float32, bfloat16 or float16 a and b (one dtype), where pagoda's C++ kernels are built
    (y and a contiguous, b contiguous or stored by rank, as LoRAWeights holds them)."""
    if x.is_cuda:
        from pagoda.kernels.lora import lora_apply_triton

        lora_apply_triton(y, x, a, b, slots, offsets)
        return
    weights = a.dtype == b.dtype and a.dtype in CPU_KERNEL_WEIGHT_DTYPES
    floats = x.dtype == y.dtype == torch.float32
    whole = y.is_contiguous() and a.is_contiguous() and (b.is_contiguous() or _by_rank(b))
    if x.device.type == "cpu" and floats and weights and whole and _cpu_kernels():
        torch.ops.pagoda_cpu.lora_apply(y, x, a, b, slots, offsets, 2)
        return
    lora_reference(y, x, a, b, slots, offsets)


def _by_rank(b: torch.Tensor) -> bool:
    """b (S, N, R) is the transpose of a contiguous (S, R, N) tensor (LoRAWeights' CPU layout)."""
    return b.transpose(1, 2).is_contiguous()


@torch.compiler.assume_constant_result
def _cpu_kernels() -> bool:
    """pagoda's C++ CPU kernels are built and on (a constant to torch.compile's tracing, which
    cannot enter the build's lock)."""
    from pagoda.kernels.cpu import kernels

    return kernels() is not None


class LoRAWeights(nn.Module):
    """One projection's adapter slots. `a`, `b` are buffers (graph inputs of a compiled step,
    written in place when an adapter is loaded into a slot); `slots` is the step's token ->
    slot index, one tensor shared by every layer (the runner writes its first num_tokens rows
    before each step)."""

    a: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor

    def __init__(
        self,
        num_slots: int,
        offsets: list[int],
        max_rank: int,
        input_size: int,
        slots: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.offsets = list(offsets)
        num_slices = len(offsets) - 1
        device = slots.device
        shape_a = (num_slots, num_slices, max_rank, input_size)
        self.register_buffer("a", torch.zeros(shape_a, dtype=dtype, device=device))
        self.register_buffer("slots", slots, persistent=False)
        # On CPU with pagoda's C++ kernels built, a and b float32, bfloat16 or float16 (the
        # kernel widens them as it reads them; x and y float32): their op, called directly (a
        # step runs it once per projection; lora_apply's checks would cost as much as the op).
        on_cpu = device.type == "cpu" and dtype in CPU_KERNEL_WEIGHT_DTYPES
        self.cpu_kernel = on_cpu and _cpu_kernels()
        # b is (S, N, R); for the C++ kernel it is stored by rank, the transpose of an (S, R, N)
        # tensor, so the kernel reads each rank's output columns in place (lora.cpp).
        if self.cpu_kernel:
            b = torch.zeros(num_slots, max_rank, offsets[-1], dtype=dtype, device=device)
            b = b.transpose(1, 2)
        else:
            b = torch.zeros(num_slots, offsets[-1], max_rank, dtype=dtype, device=device)
        self.register_buffer("b", b)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += the products of x's tokens' adapters (in place when y is contiguous)."""
        if not y.is_contiguous():
            y = y.contiguous()
        slots = self.slots[: x.shape[0]]
        if self.cpu_kernel and x.dtype == torch.float32 and y.dtype == torch.float32:
            torch.ops.pagoda_cpu.lora_apply(y, x, self.a, self.b, slots, self.offsets, 2)
        else:
            lora_apply(y, x, self.a, self.b, slots, self.offsets)
        return y

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
