"""One rank's runner from an EngineConfig: the model (this rank's shard of it), its ModelConfig,
the tokenizer, the EOS ids and the ModelRunner. EngineCore builds one in its own process; under
tensor or pipeline parallelism each worker process builds its own (distributed/worker.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.layers.parallel import (
    NO_CONTEXT_PARALLEL,
    SINGLE,
    WHOLE_MODEL,
    ContextParallel,
    PipelineStage,
    TensorParallel,
)
from pagoda.loading.draft import DraftModel, load_draft_model
from pagoda.loading.loader import load_model
from pagoda.loading.tokenizer import tokenizer_eos_token_id
from pagoda.model_config import ModelConfig
from pagoda.models import FAMILIES
from pagoda.runner.device import torch_dtype
from pagoda.runner.lora import LoRATable
from pagoda.runner.model_runner import ModelRunner
from pagoda.runner.pooler import Pooler, classifier_head
from pagoda.spec_decode.methods import spec_method

logger = logging.getLogger(__name__)


@dataclass
class RankSetup:
    runner: ModelRunner
    model_config: ModelConfig
    tokenizer: Any  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    draft: DraftModel | None


def build_runner(
    config: EngineConfig,
    tp: TensorParallel = SINGLE,
    pp: PipelineStage = WHOLE_MODEL,
    cp: ContextParallel = NO_CONTEXT_PARALLEL,
    load_tokenizer: bool = True,
) -> RankSetup:
    """Load the model (this rank's share and stage of it; and a draft model) on config's
    resolved device and wrap it in a runner. Without `load_tokenizer` (a client holds the
    tokenizer) only the tokenizer's EOS id is read, unless a draft model's vocabulary must be
    checked against it."""
    spec = config.speculative_config
    uses_draft = spec is not None and spec_method(spec).uses_draft_model
    load_tokenizer = load_tokenizer or uses_draft
    tokenizer_eos = None
    if not load_tokenizer and not config.skip_tokenizer_init:
        # Before the weights, as load_model loads a tokenizer: a missing one fails in seconds.
        tokenizer_eos = tokenizer_eos_token_id(config)
    model, model_config, tokenizer = load_model(config, tp, pp, load_tokenizer)
    if tokenizer is not None:
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    eos_token_ids = eos_token_ids_of(model_config.hf_config, tokenizer_eos)
    draft = None
    if uses_draft:
        draft = load_draft_model(config, model_config, tokenizer)
    kv_dtype = config.cache.kv_dtype  # a dtype name, None: the model's
    runner = ModelRunner(
        model,
        model_config,
        config.cache.block_size,
        torch.device(config.device_type),
        eos_token_ids,
        None if kv_dtype is None else torch_dtype(kv_dtype),
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        kernel_backend=config.kernel_backend,
        use_cuda_graphs=config.use_cuda_graphs,
        compile_decode=config.compile_decode,
        decode_cpp_wrapper=config.decode_cpp_wrapper,
        speculative_config=spec,
        draft=draft,
        pp=pp,
        cp=cp,
    )
    if model_config.pooler is not None:
        classifier = model_config.classifier
        head = None if classifier is None else classifier_head(model, classifier)
        dtype = torch_dtype(model_config.dtype)
        runner.pooler = Pooler(str(model_config.pooler.pooling_type), head, dtype)
    if config.enable_lora:
        runner.lora = lora_table(runner, config)
    return RankSetup(runner, model_config, tokenizer, eos_token_ids, draft)


def lora_table(runner: ModelRunner, config: EngineConfig) -> LoRATable:
    """The adapter slots of the runner's model (runner/lora.py); its layers' fused forms,
    which would skip the adapters, are turned off."""
    model: Any = runner.model
    model.model.fused_max_rows = 0
    hf_config = runner.model_config.hf_config
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    families = [family for family, cls in FAMILIES if type(model) is cls]
    dtype = config.lora_dtype
    return LoRATable(
        model,
        model.packed_modules,
        config.max_loras,
        config.max_lora_rank,
        config.max_cpu_loras or config.max_loras,
        runner.buffers.max_tokens,
        runner.device,
        torch_dtype(runner.model_config.dtype if dtype == "auto" else dtype),
        (heads, kv_heads),
        tuple(arch for family in families for arch in family.gguf_archs),
    )


def profiled_kv_budget(runner: ModelRunner, config: EngineConfig) -> int:
    """gpu_memory_utilization of the device, less what is in use now (weights, CUDA context,
    other processes) and the activation peak of the largest step (runner.profile_run)."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    runner.profile_run()
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.cache.gpu_memory_utilization
    budget = kv_cache_budget(total, free, activation, utilization)
    logger.info(
        "memory profile: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak at %d "
        "tokens -> %.2f GiB for the KV cache (gpu_memory_utilization %.2f)",
        total / 2**30,
        (total - free) / 2**30,
        activation / 2**30,
        config.scheduler.max_num_batched_tokens,
        budget / 2**30,
        utilization,
    )
    return budget


def kv_cache_budget(total: int, free: int, activation_peak: int, utilization: float) -> int:
    """Bytes for KV blocks: the utilization share of the device less what is in use (total -
    free: weights, context, other processes) and the activation peak of the largest step."""
    return int(total * utilization) - (total - free) - activation_peak


def eos_token_ids_of(hf_config: Any, tokenizer_eos: Any) -> frozenset[int]:
    """The config's EOS id(s) and the tokenizer's (None without a tokenizer)."""
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if isinstance(tokenizer_eos, int):
        ids.add(tokenizer_eos)
    return frozenset(ids)
