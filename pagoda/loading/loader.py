"""Checkpoint -> model: resolve the path, read config and tokenizer, stream weights in.

The checkpoint's files are found by pagoda/loading/model_files.py, its config read by
hf_config.py and its tokenizer by tokenizer.py; its tensors come from safetensors.py (an HF
folder) or gguf.py (a GGUF file, renamed to HF names), so models only ever see HF names
(`CausalLM.load_weights`). Here the model is built, its quantization method chosen and its
weights loaded (or drawn at random for load_format="dummy").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TensorParallel
from pagoda.layers.quant import QUANTIZED_EMBEDDING_METHODS, make_method
from pagoda.layers.quant_forms import stored_bytes
from pagoda.loading.classifier import classifier_of
from pagoda.loading.gguf import iter_gguf
from pagoda.loading.hf_config import load_hf_config, max_positions
from pagoda.loading.model_files import resolve_model
from pagoda.loading.pooling import checkpoint_pooler
from pagoda.loading.safetensors import iter_safetensors
from pagoda.loading.tokenizer import load_tokenizer_for
from pagoda.model_config import ModelConfig
from pagoda.models import MODEL_REGISTRY, architectures_of, get_model_class, registered_name
from pagoda.models.interface import CausalLM
from pagoda.models.score_head import add_score_head
from pagoda.pooler_config import Classifier, PoolerConfig

logger = logging.getLogger(__name__)


def iter_weights(
    folder: str, gguf_file: str | None, raw_gguf: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF parameter name, tensor) for every tensor of the checkpoint, on CPU. With `raw_gguf`,
    quantized GGUF tensors come as GGUFWeight (their blocks) instead of float32."""
    if gguf_file is not None:
        yield from iter_gguf(os.path.join(folder, gguf_file), raw_gguf)
    else:
        yield from iter_safetensors(folder)


def load_model(
    config: EngineConfig,
    tp: TensorParallel = SINGLE,
    pp: PipelineStage = WHOLE_MODEL,
    load_tokenizer: bool = True,
) -> tuple[CausalLM, ModelConfig, Any]:
    """Build the model on config.device (resolved) in config.dtype_name with its weights loaded
    (random for load_format="dummy"), in eval mode; return it with its ModelConfig and tokenizer
    (None with skip_tokenizer_init or without `load_tokenizer`). With `tp` of size N the model
    holds this rank's 1/N of each layer: every checkpoint tensor is cut to its slice as it is
    read (layers/parallel.py); dummy weights are drawn per rank. With `pp` it holds only its
    stage's layers, and reads only their tensors."""
    folder, gguf_file = _checkpoint(config)
    hf_config = load_hf_config(folder, gguf_file, config.trust_remote_code)
    for key, value in (config.hf_overrides or {}).items():  # vLLM's --hf-overrides
        setattr(hf_config, key, value)
    # Before the weights, so that a missing tokenizer fails in seconds, not after loading.
    tokenizer = None
    if load_tokenizer and not config.skip_tokenizer_init:
        tokenizer = load_tokenizer_for(config)
    architectures = architectures_of(hf_config)
    model_cls = get_model_class(architectures)
    architecture = next(a for a in architectures if registered_name(a) in MODEL_REGISTRY)
    classifier = classifier_of(config, hf_config, architecture, tokenizer)
    max_model_len = _max_model_len(config, hf_config)

    dtype, device = getattr(torch, config.dtype_name), torch.device(config.device_type)
    quantization, quant_config = resolve_quantization(config, hf_config, gguf_file)
    with torch.device(device):
        model = model_cls(hf_config, dtype, tp, pp)
        if classifier is not None and not classifier.token_ids:
            add_score_head(model, classifier.num_labels)
    _load_weights(model, config, hf_config, folder, gguf_file, quantization, quant_config)
    model.eval()
    model.requires_grad_(False)
    weight_bytes = stored_bytes(model)
    per_rank = "" if tp.size == 1 else f" (rank {tp.rank} of {tp.size})"
    if pp.size > 1:
        per_rank += f" (pipeline stage {pp.rank} of {pp.size})"
    logger.info(
        "weights: quantization=%s, %.1f MiB%s", quantization, weight_bytes / 2**20, per_rank
    )

    model_config = ModelConfig(
        hf_config=hf_config,
        architecture=architecture,
        dtype=config.dtype_name,
        max_model_len=max_model_len,
        quantization=quantization,
        weight_bytes=weight_bytes,
        tensor_parallel_size=tp.size,
        rank_kv_heads=model.rank_kv_heads(),
        pipeline_parallel_size=pp.size,
        rank_layers=model.num_held_layers(),
        prefill_context_parallel_size=config.prefill_context_parallel_size,
        pooler=_pooler(config, folder if gguf_file is None else None, classifier),
        classifier=classifier,
    )
    return model, model_config, tokenizer


def _checkpoint(config: EngineConfig) -> tuple[str, str | None]:
    """The model's folder and GGUF file (None: an HF folder); ValueError against load_format."""
    folder, gguf_file = resolve_model(config.model)
    if config.load_format == "gguf" and gguf_file is None:
        raise ValueError(f"load_format='gguf' but {folder} is an HF folder; pass a .gguf file")
    if config.load_format == "safetensors" and gguf_file is not None:
        raise ValueError(f"load_format='safetensors' but the model is a GGUF file ({gguf_file})")
    return folder, gguf_file


