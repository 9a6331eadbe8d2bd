"""The engine flags, named as vLLM names them: shared by `pagoda serve | generate | chat` and
`pagoda bench`."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="load no tokenizer: prompts are token ids, outputs have empty text",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(KV_CACHE_DTYPES),
        help="auto (the model dtype), int8 or fp8 (alias fp8_e4m3): a scale per token and head",
    )
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"])
    g.add_argument(
        "--max-explained-requests",
        type=int,
        default=None,
        help="finished requests whose timelines GET /v1/requests/{id}/explain keeps (256)",
    )
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"]
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=list(QUANTIZATION_METHODS),
        help="weight quantization (default: the checkpoint's own; gguf for a GGUF file on CPU)",
    )
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=list(ATTENTION_BACKENDS),
        help="kernels: triton (the default on CUDA) or torch (the reference; the default on CPU)",
    )
    g.add_argument(
        "-O",
        "--optimization-level",
        type=int,
        default=None,
        choices=range(4),
        help="0: every step eager; 1-3: decode steps replay CUDA graphs (CUDA) or run "
        "through torch.compile (CPU; up to a minute of compiling at startup). Default: 2 on CUDA, "
        "0 on CPU",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="the same as -O0: no CUDA graphs, no torch.compile",
    )

    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step before the previous one's outputs are processed, "
        "so host work overlaps the GPU's (default: on with CUDA, off on CPU)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="split every layer over N ranks, one worker process each (gloo on CPU, NCCL on "
        "CUDA); --kv-cache-memory-bytes is then per rank",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        help="split the layers into N stages, one worker process each (times the tensor-parallel "
        "size); each step runs as micro-batches that overlap across the stages",
    )
    g.add_argument(
        "--prefill-context-parallel-size",
        "-pcp",
        type=int,
        default=None,
        help="split each step's prompt tokens over N ranks, one worker process each with the "
        "whole model; each rank holds 1/N of every request's KV cache (N must divide "
        "--block-size)",
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help="prefill/decode disaggregation as a JSON object with vLLM's fields, e.g. "
        '\'{"kv_connector": "PagodaConnector", "kv_role": "kv_producer", "kv_port": 14579}\' '
        "(kv_producer | kv_consumer | kv_both; see `pagoda proxy`)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding as a JSON object with vLLM's fields, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(turns async scheduling off)",
    )


ENGINE_ARG_NAMES = (
    "tokenizer",
    "skip_tokenizer_init",
    "dtype",
    "seed",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_prefix_caching",
    "kv_cache_memory_bytes",
    "num_gpu_blocks_override",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "scheduling_policy",
    "max_explained_requests",
    "device",
    "load_format",
    "quantization",
    "attention_backend",
    "optimization_level",
    "enforce_eager",
    "async_scheduling",
    "speculative_config",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "kv_transfer_config",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments the user set (None means: the engine's default)."""
    out = {k: getattr(args, k) for k in ENGINE_ARG_NAMES if getattr(args, k, None) is not None}
    return out
