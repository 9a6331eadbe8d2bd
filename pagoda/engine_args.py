"""The engine flags, named as vLLM names them: shared by `pagoda serve | generate | chat` and
`pagoda bench`."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS

# Every engine flag: (its names, argparse's options). vLLM's names; `dest` is the long name.
ENGINE_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--model",), dict(default=None, help="HF folder or .gguf file (default: SmolLM2)")),
    (("--tokenizer",), dict(default=None)),
    (
        ("--skip-tokenizer-init",),
        dict(
            action="store_true",
            default=None,
            help="load no tokenizer: prompts are token ids, outputs have empty text",
        ),
    ),
    (("--dtype",), dict(default="auto", choices=["auto", "float32", "bfloat16", "float16"])),
    (("--seed",), dict(type=int, default=0)),
    (("--max-model-len",), dict(type=int, default=None)),
    (("--max-num-seqs",), dict(type=int, default=None)),
    (("--max-num-batched-tokens",), dict(type=int, default=None)),
    (("--block-size",), dict(type=int, default=None)),
    (("--enable-prefix-caching",), dict(action=argparse.BooleanOptionalAction, default=None)),
    (("--kv-cache-memory-bytes",), dict(type=int, default=None)),
    (("--num-gpu-blocks-override",), dict(type=int, default=None)),
    (("--gpu-memory-utilization",), dict(type=float, default=None)),
    (
        ("--kv-cache-dtype",),
        dict(
            default=None,
            choices=list(KV_CACHE_DTYPES),
            help="auto (the model dtype), bfloat16 or float16, or int8 or fp8 (alias fp8_e4m3) "
            "with a scale per token and kv head",
        ),
    ),
    (("--scheduling-policy",), dict(default=None, choices=["fcfs", "priority"])),
    (
        ("--max-explained-requests",),
        dict(
            type=int,
            default=None,
            help="finished requests whose timelines GET /v1/requests/{id}/explain keeps (256)",
        ),
    ),
    (("--device",), dict(default="auto", choices=["auto", "cpu", "cuda"])),
    (("--load-format",), dict(default="auto", choices=["auto", "safetensors", "gguf", "dummy"])),
    (
        (
            "--quantization",
            "-q",
        ),
        dict(
            default=None,
            choices=list(QUANTIZATION_METHODS),
            help="weight quantization (default: the checkpoint's own; gguf for a GGUF file on CPU)",
        ),
    ),
    (
        ("--attention-backend",),
        dict(
            default=None,
            choices=list(ATTENTION_BACKENDS),
            help="kernels: triton (the default on CUDA) or torch (the reference; the default on CPU)",
        ),
    ),
    (
        (
            "-O",
            "--optimization-level",
        ),
        dict(
            type=int,
            default=None,
            choices=range(4),
            help="0: every step eager; 1-3: decode steps replay CUDA graphs (CUDA) or run "
            "through torch.compile (CPU; up to a minute of compiling at startup; 3 adds "
            "inductor's C++ wrapper, minutes more the first time). Default: 2 on CUDA, 0 on CPU",
        ),
    ),
    (
        ("--enforce-eager",),
        dict(
            action="store_true",
            default=None,
            help="the same as -O0: no CUDA graphs, no torch.compile",
        ),
    ),
    (
        ("--async-scheduling",),
        dict(
            action=argparse.BooleanOptionalAction,
            default=None,
            help="schedule and launch each step before the previous one's outputs are processed, "
            "so host work overlaps the GPU's (default: on with CUDA, off on CPU)",
        ),
    ),
    (
        (
            "--tensor-parallel-size",
            "-tp",
        ),
        dict(
            type=int,
            default=None,
            help="split every layer over N ranks, one worker process each (gloo on CPU, NCCL on "
            "CUDA); --kv-cache-memory-bytes is then per rank",
        ),
    ),
    (
        (
            "--pipeline-parallel-size",
            "-pp",
        ),
        dict(
            type=int,
            default=None,
            help="split the layers into N stages, one worker process each (times the tensor-parallel "
            "size); each step runs as micro-batches that overlap across the stages",
        ),
    ),
    (
        (
            "--prefill-context-parallel-size",
            "-pcp",
        ),
        dict(
            type=int,
            default=None,
            help="split each step's prompt tokens over N ranks, one worker process each with the "
            "whole model; each rank holds 1/N of every request's KV cache (N must divide "
            "--block-size)",
        ),
    ),
    (
        ("--kv-transfer-config",),
        dict(
            default=None,
            help="prefill/decode disaggregation as a JSON object with vLLM's fields, e.g. "
            '\'{"kv_connector": "PagodaConnector", "kv_role": "kv_producer", "kv_port": 14579}\' '
            "(kv_producer | kv_consumer | kv_both; see `pagoda proxy`)",
        ),
    ),
    (
        ("--runner",),
        dict(
            default=None,
            choices=["auto", "generate", "pooling"],
            help="pooling: serve embeddings (/v1/embeddings), or scores (/v1/score, /v1/rerank) "
            "for a classifier, instead of generating text (auto: pooling for a "
            "*ForSequenceClassification checkpoint)",
        ),
    ),
    (
        ("--task",),
        dict(
            default=None,
            choices=["generate", "embed", "classify", "score"],
            help="vLLM's older name for --runner: embed, classify and score are --runner pooling",
        ),
    ),
    (
        ("--pooler-config",),
        dict(
            default=None,
            help='with --runner pooling, a JSON object: \'{"pooling_type": "LAST" | "MEAN" | '
            '"CLS", "normalize": true}\' (default: the checkpoint\'s sentence-transformers files, '
            "else LAST, normalized)",
        ),
    ),
    (
        ("--hf-overrides",),
        dict(
            default=None,
            help="a JSON object of fields set on the checkpoint's config, e.g. the "
            'Qwen3-Reranker recipe: \'{"architectures": ["Qwen3ForSequenceClassification"], '
            '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'',
        ),
    ),
    (
        ("--enable-lora",),
        dict(
            action="store_true",
            default=None,
            help="serve LoRA adapters per request (--lora-modules, or LLM.generate's "
            "lora_request); requests name an adapter as their model",
        ),
    ),
    (
        ("--max-loras",),
        dict(type=int, default=None, help="adapters one step may run: device slots (1)"),
    ),
    (
        ("--max-lora-rank",),
        dict(type=int, default=None, help="the largest adapter rank served (16)"),
    ),
    (
        ("--lora-dtype",),
        dict(
            default=None,
            choices=["auto", "float32", "bfloat16", "float16"],
            help="the adapters' dtype in their slots (auto: the model's, float32 on CPU)",
        ),
    ),
    (
        ("--max-cpu-loras",),
        dict(
            type=int,
            default=None,
            help="adapters kept loaded in host memory (default: --max-loras)",
        ),
    ),
    (
        ("--speculative-config",),
        dict(
            default=None,
            help="speculative decoding as a JSON object with vLLM's fields, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
            "(turns async scheduling off)",
        ),
    ),
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for names, options in ENGINE_FLAGS:
        group.add_argument(*names, **options)


def _dest(names: tuple[str, ...]) -> str:
    return next(n for n in names if n.startswith("--"))[2:].replace("-", "_")


# The engine flags EngineConfig takes as they are (--model is resolved first)
ENGINE_ARG_NAMES = tuple(_dest(names) for names, _ in ENGINE_FLAGS if names != ("--model",))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine arguments the user set (None means: the engine's default)."""
    out = {k: getattr(args, k) for k in ENGINE_ARG_NAMES if getattr(args, k, None) is not None}
    task = out.pop("task", None)
    if task is not None:
        runner = "generate" if task == "generate" else "pooling"
        if out.setdefault("runner", runner) != runner:
            raise ValueError(f"--task {task} contradicts --runner {out['runner']}")
    return out
