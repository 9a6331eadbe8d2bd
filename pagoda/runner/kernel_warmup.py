"""The sizes of the warm-up steps that make every Triton kernel variant a served step can need.

Triton compiles a kernel once per launch variant: its constexprs and the class of each
specialized integer. The kernels do not specialize the integers that change from step to step
(block-table strides, split counts, row counts), so a kernel's variant follows from at most one
size of the step, and the kernels' variants are independent of each other:

    decode attention   (DIRECT, BLOCK_S) of the split count, which the runner picks from the
                       decode batch size (kernels/split_k.py, decode_launch_variant)
    quantized matmuls  BLOCK_M, or dequantize-then-GEMM, of the number of rows: the step's
                       tokens, or its sampled rows in the LM head (kernels/quant_matmul.py,
                       launch_variant)
    all the others     one variant per model (norms, rotary, KV writes, prefill attention)

So the warm-up runs a one-request decode step at a split count of each attention variant, a
prefill step of a token count of each matmul variant, and the LM head over a row count of each
matmul variant: a few steps, and small ones, whatever the batch limits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable


def first_of_each(sizes: Iterable[int], variant: Callable[[int], Hashable]) -> list[int]:
    """The smallest size of each distinct variant, in increasing order."""
    first: dict[Hashable, int] = {}
    for n in sizes:
        first.setdefault(variant(n), n)
    return sorted(first.values())


def decode_split_counts(max_num_seqs: int, num_splits: Callable[[int], int]) -> list[int]:
    """A split count of each decode attention variant that decode batches of 1 to max_num_seqs
    requests use; num_splits(batch): the runner's split count for a batch."""
    from pagoda.kernels.split_k import decode_launch_variant

    counts = sorted({num_splits(b) for b in range(1, max_num_seqs + 1)})
    return first_of_each(counts, decode_launch_variant)


def matmul_row_counts(first: int, last: int) -> list[int]:
    """A row count in [first, last] of each quantized matmul variant."""
    from pagoda.kernels.quant_matmul import launch_variant

    return first_of_each(range(first, last + 1), launch_variant)


def prefill_lens(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """num_tokens as prompts of at most max_model_len tokens (at most max_num_seqs of them)."""
    lens = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len]
    return [n for n in lens if n][:max_num_seqs]
