"""The LoRA adapters of `bench throughput|latency --enable-lora`: random PEFT adapters made at
run time for the benchmark's base model (or given with --lora-path), and which adapter each
request runs with.

Generated adapters are PEFT's own LoRA (`peft.get_peft_model` over transformers' reading of the
checkpoint pagoda loads: a GGUF is dequantized to float32, as `--peer hf` and `--peer vllm` read
it), saved with `save_pretrained` into a temporary folder that lives as long as the run: rank
--max-lora-rank (16), alpha --lora-alpha (2 x rank), every linear projection of the decoder
(q, k, v, o, gate, up, down: the common fine-tune shape), A as PEFT starts it (Kaiming uniform)
and B random (PEFT starts it at zero, which would add nothing yet still cost the products),
each adapter from its own seed. The record states that shape.

As vLLM's `bench throughput --lora-path` does, one given folder serves under several adapter
ids (names lora-1, lora-2, ...): each id is a distinct adapter to both engines (its own slot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ASSIGNMENTS = ("round-robin", "random")
# B's standard deviation: a delta B A x of a few percent of a projection's output.
B_STD = 0.02
# lora_int_id of adapter i is FIRST_ID + i (0 is the base model in both engines).
FIRST_ID = 1


@dataclass(frozen=True)
class AdapterShape:
    rank: int
    alpha: int  # PEFT's lora_alpha is an int
    targets: tuple[str, ...] = ALL_LINEAR


@dataclass(frozen=True)
class BenchAdapter:
    """One adapter as both engines take it: vLLM's LoRARequest(name, int id, path)."""

    name: str
    int_id: int
    path: str


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's LoRA flags; the engine's own (--enable-lora, --max-loras, --max-lora-rank,
    --max-cpu-loras) are engine flags already."""
    g = parser.add_argument_group("LoRA (with --enable-lora)")
    g.add_argument(
        "--num-loras",
        type=int,
        default=None,
        help="adapters the requests are spread over (default: --max-loras, else 4 for "
        "throughput and 1 for latency)",
    )
    g.add_argument(
        "--lora-path",
        default=None,
        help="PEFT adapter folders, comma-separated, instead of generated ones; one folder "
        "serves under every adapter id (vLLM's bench throughput --lora-path)",
    )
    g.add_argument(
        "--lora-alpha",
        type=int,
        default=None,
        help="generated adapters' alpha (default: 2 x --max-lora-rank)",
    )
    g.add_argument(
        "--lora-targets",
        default=",".join(ALL_LINEAR),
        help="generated adapters' target modules, comma-separated (default: all seven)",
    )
    g.add_argument(
        "--lora-assignment",
        choices=ASSIGNMENTS,
        default="round-robin",
        help="which adapter each request runs with: request i takes adapter i mod N, or one "
        "drawn with --seed",
    )


def num_loras(args: argparse.Namespace, kwargs: dict[str, Any], default: int) -> int:
    """--num-loras, else --max-loras, else `default`; ValueError below 1."""
    n = args.num_loras if args.num_loras is not None else kwargs.get("max_loras", default)
    if n < 1:
        raise ValueError(f"--num-loras must be >= 1, got {n}")
    return int(n)


def lora_engine_kwargs(kwargs: dict[str, Any], count: int, rank: int) -> tuple[dict, dict]:
    """(the base engine's kwargs: no LoRA flag; the LoRA engine's: enable_lora, max_loras
    (default: every adapter in a step at once), max_lora_rank (default: the adapters' rank))."""
    lora_keys = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")
    base = {k: v for k, v in kwargs.items() if k not in lora_keys}
    lora = {**kwargs, "enable_lora": True}
    lora.setdefault("max_loras", count)
    lora.setdefault("max_lora_rank", rank)
    return base, lora


def generated_shape(args: argparse.Namespace, kwargs: dict[str, Any]) -> AdapterShape:
    rank = int(kwargs.get("max_lora_rank", 16))
    alpha = int(args.lora_alpha) if args.lora_alpha is not None else 2 * rank
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if rank < 1 or not targets:
        raise ValueError("generated adapters need a rank >= 1 and at least one target module")
    return AdapterShape(rank, alpha, targets)


def assign_adapters(num_requests: int, num_adapters: int, mode: str, seed: int) -> list[int]:
    """The adapter index (0 .. num_adapters - 1) of each request: round-robin (i mod N), or
    drawn uniformly by a Random(seed) of its own (the workload's random state is untouched)."""
    if num_adapters < 1:
        raise ValueError(f"need at least one adapter, got {num_adapters}")
    if mode == "round-robin":
        return [i % num_adapters for i in range(num_requests)]
    if mode == "random":
        rng = random.Random(seed)
        return [rng.randrange(num_adapters) for _ in range(num_requests)]
    raise ValueError(f"--lora-assignment takes {' or '.join(ASSIGNMENTS)}, got {mode!r}")


def bench_adapters(paths: Sequence[str], count: int) -> list[BenchAdapter]:
    """`count` adapters over the folders: one folder serves under every id, else one id per
    folder (then count must be their number)."""
    if len(paths) not in (1, count):
        raise ValueError(f"--lora-path gives {len(paths)} folders for --num-loras {count}")
    return [
        BenchAdapter(f"lora-{FIRST_ID + i}", FIRST_ID + i, paths[0 if len(paths) == 1 else i])
        for i in range(count)
    ]


def adapter_config(path: str) -> dict[str, Any]:
    """What a PEFT folder's adapter_config.json says of its shape."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    targets = config.get("target_modules") or []
    return {
        "rank": config.get("r"),
        "alpha": config.get("lora_alpha"),
        "targets": sorted(targets) if isinstance(targets, list) else targets,
        "use_rslora": bool(config.get("use_rslora")),
    }


def make_adapters(
    hf_model: Any, folder: str, count: int, shape: AdapterShape, seed: int
) -> list[str]:
    """`count` PEFT LoRA adapters of `shape` over `hf_model` (an HF causal LM, float32), saved
    under `folder`/lora-<i>; their paths. The model is given back without adapters."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError("generated LoRA adapters need peft (`pip install peft`)") from e
    config = LoraConfig(
        r=shape.rank,
        lora_alpha=shape.alpha,
        target_modules=list(shape.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    paths = []
    for i in range(count):
        torch.manual_seed(seed + i)  # A: PEFT's own initialisation, from this seed
        peft_model = get_peft_model(hf_model, config)
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(B_STD * torch.randn(param.shape, generator=gen))
        path = os.path.join(folder, f"lora-{FIRST_ID + i}")
        peft_model.save_pretrained(path)
        paths.append(path)
        hf_model = peft_model.unload()
    return paths


def generated_record(shape: AdapterShape, seed: int) -> dict[str, Any]:
    return {
        "source": "generated",
        "rank": shape.rank,
        "alpha": shape.alpha,
        "targets": list(shape.targets),
        "use_rslora": False,
        "init": f"A: PEFT's Kaiming uniform; B: normal, std {B_STD}",
        "seeds": f"{seed} + adapter index",
        "made_by": "peft get_peft_model over transformers' float32 reading of the checkpoint",
    }


def prepare_adapters(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    folder: str,
    count: int,
    export_base: bool,
) -> tuple[list[BenchAdapter], dict[str, Any]]:
    """The run's adapters (generated under `folder`, or --lora-path's) and their record. With
    export_base the float32 base checkpoint is saved in `folder` too (what vLLM loads)."""
    from pagoda.bench.common import load_hf_peer, log
    from pagoda.bench.vllm_peer import export_float32

    given = [p.strip() for p in (args.lora_path or "").split(",") if p.strip()]
    hf = load_hf_peer(args.model) if export_base or not given else None
    if export_base:
        export_float32(args.model, folder, hf)
    if given:
        configs = [adapter_config(p) for p in given]
        record: dict[str, Any] = {"source": "given", "paths": given, **configs[0]}
        record["rank"] = max(int(c["rank"]) for c in configs)
        if len(configs) > 1:
            record["configs"] = configs
    else:
        shape = generated_shape(args, kwargs)
        log(f"LoRA: making {count} PEFT adapters (rank {shape.rank}, alpha {shape.alpha})")
        given = make_adapters(hf, os.path.join(folder, "adapters"), count, shape, args.seed)
        record = generated_record(shape, args.seed)
    adapters = bench_adapters(given, count)
    record["num_loras"] = count
    record["adapters"] = [{"name": a.name, "int_id": a.int_id} for a in adapters]
    return adapters, record
