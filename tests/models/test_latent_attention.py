"""DeepSeek-V3's multi-head latent attention beside the GQA families: what its cache holds per
token (the latent row, no values), the bytes the engine sizes and allocates for it, YaRN's
frequencies and temperature against HF's, and what it refuses. Its outputs against HF are the
tiny-model oracle tests (test_models.py, tests/engine/test_greedy_oracle.py: "deepseek_v3")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention as HFDeepseekV3Attention,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from pagoda import LLM
from pagoda.kernels.paged_cache import kv_cache_bytes
from pagoda.layers.parallel import TensorParallel
from pagoda.layers.rotary import get_rope
from pagoda.model_config import ModelConfig, kv_cache_dims_of
from pagoda.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3ForCausalLM
from pagoda.runner.model_runner import ModelRunner

# DeepSeek-V3's published shape (transformers' defaults): 61 layers, 128 heads of 128 + 64
# query/key values and 128 values, kv_lora_rank 512
V3 = DeepseekV3Config()


def test_v3_caches_one_576_value_row_per_token_and_layer() -> None:
    config = ModelConfig(V3, "DeepseekV3ForCausalLM", "bfloat16", 4096)
    assert kv_cache_dims_of(V3) == (1, 576, 0)
    assert (config.num_kv_heads, config.head_dim, config.v_head_dim) == (1, 576, 0)
    assert config.kv_bytes_per_token() == 61 * 576 * 2  # 70,272 B
    # int8: one byte a value plus the row's scale (and the empty values' scale slot)
    assert config.kv_bytes_per_token("int8") == 61 * (576 + 4 + 4)
    # the same attention with each head's key (192) and value (128) cached
    full = 61 * 128 * (192 + 128) * 2
    assert full // config.kv_bytes_per_token() == 71


def test_gqa_families_keep_their_k_and_v() -> None:
    llama = LlamaConfig(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
    config = ModelConfig(llama, "LlamaForCausalLM", "bfloat16", 4096)
    assert kv_cache_dims_of(llama) == (8, 128, 128)
    assert config.kv_bytes_per_token() == 2 * 16 * 8 * 128 * 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_engine_allocates_latent_rows_only(
    kv_cache_dtype: str, tiny_model_dir: Callable[[str], str]
) -> None:
    """The tiny DeepSeek (rank 32 + rope 16): each layer's cache is (blocks, block, 1, 48) with
    empty values, and its bytes are what the engine sized per token."""
    llm = LLM(
        tiny_model_dir("deepseek_v3"),
        quantization="none",
        kv_cache_dtype=kv_cache_dtype,
        num_gpu_blocks_override=32,
        block_size=4,
    )
    runner = llm.engine.executor.runner
    assert isinstance(runner, ModelRunner)
    caches = runner.kv_caches
    assert len(caches) == 3
    for cache in caches:
        assert tuple(cache.k.shape) == (32, 4, 1, 48)
        assert cache.v.numel() == 0
    quant = None if kv_cache_dtype == "auto" else kv_cache_dtype
    per_token = runner.model_config.kv_bytes_per_token(quant)
    assert kv_cache_bytes(caches) == 32 * 4 * per_token
    out = llm.generate([{"prompt_token_ids": list(range(5, 30))}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_attention_scale_is_hfs_under_yarn() -> None:
    """qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared."""
    config = DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
    )
    hf = HFDeepseekV3Attention(config, 0).scaling
    assert DeepseekV3Attention.attention_scale(config) == pytest.approx(hf, rel=1e-12)
    assert hf > 192**-0.5 * 1.8  # the temperature is in effect


def _yarn_configs() -> list[Any]:
    deepseek = DeepseekV3Config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
    )
    # Qwen2.5's long-context recipe: no mscale pair, the attention factor from `factor` alone
    qwen = Qwen2Config(
        hidden_size=1536,
        num_attention_heads=12,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    return [
        pytest.param(deepseek, DeepseekV3RotaryEmbedding, 64, id="deepseek-v3"),
        pytest.param(qwen, Qwen2RotaryEmbedding, 128, id="qwen2.5"),
    ]


@pytest.mark.parametrize(("config", "hf_rope", "rotary_dim"), _yarn_configs())
def test_yarn_cos_sin_match_hf(config: Any, hf_rope: Any, rotary_dim: int) -> None:
    positions = torch.arange(0, config.max_position_embeddings, 997)
    x = torch.zeros(1, dtype=torch.float32)
    hf_cos, hf_sin = hf_rope(config)(x, positions.unsqueeze(0))  # (1, P, rotary_dim)
    rope = get_rope(config, rotary_dim, config.max_position_embeddings)
    cos, sin = rope.cos_sin(positions, torch.float32)  # (P, 1, rotary_dim // 2)
    half = rotary_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], rtol=0, atol=2e-6)


def test_tensor_parallel_splits_the_heads_or_refuses_the_size() -> None:
    """Rank 1 of 2 holds heads 2 and 3: their q_proj and kv_b_proj rows, their o_proj columns;
    the latent projection is whole. 3 ranks do not divide 4 heads: a ValueError naming them.
    (Two ranks against one, end to end: tests/engine/test_tensor_parallel.py.)"""
    tiny = DeepseekV3Config(
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        vocab_size=128,
    )
    model = DeepseekV3ForCausalLM(tiny, tp=TensorParallel(rank=1, size=2))
    attn: Any = model.model.layers[0].self_attn
    assert (attn.first_head, attn.num_heads, attn.attn.num_heads) == (2, 2, 2)
    assert attn.q_proj.out_parts == {None: (2 * 16, 2 * 16)}
    assert attn.o_proj.in_part == (2 * 8, 2 * 8)
    assert tuple(attn.kv_b_proj.weight.shape) == (2 * (8 + 8), 16)
    assert tuple(attn.kv_a_proj_with_mqa.weight.shape) == (16 + 8, 64)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the number of"):
        DeepseekV3ForCausalLM(tiny, tp=TensorParallel(rank=0, size=3))
