"""Each model against HF transformers (float32): full-prompt logits, chunked prefill and decode
through the paged KV cache, and a flat batch of two sequences; plus loader and registry errors.

The tiny random models (conftest.py) cover Llama (llama3 rope, sharded safetensors, untied head),
Qwen2 (q/k/v bias, tied), Qwen3 (q/k norm, explicit head_dim), Mistral (a sliding window on
every layer) and Gemma 3 (local and global layers, their own rope, (1 + w) norms, GeGLU, scaled
embedding); the window (6) is well inside the prompts, so chunks and decodes cross it. SmolLM2
comes from its GGUF.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagoda.config import EngineConfig
from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import forward_context
from pagoda.layers.rotary import compute_inv_freq, get_rope, rope_parameters
from pagoda.loading.gguf import gguf_to_hf_name, unpermute_qk
from pagoda.loading.hf_config import GGUFConfig, _family_fields, load_hf_config, max_positions
from pagoda.loading.loader import iter_weights, load_model
from pagoda.loading.model_files import resolve_model
from pagoda.model_config import kv_cache_dims_of
from pagoda.models import FAMILIES, MODEL_REGISTRY, architectures_of, get_model_class, gguf_family
from pagoda.models.llama import LlamaForCausalLM
from pagoda.runner.step_inputs import build_attention_metadata
from tests.conftest import TINY_ARCHS
from tests.oracle import assert_greedy_matches, assert_logits_close, hf_greedy, hf_logits

ARCHS = list(TINY_ARCHS)
BLOCK_SIZE = 4
TINY_ATOL = 1e-4
SMOLLM2_ATOL = 5e-4

# One prompt of 21 tokens and one of 6; arbitrary ids inside SmolLM2's vocabulary.
PROMPT_A = [(37 * i + 11) % 5000 + 100 for i in range(21)]
PROMPT_B = [4242, 17, 905, 28120, 330, 77]


class PagedRunner:
    """Drives a pagoda model step by step over a paged KV cache with hand-picked block ids,
    the way the model runner does: one flat batch per step, metadata from the forward context."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64) -> None:
        cfg = model.config
        kv_heads, k_dim, v_dim = kv_cache_dims_of(cfg)  # a latent cache: (1, rank + rope, 0)
        self.model = model
        self.kv_caches = [
            KVCache.allocate(
                num_blocks, BLOCK_SIZE, kv_heads, k_dim, model.dtype, None, "cpu", v_dim
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    @torch.no_grad()
    def step(
        self, chunks: Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[list[int]]
    ) -> list[torch.Tensor]:
        """chunks[i] are the new tokens of sequence i, at positions starts[i]...; returns each
        sequence's (len(chunk), vocab) logits."""
        input_ids = torch.tensor([t for chunk in chunks for t in chunk])
        positions = torch.cat([torch.arange(s, s + len(c)) for c, s in zip(chunks, starts)])
        meta = build_attention_metadata(
            [len(c) for c in chunks],
            [s + len(c) for c, s in zip(chunks, starts)],
            [list(t) for t in tables],
            BLOCK_SIZE,
        )
        with forward_context(meta, self.kv_caches):
            hidden = self.model(input_ids, positions)  # (num_tokens, hidden_size)
        logits = self.model.compute_logits(hidden)  # (num_tokens, vocab)
        return list(logits.split([len(c) for c in chunks]))


def _greedy_step(logits: torch.Tensor) -> tuple[int, float]:
    logprobs = torch.log_softmax(logits[-1], dim=-1)
    token = int(logprobs.argmax())
    return token, float(logprobs[token])


@pytest.fixture(scope="module")
def tiny_pagoda(tiny_model_dir: Any) -> Any:
    loaded: dict[str, LlamaForCausalLM] = {}

    def load(arch: str) -> LlamaForCausalLM:
        if arch not in loaded:
            loaded[arch] = load_model(EngineConfig(model=tiny_model_dir(arch), device="cpu"))[0]
        return loaded[arch]

    return load


@pytest.fixture(scope="module")
def smollm2_pagoda() -> tuple[LlamaForCausalLM, Any]:
    model, model_config, tokenizer = load_model(EngineConfig(device="cpu", quantization="none"))
    assert model_config.architecture == "LlamaForCausalLM"
    assert model_config.max_model_len == 8192
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# Model vs HF


def _check_full_prompt(model: LlamaForCausalLM, hf_model: torch.nn.Module, atol: float) -> None:
    runner = PagedRunner(model)
    (logits,) = runner.step([PROMPT_A], [0], [[3, 0, 7, 5, 1, 9]])
    assert_logits_close(logits, hf_logits(hf_model, PROMPT_A), atol, "full prompt")


def _check_chunked_then_decode(
    model: LlamaForCausalLM, hf_model: torch.nn.Module, atol: float, decode_steps: int = 8
) -> None:
    """PROMPT_A in 3 chunks (7 + 9 + 5 tokens), then greedy decode, on non-contiguous blocks."""
    runner = PagedRunner(model)
    table = [11, 2, 30, 7, 19, 4, 25, 8]  # 8 blocks of 4 cover 32 positions
    expected = hf_logits(hf_model, PROMPT_A)
    start = 0
    for size in (7, 9, 5):
        (logits,) = runner.step([PROMPT_A[start : start + size]], [start], [table])
        assert_logits_close(
            logits, expected[start : start + size], atol, f"chunk at {start}, {size} tokens"
        )
        start += size
    tokens, logprobs = [], []
    token, logprob = _greedy_step(logits)
    for _ in range(decode_steps):
        tokens.append(token)
        logprobs.append(logprob)
        (logits,) = runner.step([[token]], [start], [table])
        start += 1
        token, logprob = _greedy_step(logits)
    hf = hf_greedy(hf_model, [PROMPT_A], decode_steps)
    assert_greedy_matches([tokens], hf, [logprobs], logprob_atol=atol * 10)


def _check_flat_batch(
    model: LlamaForCausalLM, hf_model: torch.nn.Module, atol: float, decode_steps: int = 6
) -> None:
    """Two sequences share every step: A's first chunk with B's whole prompt, then A's last
    chunk with B's first decode, then decodes of both."""
    runner = PagedRunner(model)
    tables = [[9, 1, 14, 3, 12, 6, 20, 15], [5, 13, 0, 8, 2]]
    hf_a = hf_logits(hf_model, PROMPT_A)
    hf_b = hf_logits(hf_model, PROMPT_B)
    logits_a, logits_b = runner.step([PROMPT_A[:12], PROMPT_B], [0, 0], tables)
    assert_logits_close(logits_a, hf_a[:12], atol, "A, first chunk")
    assert_logits_close(logits_b, hf_b, atol, "B, whole prompt")
    b_token, b_lp = _greedy_step(logits_b)
    out: list[list[int]] = [[], [b_token]]
    lps: list[list[float]] = [[], [b_lp]]
    logits_a, logits_b = runner.step([PROMPT_A[12:], [b_token]], [12, len(PROMPT_B)], tables)
    assert_logits_close(logits_a, hf_a[12:], atol, "A, last chunk")
    lens = [len(PROMPT_A), len(PROMPT_B) + 1]
    for _ in range(decode_steps):
        nexts = [_greedy_step(logits_a), _greedy_step(logits_b)]
        for i, (token, lp) in enumerate(nexts):
            out[i].append(token)
            lps[i].append(lp)
        logits_a, logits_b = runner.step([[nexts[0][0]], [nexts[1][0]]], lens, tables)
        lens = [n + 1 for n in lens]
    for i, (token, lp) in enumerate([_greedy_step(logits_a), _greedy_step(logits_b)]):
        out[i].append(token)
        lps[i].append(lp)
    hf = [hf_greedy(hf_model, [p], len(t))[0] for p, t in zip((PROMPT_A, PROMPT_B), out)]
    assert_greedy_matches(out, hf, lps, logprob_atol=atol * 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_full_prompt_logits_match_hf(arch: str, tiny_pagoda: Any, tiny_hf_model: Any) -> None:
    _check_full_prompt(tiny_pagoda(arch), tiny_hf_model(arch), TINY_ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_chunked_prefill_then_decode_matches_hf(
    arch: str, tiny_pagoda: Any, tiny_hf_model: Any
) -> None:
    _check_chunked_then_decode(tiny_pagoda(arch), tiny_hf_model(arch), TINY_ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_flat_batch_of_two_matches_hf(arch: str, tiny_pagoda: Any, tiny_hf_model: Any) -> None:
    _check_flat_batch(tiny_pagoda(arch), tiny_hf_model(arch), TINY_ATOL)


def test_smollm2_full_prompt_logits_match_hf(smollm2_pagoda: Any, smollm2_hf: Any) -> None:
    _check_full_prompt(smollm2_pagoda[0], smollm2_hf, SMOLLM2_ATOL)


def test_smollm2_chunked_prefill_then_decode_matches_hf(
    smollm2_pagoda: Any, smollm2_hf: Any
) -> None:
    _check_chunked_then_decode(smollm2_pagoda[0], smollm2_hf, SMOLLM2_ATOL, decode_steps=4)


def test_smollm2_flat_batch_of_two_matches_hf(smollm2_pagoda: Any, smollm2_hf: Any) -> None:
    _check_flat_batch(smollm2_pagoda[0], smollm2_hf, SMOLLM2_ATOL, decode_steps=2)


def test_smollm2_chat_prompt_greedy_matches_hf(smollm2_pagoda: Any, smollm2_hf: Any) -> None:
    model, tokenizer = smollm2_pagoda
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>assistant" in text  # the GGUF's chat template survived the cache
    prompt = tokenizer.encode(text, add_special_tokens=False)
    runner = PagedRunner(model, num_blocks=32)
    table = list(range(31, 31 - (len(prompt) + 8) // BLOCK_SIZE - 1, -1))
    (logits,) = runner.step([prompt], [0], [table])
    tokens, lps = [], []
    for pos in range(len(prompt), len(prompt) + 8):
        token, lp = _greedy_step(logits)
        tokens.append(token)
        lps.append(lp)
        (logits,) = runner.step([[token]], [pos], [table])
    assert_greedy_matches([tokens], hf_greedy(smollm2_hf, [prompt], 8), [lps], logprob_atol=1e-3)
    assert "Paris" in tokenizer.decode(tokens)


# ---------------------------------------------------------------------------------------------
# GGUF weights


def test_gguf_weights_equal_hf_gguf_loading(smollm2_pagoda: Any, smollm2_hf: Any) -> None:
    """Dequantized (Q8_0, Q4_1, F32) and un-permuted (q, k) tensors equal HF's, slice by slice."""
    model = smollm2_pagoda[0]
    hf = dict(smollm2_hf.named_parameters())
    ours = dict(model.named_parameters())
    q_size, kv_size = 9 * 64, 3 * 64
    for layer in (0, 17):
        prefix = f"model.layers.{layer}"
        qkv = ours[f"{prefix}.self_attn.qkv_proj.weight"]
        torch.testing.assert_close(
            qkv[:q_size], hf[f"{prefix}.self_attn.q_proj.weight"], rtol=0, atol=0
        )
        k = qkv[q_size : q_size + kv_size]
        torch.testing.assert_close(k, hf[f"{prefix}.self_attn.k_proj.weight"], rtol=0, atol=0)
        gate_up = ours[f"{prefix}.mlp.gate_up_proj.weight"]
        torch.testing.assert_close(
            gate_up[1536:], hf[f"{prefix}.mlp.up_proj.weight"], rtol=0, atol=0
        )
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            torch.testing.assert_close(
                ours[f"{prefix}.{name}"], hf[f"{prefix}.{name}"], rtol=0, atol=0
            )
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        torch.testing.assert_close(ours[name], hf[name], rtol=0, atol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unpermute_qk_inverts_llama_cpp_permutation() -> None:
    n_head, head_dim, cols = 3, 8, 5
    hf_weight = torch.randn(n_head * head_dim, cols)
    # llama.cpp's converter: within each head, interleave the two rotate_half halves.
    gguf_weight = (
        hf_weight.reshape(n_head, 2, head_dim // 2, cols).transpose(1, 2).reshape(hf_weight.shape)
    )
    assert not torch.equal(gguf_weight, hf_weight)
    assert torch.equal(unpermute_qk(gguf_weight, n_head), hf_weight)
    hf_bias = torch.randn(n_head * head_dim)
    gguf_bias = hf_bias.reshape(n_head, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(unpermute_qk(gguf_bias, n_head), hf_bias)


def test_gguf_tensor_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="not supported"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
    # Gemma 3's table: four norms per layer, `ffn_norm` the one before the MLP
    gemma = gguf_family("gemma3")
    assert gemma is not None and gemma.gguf_norm_shift == 1.0 and not gemma.gguf_permute_qk
    for gguf, hf in (
        ("attn_norm", "input_layernorm"),
        ("post_attention_norm", "post_attention_layernorm"),
        ("ffn_norm", "pre_feedforward_layernorm"),
        ("post_ffw_norm", "post_feedforward_layernorm"),
        ("attn_q_norm", "self_attn.q_norm"),
    ):
        assert gguf_to_hf_name(f"blk.5.{gguf}.weight", gemma) == f"model.layers.5.{hf}.weight"
    assert gguf_family("llama") is not None and gguf_family("llama").gguf_permute_qk
    assert gguf_family("phi9") is None


def test_gguf_config_cache_equals_fresh_config(smollm2_path: str, smollm2_hf: Any) -> None:
    cached = load_hf_config(*os.path.split(smollm2_path))
    fresh = smollm2_hf.config
    for key in (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
        "eos_token_id",
    ):
        assert getattr(cached, key) == getattr(fresh, key), key


# ---------------------------------------------------------------------------------------------
# Rotary


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_inv_freq_matches_hf(rope: dict[str, Any]) -> None:
    cfg = LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    if rope["rope_type"] == "default":
        expected, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(compute_inv_freq(rope_parameters(cfg), 64), expected)


def test_longrope_short_then_long_factors_match_hf() -> None:
    """Phi-3's longrope with partial rotary: positions before original_max_position_embeddings
    take HF's short-factor angles, later ones its long-factor angles (HF's choice for a sequence
    past the original context), both scaled by HF's attention factor."""
    original, rotary_dim = 64, 8
    params = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.25 * i for i in range(rotary_dim // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(rotary_dim // 2)],
        "original_max_position_embeddings": original,
    }
    cfg = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters=params,
        original_max_position_embeddings=original,
    )
    rope = get_rope(cfg, 16, cfg.max_position_embeddings)
    assert rope.head_dim == rotary_dim
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=original + 1)
    assert scaling > 1.0
    for positions, inv_freq in (
        (torch.arange(original), short),
        (torch.arange(original, 256), long),
    ):
        angles = torch.outer(positions.float(), inv_freq)
        cos, sin = rope.cos_sin(positions, torch.float32)
        torch.testing.assert_close(cos.squeeze(1), angles.cos() * scaling)
        torch.testing.assert_close(sin.squeeze(1), angles.sin() * scaling)


def test_rope_parameters_fallback_to_legacy_attributes() -> None:
    class Legacy:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    params = rope_parameters(Legacy())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1234.0
    assert params["factor"] == 2.0


def test_unsupported_rope_type_raises() -> None:
    cfg = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        get_rope(cfg, 128, 16)


# ---------------------------------------------------------------------------------------------
# Registry and loader errors


def test_registry_lists_supported_architectures() -> None:
    assert get_model_class(["Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    assert get_model_class(["Gemma3ForCausalLM"]).__name__ == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="supported architectures: LlamaForCausalLM, Mistral"):
        get_model_class(["GPT2LMHeadModel"])
    # every architecture name is in exactly one family's table
    names = [a for family, _ in FAMILIES for a in family.architectures]
    assert len(names) == len(set(names)) == len(MODEL_REGISTRY)


def test_gguf_configs_name_their_family_by_model_type() -> None:
    # a config read from a GGUF file carries no `architectures`
    assert architectures_of(GGUFConfig(model_type="gemma3_text")) == ["Gemma3ForCausalLM"]
    assert architectures_of(GGUFConfig(model_type="qwen2")) == ["Qwen2ForCausalLM"]
    assert architectures_of(GGUFConfig(model_type="phi3")) == ["Phi3ForCausalLM"]
    assert architectures_of(GGUFConfig(model_type="gpt2")) == ["<model_type gpt2>"]
    assert architectures_of(Qwen2Config()) == ["Qwen2ForCausalLM"]


def test_resolve_model(tmp_path: Any, smollm2_path: str, tiny_model_dir: Any) -> None:
    assert resolve_model(None) == os.path.split(smollm2_path)
    assert resolve_model(smollm2_path) == os.path.split(smollm2_path)
    assert resolve_model(tiny_model_dir("qwen2")) == (tiny_model_dir("qwen2"), None)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="neither config.json nor a .gguf"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == (str(tmp_path), "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_load_model_errors(tiny_model_dir: Any, tmp_path: Any) -> None:
    path = tiny_model_dir("qwen3")
    with pytest.raises(ValueError, match="max-model-len 1024"):
        load_model(EngineConfig(model=path, max_model_len=4096, device="cpu"))
    with pytest.raises(ValueError, match="load_format='gguf'"):
        load_model(EngineConfig(model=path, load_format="gguf", device="cpu"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text(open(os.path.join(path, name)).read())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(EngineConfig(model=str(tmp_path), device="cpu"))


def test_dummy_load_format(tiny_model_dir: Any) -> None:
    config = EngineConfig(
        model=tiny_model_dir("qwen2"), load_format="dummy", max_model_len=64, device="cpu"
    )
    model, model_config, tokenizer = load_model(config)
    again = load_model(config)[0]
    assert model_config.max_model_len == 64 and model_config.architecture == "Qwen2ForCausalLM"
    assert not any(p.requires_grad for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    (logits,) = PagedRunner(model).step([PROMPT_B], [0], [[1, 0]])
    assert logits.shape == (len(PROMPT_B), 49152) and torch.isfinite(logits).all()
    assert tokenizer.encode("hello world") == [28120, 905]


# HF -> llama.cpp tensor names, written independently of the loader's table.
_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# A type per projection, so one file exercises most supported types (the K-quants need rows of
# 256 values, longer than the tiny models have).
_QTYPES = {
    "model.embed_tokens": "Q8_0",
    "lm_head": "Q8_0",
    "self_attn.q_proj": "Q4_0",
    "self_attn.k_proj": "Q8_0",
    "self_attn.v_proj": "F16",
    "self_attn.o_proj": "BF16",
    "mlp.gate_proj": "Q4_1",
    "mlp.up_proj": "Q4_0",
    "mlp.down_proj": "Q4_1",
}


def _write_gguf(folder: str, gguf_arch: str, path: str) -> dict[str, torch.Tensor]:
    """Convert a tiny HF checkpoint to GGUF as llama.cpp would (q/k rows permuted for "llama");
    returns the HF-named tensors a correct reader must give back (quantization round trip)."""
    import gguf
    from safetensors.torch import load_file

    hf_config = load_hf_config(folder, None)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    expected = {}
    for hf_name, tensor in tensors.items():
        stem, _, suffix = hf_name.rpartition(".")
        if stem.startswith("model.layers."):
            layer, _, module = stem.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"
        else:
            module = stem
            gguf_name = f"{_HF_TO_GGUF[module]}.{suffix}"
        array = tensor.numpy()
        if gguf_arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            n_head = hf_config.num_attention_heads
            if module == "self_attn.k_proj":
                n_head = hf_config.num_key_value_heads
            rows = array.shape[0]
            array = (
                array.reshape(n_head, 2, rows // n_head // 2, *array.shape[1:])
                .swapaxes(1, 2)
                .reshape(array.shape)
            )
        qtype = gguf.GGMLQuantizationType[
            _QTYPES.get(module, "F32") if suffix == "weight" else "F32"
        ]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
            expected[hf_name] = tensor
        else:
            quantized = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, quantized, raw_dtype=qtype)
            expected[hf_name] = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize(
    ("arch", "gguf_arch"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")]
)
def test_gguf_reader_gives_back_hf_tensors(
    arch: str, gguf_arch: str, tiny_model_dir: Any, tmp_path: Any
) -> None:
    path = str(tmp_path / f"tiny-{arch}.gguf")
    expected = _write_gguf(tiny_model_dir(arch), gguf_arch, path)
    got = dict(iter_weights(str(tmp_path), os.path.basename(path)))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.v_proj.bias" in got


def test_gguf_f16_and_bf16_weights_keep_the_file_s_two_bytes(
    tiny_model_dir: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny Qwen3 file's F16 v_proj and BF16 o_proj (_QTYPES) come raw as their blocks and
    stay 2 bytes a weight on the CPU kernels (cpu_f16 inside qkv's parts, cpu_bf16), giving the
    file's weights' products in float32 (within the float32 dot product's rounding bound)."""
    from pagoda.kernels.cpu import built
    from pagoda.layers.cpu_forms import cpu_matmul
    from pagoda.layers.linear import Linear
    from pagoda.layers.quant import make_method

    assert built() is not None, "the CPU kernels must build here"
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "1")
    folder = tiny_model_dir("qwen3")
    path = str(tmp_path / "tiny-qwen3.gguf")
    expected = _write_gguf(folder, "qwen3", path)
    hf_config = load_hf_config(folder, None)
    model = get_model_class(architectures_of(hf_config))(hf_config)
    method = make_method("gguf", {})
    for module in model.modules():
        if isinstance(module, Linear):
            module.set_quant_method(method)
    model.load_weights(iter_weights(str(tmp_path), "tiny-qwen3.gguf", raw_gguf=True))
    attention: Any = model.model.layers[0].self_attn
    for module in model.modules():
        if isinstance(module, Linear):
            module.finalize()
    assert [p.kernel for p in attention.qkv_proj.parts] == ["cpu_q4_0", "cpu_q8", "cpu_f16"]
    assert attention.o_proj.kernel == "cpu_bf16"
    v, o = (expected[f"model.layers.0.self_attn.{n}.weight"].double() for n in ("v_proj", "o_proj"))
    assert attention.qkv_proj.parts[2].packed.numel() == -(-v.shape[0] // 16) * 16 * v.shape[1]
    for weight, run in (
        (v, lambda x: cpu_matmul(attention.qkv_proj.parts[2], x)),
        (o, attention.o_proj),
    ):
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        exact = x.double() @ weight.T
        bound = weight.shape[1] * 2.0**-24 * (x.double().abs() @ weight.abs().T)
        assert ((run(x).double() - exact).abs() <= bound).all()


def test_max_positions_is_the_checkpoints_not_its_window() -> None:
    # a sliding window bounds what a layer attends to, not how long a sequence may be
    assert max_positions(MistralConfig(max_position_embeddings=32768, sliding_window=4096)) == 32768
    qwen2 = Qwen2Config(max_position_embeddings=32768, use_sliding_window=False)
    assert max_positions(qwen2) == 32768


def test_a_mixtures_stacked_gguf_experts_load_per_expert_and_stay_quantized(
    tiny_weights_dir: Any, tmp_path: Any
) -> None:
    """Qwen3-MoE's experts in a GGUF file: one Q8_0 tensor per projection for all experts
    (`ffn_gate_exps`: (experts, moe_intermediate, hidden)), as llama.cpp writes them. Read as
    float they become each expert's HF tensors exactly (the quantization round trip); read raw
    (the gguf method) each expert keeps its Q8_0 rows: no expert is decoded into a larger form."""
    import gguf
    from safetensors.torch import load_file

    from pagoda.layers.linear import Linear
    from pagoda.layers.quant import make_method
    from pagoda.models.qwen3_moe import Qwen3MoeForCausalLM

    folder = tiny_weights_dir("qwen3_moe")
    hf_config = load_hf_config(folder, None)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    path = str(tmp_path / "tiny-moe.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_uint32("qwen3moe.expert_feed_forward_length", 32)
    writer.add_expert_count(8)
    q8 = gguf.GGMLQuantizationType.Q8_0
    expected: dict[str, torch.Tensor] = {}
    for layer in (0, 2):  # the sparse layers
        stem = f"model.layers.{layer}.mlp"
        writer.add_tensor(
            f"blk.{layer}.ffn_gate_inp.weight", tensors[f"{stem}.gate.weight"].numpy()
        )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = torch.stack(
                [tensors[f"{stem}.experts.{e}.{proj}.weight"] for e in range(8)]
            ).numpy()
            quantized = gguf.quants.quantize(stacked, q8)
            writer.add_tensor(f"blk.{layer}.ffn_{proj[:-5]}_exps.weight", quantized, raw_dtype=q8)
            back = torch.from_numpy(gguf.quants.dequantize(quantized, q8))
            for e in range(8):
                expected[f"{stem}.experts.{e}.{proj}.weight"] = back[e]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # what transformers' GGUF config leaves out: the experts' width and count (it names the
    # count num_local_experts, Mixtral's name), llama.cpp's renormalization
    fields = {"moe_intermediate_size": 32, "num_experts": 8, "norm_topk_prob": True}
    assert _family_fields(path) == fields

    float_model = Qwen3MoeForCausalLM(hf_config)
    float_model.load_weights(iter_weights(str(tmp_path), "tiny-moe.gguf"))
    for name, tensor in expected.items():
        expert, _, proj = name.rpartition(".")[0].rpartition(".")
        linear: Any = float_model.get_submodule(expert)
        packed = linear.down_proj if proj == "down_proj" else linear.gate_up_proj
        rows = packed.weight if proj == "down_proj" else packed.weight.chunk(2)[proj == "up_proj"]
        torch.testing.assert_close(rows, tensor, rtol=0, atol=0, msg=name)

    raw_model = Qwen3MoeForCausalLM(hf_config)
    method = make_method("gguf", {})
    assert method is not None
    for module in raw_model.modules():
        if isinstance(module, Linear):
            module.set_quant_method(method)
    loaded = raw_model.load_weights(iter_weights(str(tmp_path), "tiny-moe.gguf", raw_gguf=True))
    assert len(loaded) == 2 * (1 + 8 * 3)  # each sparse layer: the router, 8 experts' 3 tensors
    for layer in (0, 2):
        for expert in raw_model.model.layers[layer].mlp.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                linear.finalize()  # the file holds only the experts: the others stay unloaded
                assert linear.kernel in ("cpu_q8", "int8"), linear.kernel
