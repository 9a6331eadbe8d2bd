"""The GPTQ / AWQ checkpoint writers of tests/quant_formats.py: bit layouts against hand-computed
int32 words, pack/unpack and quantize/dequantize round trips, and a written checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.quant_formats import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    awq_dequantize,
    awq_quantize,
    gptq_dequantize,
    gptq_quantize,
    pack_int4_cols,
    pack_int4_rows,
    unpack_int4_cols,
    unpack_int4_rows,
    write_quantized_checkpoint,
)


def _i32(word: int) -> int:
    """An unsigned 32-bit word written in hex -> the int32 value with its bits."""
    return word - 2**32 if word >= 2**31 else word


def _tiny_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An 8x8 weight whose round-to-nearest 4-bit quantization is known exactly: one group of 8
    inputs, q[o] = [0, 1+o, 2+o, ..., 6+o, 15], zero z[o] = o + 1, power-of-two scales.
    Each row holds 0 and 15, so min/max quantization recovers s and z exactly."""
    q = torch.tensor([[0, *range(1 + o, 7 + o), 15] for o in range(8)])  # (out, in)
    z = torch.arange(8) + 1  # (out,)
    s = torch.tensor([2.0 ** -(4 + o % 3) for o in range(8)])  # (out,)
    w = (q - z[:, None]).to(torch.float32) * s[:, None]
    return w, q, z, s


# ---------------------------------------------------------------------------------------------
# Bit layouts, by hand


def test_gptq_layout_by_hand() -> None:
    w, _, _, s = _tiny_example()
    t = gptq_quantize(w, group_size=8, desc_act=False, sym=False)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (1, 8)
    # Column o packs inputs 0..7 of output o, input i in bits 4i: nibbles (high to low)
    # 15, 6+o, 5+o, ..., 1+o, 0.
    expected = [
        0xF6543210,
        0xF7654320,
        0xF8765430,
        0xF9876540,
        0xFA987650,
        0xFBA98760,
        0xFCBA9870,
        0xFDCBA980,
    ]
    assert t["qweight"][0].tolist() == [_i32(x) for x in expected]
    # Zeros 1..8 stored minus one, output o in bits 4o.
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].tolist() == [[0x76543210]]
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    assert torch.equal(t["scales"][0].float(), s)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].tolist() == [0] * 8
    assert torch.equal(gptq_dequantize(t, 8), w)


def test_gptq_symmetric_zero_is_stored_as_seven() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    t = gptq_quantize(w, group_size=32, sym=True)
    assert t["qzeros"].shape == (2, 2)
    assert (t["qzeros"] == 0x77777777).all()


def test_awq_layout_by_hand() -> None:
    w, _, _, s = _tiny_example()
    t = awq_quantize(w, group_size=8)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (8, 1)
    # Row i packs outputs 0..7 of input i, nibble k holding output AWQ_ORDER[k]
    # (0, 2, 4, 6, 1, 3, 5, 7). Input 0 is all zeros, input 7 all 15; input i in 1..6 holds
    # i + o for output o, i.e. nibbles (high to low) i+7, i+5, i+3, i+1, i+6, i+4, i+2, i.
    expected = [
        0x00000000,
        0x86427531,
        0x97538642,
        0xA8649753,
        0xB975A864,
        0xCA86B975,
        0xDB97CA86,
        0xFFFFFFFF,
    ]
    assert t["qweight"][:, 0].tolist() == [_i32(x) for x in expected]
    # Zeros o + 1 stored as they are, in the same interleaved order.
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].tolist() == [[_i32(0x86427531)]]
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    assert torch.equal(t["scales"][0].float(), s)
    assert set(t) == {"qweight", "qzeros", "scales"}
    assert torch.equal(awq_dequantize(t, 8), w)


def test_awq_orders_are_inverse() -> None:
    assert [AWQ_ORDER[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


# ---------------------------------------------------------------------------------------------
# Independent readers, written the way vLLM's kernels address the bits


def _read_gptq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4)
    q = (t["qweight"][:, None, :] >> shifts[None, :, None]) & 0xF  # (in/8, 8, out)
    q = q.reshape(-1, t["qweight"].shape[1])
    z = ((t["qzeros"][:, :, None] >> shifts[None, None, :]) & 0xF).reshape(t["scales"].shape)
    g = t["g_idx"].long()
    return ((q - (z[g] + 1)).float() * t["scales"].float()[g]).t()


def _read_awq(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    # Output column 8c + j sits at shift 4 * AWQ_REVERSE_ORDER[j] (vLLM awq_triton).
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER)
    q = ((t["qweight"][:, :, None] >> shifts) & 0xF).reshape(t["qweight"].shape[0], -1)
    z = ((t["qzeros"][:, :, None] >> shifts) & 0xF).reshape(t["qzeros"].shape[0], -1)
    g = torch.arange(q.shape[0]) // group_size
    return ((q - z[g]).float() * t["scales"].float()[g]).t()


# ---------------------------------------------------------------------------------------------
# Round trips


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (64, 48), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4_rows(pack_int4_rows(q)), q)
    assert torch.equal(unpack_int4_cols(pack_int4_cols(q)), q)
    assert torch.equal(unpack_int4_cols(pack_int4_cols(q, AWQ_ORDER), AWQ_ORDER), q)
    with pytest.raises(ValueError):
        pack_int4_rows(q + 1)


