"""DeepSeek-V3 from llama.cpp's `deepseek2` files, beyond what the converter test covers
(tests/models/test_llama_cpp_converter.py: a converted tiny model's tokens against HF's): the
routers pagoda refuses, what llama.cpp assumes where a file is silent, and kv_b_proj joined back
from quantized per-head halves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config

from pagoda import LLM
from pagoda.loading.gguf import gguf_to_hf_name
from pagoda.loading.hf_config import load_hf_config
from pagoda.loading.loader import iter_weights
from pagoda.models import gguf_family
from pagoda.models.deepseek_v3 import DeepseekV3ForCausalLM

HIDDEN, VOCAB = 64, 300


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))


def _write(path: Path, fields: dict[str, Any], tensors: dict[str, Any] | None = None) -> Path:
    """A deepseek2 file of these metadata (<arch>. left out) and tensors, with a token
    embedding; a quantized tensor is given as (its bytes, its type)."""
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(f"deepseek2.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"deepseek2.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"deepseek2.{key}", value)
        else:
            writer.add_string(f"deepseek2.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), dtype=np.float32))
    for name, tensor in (tensors or {}).items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# a file's shape: 3 layers, the first dense, 8 experts (2 a token) beside one shared
SHAPE = {
    "block_count": 3,
    "context_length": 256,
    "embedding_length": HIDDEN,
    "feed_forward_length": 128,
    "attention.head_count": 4,
    "attention.head_count_kv": 1,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.kv_lora_rank": 32,
    "attention.key_length": 32 + 16,
    "attention.value_length": 32,
    "attention.key_length_mla": 16 + 16,
    "attention.value_length_mla": 24,
    "rope.dimension_count": 16,
    "rope.freq_base": 10000.0,
    "leading_dense_block_count": 1,
    "expert_count": 8,
    "expert_used_count": 2,
    "expert_shared_count": 1,
    "expert_feed_forward_length": 32,
}


@pytest.mark.parametrize(
    ("gating", "reason"),
    [({"expert_gating_func": 1}, "softmax"), ({}, "softmax \\(llama.cpp's default\\)")],
)
def test_a_softmax_routed_file_is_refused(tmp_path: Path, gating: Any, reason: str) -> None:
    """DeepSeek-V2 / V2-Lite route by softmax (llama.cpp also reads a file stating no gating
    function so): pagoda's router is V3's sigmoid with a correction bias, so it refuses."""
    path = _write(tmp_path / "v2.gguf", SHAPE | gating)
    with pytest.raises(ValueError, match=f"routes its experts by {reason}.*DeepSeek-V3's router"):
        LLM(str(path), quantization="none", skip_tokenizer_init=True)


def test_a_dense_file_needs_no_router(tmp_path: Path) -> None:
    path = _write(tmp_path / "dense.gguf", SHAPE | {"leading_dense_block_count": 3})
    assert load_hf_config(str(tmp_path), path.name).first_k_dense_replace == 3


def test_what_a_file_leaves_out_reads_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """No q_lora_rank: one q_proj (V2-Lite's shape); no groups, weight scale or norm: one group,
    1, none (the config class's defaults are V3's 8 groups, 2.5, renormalized); no output
    tensor: tied; no vocab_size: the embedding's rows; no special ids: None; no rope scaling."""
    path = _write(tmp_path / "plain.gguf", SHAPE | {"expert_gating_func": 2})
    config = load_hf_config(str(tmp_path), path.name)
    assert config.model_type == "deepseek_v3"
    assert (config.q_lora_rank, config.n_group, config.topk_group) == (None, 1, 1)
    assert (config.routed_scaling_factor, config.norm_topk_prob) == (1.0, False)
    assert (config.tie_word_embeddings, config.vocab_size) == (True, VOCAB)
    assert (config.bos_token_id, config.eos_token_id) == (None, None)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 16, 24)
    assert config.num_key_value_heads == 4  # every head's own keys; the file's 1 is the latent
    assert hasattr(DeepseekV3ForCausalLM(config).model.layers[0].self_attn, "q_proj")


def test_llama_cpp_s_names() -> None:
    family = gguf_family("deepseek2")
    assert family is not None
    for name, hf in (
        ("blk.0.attn_q.weight", "self_attn.q_proj.weight"),
        ("blk.0.attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
        ("blk.0.attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        ("blk.0.exp_probs_b.bias", "mlp.gate.e_score_correction_bias"),
        ("blk.0.ffn_gate_inp.weight", "mlp.gate.weight"),
        ("blk.0.ffn_up_exps.weight", "mlp.experts.up_proj.weight"),
        ("blk.0.ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"),
    ):
        assert gguf_to_hf_name(name, family) == f"model.layers.0.{hf}"


@pytest.mark.parametrize("raw", [False, True])
def test_quantized_k_b_and_v_b_join_into_hf_s_kv_b_proj(tmp_path: Path, raw: bool) -> None:
    """llama.cpp cuts kv_b_proj (H * (nope + v), rank) per head into attn_k_b (H, rank, nope),
    each head's key rows transposed, and attn_v_b (H, v, rank); here both Q8_0. Read as float or
    kept raw (the gguf method), they join back into HF's layout, decoded (kv_b_proj stays float)."""
    heads, nope, v, rank = 2, 32, 32, 32
    kv_b = torch.randn(heads * (nope + v), rank, generator=torch.Generator().manual_seed(0))
    per_head = kv_b.view(heads, nope + v, rank)
    halves = {
        "attn_k_b": per_head[:, :nope].transpose(1, 2).contiguous().numpy(),
        "attn_v_b": per_head[:, nope:].contiguous().numpy(),
    }
    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = {name: gguf.quants.quantize(half, q8) for name, half in halves.items()}
    tensors = {f"blk.0.{name}.weight": (data, q8) for name, data in quantized.items()}
    path = _write(tmp_path / "kv-b.gguf", SHAPE, tensors)
    k_b, v_b = (gguf.quants.dequantize(quantized[n], q8) for n in ("attn_k_b", "attn_v_b"))
    expected = np.concatenate([np.concatenate([k_b[h].T, v_b[h]]) for h in range(heads)])

    config = DeepseekV3Config(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=heads, q_lora_rank=None,
        kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=16, v_head_dim=v,
        first_k_dense_replace=1, vocab_size=VOCAB, intermediate_size=128,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(config)
    loaded = model.load_weights(iter_weights(str(tmp_path), path.name, raw_gguf=raw))
    assert "model.layers.0.self_attn.kv_b_proj.weight" in loaded
    weight = model.model.layers[0].self_attn.kv_b_proj.weight
    torch.testing.assert_close(weight, torch.from_numpy(expected), rtol=0, atol=0)
    torch.testing.assert_close(weight, kv_b, rtol=0, atol=0.05)  # Q8_0's round trip
