"""The draft model of speculative decoding ("method": "draft_model"): loaded beside the target.

The draft is a second checkpoint, or the target's own (`"model": "self"`) under another weight
scheme: a float target with a 4-bit copy of itself as the draft (quantized self-draft). It is
loaded as the target is (loader.load_model: same device, dtype, load format and seed), with the
draft's `quantization`, and it must speak the target's tokens: its vocabulary size must match,
and so must its tokenizer's vocabulary when both have one (ValueError otherwise). Its paged KV
cache shares the target's block ids, so it must also reach the target's max_model_len.

Under tensor parallelism every rank holds the whole draft (no collectives) and its own cache
of it, and proposes what the others do: the same bits from the same tokens, the same draws from
identically seeded generators. vLLM's draft_tensor_parallel_size 1; a draft cut across the
ranks is not built.

A self-draft on one rank (`shares_target_kv`) reads and writes the target's own KV cache
instead of one of its own: the same layers and heads, so the draft attends to the target's keys
and values of every computed token and writes only past them (its proposals' positions, which
the target's verification overwrites before it reads them). It needs no memory for a cache
and never catches up on a prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.loading.loader import load_model
from pagoda.model_config import ModelConfig
from pagoda.models.interface import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class DraftModel:
    """A loaded draft: its network and what the engine needs to know of it."""

    model: CausalLM
    config: ModelConfig
    shares_target_kv: bool = False  # a self-draft: the target's KV cache is its own


def load_draft_model(config: EngineConfig, target: ModelConfig, tokenizer: Any) -> DraftModel:
    """The draft of config.speculative_config (method draft_model), on the target's device;
    `target` and `tokenizer` (None without one) are the target's."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    own = spec.is_self_draft
    draft_config = dataclasses.replace(
        config,
        model=config.model if own else spec.model,
        tokenizer=None,
        quantization=spec.quantization,
        max_model_len=target.max_model_len,
        speculative_config=None,
        skip_tokenizer_init=own or tokenizer is None,
    )
    name = f"the target's checkpoint ({spec.quantization})" if own else spec.model
    ranks = config.tensor_parallel_size
    # this rank's own GPU: fork_rng's default would take (and warn about) every visible one
    devices = [torch.cuda.current_device()] if config.device == "cuda" else []
    try:
        with torch.random.fork_rng(devices, enabled=ranks > 1):
            if ranks > 1:  # dummy weights: every rank draws the same draft
                torch.manual_seed(config.seed)
            model, model_config, draft_tokenizer = load_model(draft_config)
    except ValueError as e:
        raise ValueError(f"speculative_config: the draft model, {name}: {e}") from e
    _check_vocabulary(target, tokenizer, model_config, draft_tokenizer)
    # a rank's cache holds its share of the target's kv heads; the whole draft needs them all
    shared = own and ranks == 1 and _kv_layout(model_config) == _kv_layout(target)
    logger.info(
        "draft model: %s, %s, quantization=%s, %d layers, %s",
        name,
        model_config.architecture,
        model_config.quantization,
        model_config.num_layers,
        "on the target's KV cache" if shared else "its own KV cache",
    )
    return DraftModel(model, model_config, shared)


def _kv_layout(config: ModelConfig) -> tuple[int, int, int, str]:
    return config.num_layers, config.num_kv_heads, config.head_dim, config.dtype


def _check_vocabulary(
    target: ModelConfig, tokenizer: Any, draft: ModelConfig, draft_tokenizer: Any
) -> None:
    """The draft's token ids must mean what the target's mean."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary has {draft.vocab_size} tokens, "
            f"the target's {target.vocab_size}; a draft model must share the target's tokenizer"
        )
    if tokenizer is None or draft_tokenizer is None:
        return
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differing = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ValueError(
            "speculative_config: the draft model's tokenizer differs from the target's "
            f"({len(theirs)} vs {len(ours)} entries; e.g. {differing}); a draft model must "
            "share the target's tokenizer"
        )