@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_round_trip(group_size: int, desc_act: bool, sym: bool) -> None:
    out_f, in_f = 192, 256
    w = 0.1 * torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(2))
    t = gptq_quantize(w, group_size, desc_act=desc_act, sym=sym, seed=3)
    size = in_f if group_size == -1 else group_size
    n_groups = in_f // size
    assert t["qweight"].shape == (in_f // 8, out_f) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (n_groups, out_f // 8) and t["qzeros"].dtype == torch.int32
    assert t["scales"].shape == (n_groups, out_f) and t["scales"].dtype == torch.float16
    assert t["g_idx"].shape == (in_f,) and t["g_idx"].dtype == torch.int32
    g = t["g_idx"].long()
    assert torch.bincount(g, minlength=n_groups).tolist() == [size] * n_groups
    if desc_act and n_groups > 1:
        assert (g.diff() < 0).any()  # act-order: not monotone
    else:
        assert torch.equal(g, torch.arange(in_f) // size)

    deq = gptq_dequantize(t, group_size)
    assert torch.equal(deq, _read_gptq(t))
    step = t["scales"].float()[g].t()  # (out, in)
    assert ((deq - w).abs() <= step * 1.001).all()
    assert (deq - w).abs().mean() < 0.3 * step.mean()


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_round_trip(group_size: int) -> None:
    out_f, in_f = 128, 256
    w = 0.1 * torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(4))
    t = awq_quantize(w, group_size)
    size = in_f if group_size == -1 else group_size
    n_groups = in_f // size
    assert t["qweight"].shape == (in_f, out_f // 8) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (n_groups, out_f // 8) and t["qzeros"].dtype == torch.int32
    assert t["scales"].shape == (n_groups, out_f) and t["scales"].dtype == torch.float16

    deq = awq_dequantize(t, group_size)
    assert torch.equal(deq, _read_awq(t, size))
    step = t["scales"].float()[torch.arange(in_f) // size].t()
    assert ((deq - w).abs() <= step * 1.001).all()
    assert (deq - w).abs().mean() < 0.3 * step.mean()


# ---------------------------------------------------------------------------------------------
# Checkpoints


class _NoTokenizer:
    def save_pretrained(self, folder: str) -> None:
        pass


@pytest.mark.parametrize(
    "method,desc_act", [("gptq", False), ("gptq", True), ("awq", False)], ids=str
)
def test_write_quantized_checkpoint(tmp_path, method: str, desc_act: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )
    ref = write_quantized_checkpoint(
        tmp_path, config, method, group_size=32, desc_act=desc_act, tokenizer=_NoTokenizer()
    )
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    hf_config = json.load(open(os.path.join(tmp_path, "config.json")))
    qc = hf_config["quantization_config"]
    assert qc["quant_method"] == method and qc["bits"] == 4 and qc["group_size"] == 32
    if method == "gptq":
        assert qc["desc_act"] is desc_act and qc["sym"] is True
        assert json.load(open(os.path.join(tmp_path, "quantize_config.json"))) == qc
    else:
        assert qc["zero_point"] is True and qc["version"] == "gemm"

    prefix = "model.layers.0."
    linears = [f"{prefix}self_attn.{m}_proj" for m in "qkvo"]
    linears += [f"{prefix}mlp.{m}_proj" for m in ("gate", "up", "down")]
    leaves = {"qweight", "qzeros", "scales"} | ({"g_idx"} if method == "gptq" else set())
    for lin in linears:
        assert f"{lin}.weight" not in saved
        packed = {leaf: saved[f"{lin}.{leaf}"] for leaf in leaves}
        deq = gptq_dequantize(packed, 32) if method == "gptq" else awq_dequantize(packed, 32)
        assert torch.equal(deq, ref[f"{lin}.weight"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert saved[name].dtype == torch.float16
        assert torch.equal(saved[name].float(), ref[name])

    # The reference loads strictly into a float model of the stored config.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    model.load_state_dict(ref)