def _pooler(
    config: EngineConfig, folder: str | None, classifier: Classifier | None
) -> PoolerConfig | None:
    """--runner pooling: --pooler-config's fields over the checkpoint's own pooling. ValueError
    for a classifier (it has no LM head to generate with) under another runner."""
    if not config.is_pooling:
        if classifier is not None:
            raise ValueError(
                "a sequence-classification model scores (/v1/score, /v1/rerank) and does not "
                "generate: run it with --runner pooling"
            )
        return None
    base = checkpoint_pooler(folder)
    return base if config.pooler_config is None else config.pooler_config.over(base)


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """--max-model-len, or the checkpoint's limit; ValueError past that limit."""
    limit = max_positions(hf_config)
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than this checkpoint supports ({limit} "
            f"positions); pass --max-model-len {limit} or less"
        )
    return max_model_len


def _load_weights(
    model: Any,
    config: EngineConfig,
    hf_config: Any,
    folder: str,
    gguf_file: str | None,
    quantization: str,
    quant_config: dict[str, Any],
) -> None:
    """Attach the quantization method to every Linear, fill the weights (checkpoint or random)
    and build their stored forms."""
    method = make_method(quantization, quant_config)
    if method is not None:
        for module in model.modules():
            if isinstance(module, Linear):
                module.set_quant_method(method)
    if config.load_format == "dummy":
        _init_dummy(model, config.seed, float(getattr(hf_config, "initializer_range", 0.02)))
    else:
        raw_gguf = quantization == "gguf"
        with _loading_threads():
            loaded = model.load_weights(iter_weights(folder, gguf_file, raw_gguf))
        missing = model.expected_weights() - loaded
        if missing:
            raise ValueError(
                f"the checkpoint in {folder} lacks {len(missing)} tensors the model needs, "
                f"e.g. {sorted(missing)[:5]}"
            )
    with _loading_threads():
        model.finalize_weights()
    if quantization in QUANTIZED_EMBEDDING_METHODS:
        # a few large operators: every thread helps
        for vocab in model.vocab_layers():
            vocab.quantize_int8()
    elif model.lm_head is not None:
        model.lm_head.keep_half_on_cpu()


@contextlib.contextmanager
def _loading_threads() -> Iterator[None]:
    """One CPU thread fewer than torch's (at least one) while the weights load tensor by tensor.

    That runs many small operators (a few per tensor: decode, concatenate, pack), each a parallel
    region whose threads wait for the slowest. With a thread per core and a core busy elsewhere
    (pagoda serve's API process starts beside the engine; other work on the machine), each
    region waits for a time slice: on two loaded cores SmolLM2's weights took 1.5-5 s instead
    of about 1 s. Idle, the thread fewer costs about 0.2 s there. The weights are the same bit
    for bit whatever the thread count (tests/models/test_loading_threads.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def resolve_quantization(
    config: EngineConfig, hf_config: Any, gguf_file: str | None
) -> tuple[str, dict[str, Any]]:
    """The weight scheme in effect and the checkpoint's quantization_config (vLLM's rules: the
    checkpoint's own method unless --quantization names another that can apply)."""
    requested = config.quantization
    dummy = config.load_format == "dummy"
    raw_config = getattr(hf_config, "quantization_config", None)
    if raw_config is None or isinstance(raw_config, dict):
        ckpt: dict[str, Any] = dict(raw_config or {})
    else:
        ckpt = raw_config.to_dict()
    ckpt_method = str(ckpt.get("quant_method", "")).lower() or None
    if gguf_file is not None:
        ckpt_method = "gguf"
    if ckpt_method not in (None, "gguf", "awq", "gptq"):
        raise ValueError(
            f"the checkpoint is quantized with {ckpt_method!r}, which pagoda cannot load; "
            "supported: gguf, awq, gptq"
        )
    if requested is None:
        if dummy:
            return "none", ckpt
        if ckpt_method == "gguf":
            return ("gguf" if config.device_type == "cpu" else "none"), ckpt
        return ckpt_method or "none", ckpt
    if requested in ("awq", "gptq") and (dummy or ckpt_method != requested):
        raise ValueError(
            f"--quantization {requested} needs a {requested.upper()} checkpoint (qweight, qzeros, "
            f"scales and a quantization_config); this one is {ckpt_method or 'not quantized'}"
        )
    if requested == "gguf" and (dummy or ckpt_method != "gguf"):
        raise ValueError("--quantization gguf needs a .gguf model file (and real weights)")
    if ckpt_method in ("awq", "gptq") and requested != ckpt_method:
        raise ValueError(
            f"the checkpoint is {ckpt_method.upper()}-quantized; pass --quantization "
            f"{ckpt_method} or leave it unset"
        )
    if requested == "fp8" and not _fp8_supported(torch.device(config.device_type)):
        raise ValueError("--quantization fp8 needs torch._scaled_mm for float8 on this device")
    return requested, ckpt


def _fp8_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return hasattr(torch, "float8_e4m3fn")


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights, reproducible for a seed on any device: N(0, std), norm weights 1."""
    generator = torch.Generator().manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)
