"""Writers for 4-bit GPTQ and AWQ checkpoints in the layout the real tools store, so the loaders
can be tested without downloading a quantized model. A test helper, not a test file.

Quantization here is plain round-to-nearest (no Hessian, no activation-aware scaling): only the
storage format has to match the tools, and every function returns or checks against the exact
float32 dequantization of what it wrote.

GPTQ (AutoGPTQ `QuantLinear.pack`, GPTQModel, format "gptq" = v1), for a linear with weight
(out, in), group size G and n_groups = in // G:
- qweight int32 (in // 8, out): packed along the input dim; row r, column o holds the 4-bit
  values of inputs 8r..8r+7 of output o, input 8r+j in bits 4j..4j+3. Rows are in the original
  input order, also with act-order.
- qzeros  int32 (n_groups, out // 8): packed along the output dim; column c holds outputs
  8c..8c+7, output 8c+j in bits 4j..4j+3. The stored value is zero - 1 (the v1 convention;
  readers add 1 back).
- scales  float16 (n_groups, out).
- g_idx   int32 (in,): the group of each input. Without act-order g_idx[i] = i // G; with it
  (desc_act) the inputs are visited in a permuted order perm and g_idx[i] = pos(i) // G, where
  pos(i) is the place of input i in perm, so g_idx is not monotone.
- dequantization: w[o, i] = (q[i, o] - (z[g_idx[i], o] + 1)) * s[g_idx[i], o].

AWQ (AutoAWQ `WQLinear_GEMM.from_linear`, version "gemm"):
- qweight int32 (in, out // 8): packed along the output dim in AWQ's interleaved order; nibble k
  (bits 4k..4k+3) of column c holds output 8c + AWQ_ORDER[k], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5,
  7]. Equivalently output 8c+j sits in nibble AWQ_REVERSE_ORDER[j], [0, 4, 1, 5, 2, 6, 3, 7]
  (the shifts vLLM's awq_triton dequantize kernel uses).
- qzeros  int32 (n_groups, out // 8): same packing and order; the zero is stored as is (0..15).
- scales  float16 (n_groups, out). No g_idx: input i is in group i // G.
- dequantization: w[o, i] = (q[i, o] - z[i // G, o]) * s[i // G, o].

`write_quantized_checkpoint` builds a tiny random Llama (or takes a config / model), quantizes
every q/k/v/o/gate/up/down projection, and writes model.safetensors (`<module>.qweight`,
`.qzeros`, `.scales`, and `.g_idx` for GPTQ, instead of `<module>.weight`; everything else in
float16 as the tools save it), config.json with `quantization_config`, quantize_config.json for
GPTQ, and the SmolLM2 tokenizer files. It returns the float32 reference state dict (HF names)
that a float model must be loaded with to compute the same function.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

BITS = 4
PACK_FACTOR = 32 // BITS  # 4-bit values per int32
MAXQ = 2**BITS - 1
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a packed int32 holds column 8c + AWQ_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]
IDENTITY_ORDER = tuple(range(PACK_FACTOR))

QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The tiny Llama the checkpoints default to: every linear's in/out features a multiple of 64.
TINY_LLAMA: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# fp16 smallest normal: scales stay normal numbers so a reader's arithmetic is well conditioned.
_MIN_SCALE = 2.0**-14


# ---------------------------------------------------------------------------------------------
# Bit packing (int64 arithmetic, then a two's complement view as int32)


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def _check_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.int64)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > MAXQ):
        raise ValueError(f"4-bit values must lie in [0, {MAXQ}], got [{q.min()}, {q.max()}]")
    return q


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """(R, C) values in [0, 15] -> int32 (R // 8, C); row 8r+j goes to bits 4j of row r
    (GPTQ's qweight)."""
    q = _check_nibbles(q)
    rows, cols = q.shape
    if rows % PACK_FACTOR:
        raise ValueError(f"rows ({rows}) must be a multiple of {PACK_FACTOR}")
    shifts = BITS * torch.arange(PACK_FACTOR, dtype=torch.int64).view(1, PACK_FACTOR, 1)
    words = (q.view(rows // PACK_FACTOR, PACK_FACTOR, cols) << shifts).sum(dim=1)
    return _to_int32(words)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows: int32 (R // 8, C) -> int64 (R, C)."""
    shifts = BITS * torch.arange(PACK_FACTOR, dtype=torch.int64).view(1, PACK_FACTOR, 1)
    q = (packed.to(torch.int64).unsqueeze(1) >> shifts) & MAXQ
    return q.reshape(-1, packed.shape[1])


def pack_int4_cols(q: torch.Tensor, order: tuple[int, ...] = IDENTITY_ORDER) -> torch.Tensor:
    """(R, C) values in [0, 15] -> int32 (R, C // 8); nibble k (bits 4k) of column c holds
    column 8c + order[k]. order=IDENTITY_ORDER is GPTQ's qzeros, AWQ_ORDER AWQ's qweight/qzeros."""
    q = _check_nibbles(q)
    rows, cols = q.shape
    if cols % PACK_FACTOR:
        raise ValueError(f"columns ({cols}) must be a multiple of {PACK_FACTOR}")
    grouped = q.view(rows, cols // PACK_FACTOR, PACK_FACTOR)[:, :, list(order)]
    shifts = BITS * torch.arange(PACK_FACTOR, dtype=torch.int64)
    return _to_int32((grouped << shifts).sum(dim=2))


def unpack_int4_cols(packed: torch.Tensor, order: tuple[int, ...] = IDENTITY_ORDER) -> torch.Tensor:
    """Inverse of pack_int4_cols: int32 (R, C // 8) -> int64 (R, C)."""
    shifts = BITS * torch.arange(PACK_FACTOR, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(2) >> shifts) & MAXQ  # [..., k] = column order[k]
    inverse = [order.index(j) for j in range(PACK_FACTOR)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# Round-to-nearest quantization


def _group_size(group_size: int, in_features: int) -> int:
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    return size


def _check_shape(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if out_features % PACK_FACTOR or in_features % PACK_FACTOR:
        raise ValueError(
            f"in and out features must be multiples of {PACK_FACTOR}, got {tuple(weight.shape)}"
        )
    return out_features, in_features


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale as stored (float16), back in float32: quantizing with the stored scale keeps
    the reference dequantization exact."""
    return scale.clamp(min=_MIN_SCALE).to(torch.float16).to(torch.float32)


def gptq_quantize(
    weight: torch.Tensor,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """4-bit GPTQ v1 tensors of a (out, in) float weight: qweight, qzeros, scales, g_idx (see the
    module doc). desc_act=True visits the inputs in a random permutation (seeded), as act-order
    does, so g_idx is not monotone. sym=True uses zero 8 (stored as 7); sym=False an asymmetric
    zero clamped to [1, 15] (a stored v1 zero of 0 - 1 cannot be represented)."""
    w = weight.detach().to(torch.float32).cpu()
    out_features, in_features = _check_shape(w)
    size = _group_size(group_size, in_features)
    n_groups = in_features // size

    if desc_act:
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    else:
        perm = torch.arange(in_features)
    position = torch.empty_like(perm)
    position[perm] = torch.arange(in_features)
    g_idx = position // size  # (in,)

    grouped = w[:, perm].view(out_features, n_groups, size)
    xmin = grouped.amin(dim=2).clamp(max=0.0)  # (out, n_groups)
    xmax = grouped.amax(dim=2).clamp(min=0.0)
    if sym:
        scale = _fp16_scale(2.0 * torch.maximum(-xmin, xmax) / MAXQ)
        zero = torch.full_like(scale, (MAXQ + 1) // 2)
    else:
        scale = _fp16_scale((xmax - xmin) / MAXQ)
        zero = torch.round(-xmin / scale).clamp(1, MAXQ)

    q = torch.round(w / scale[:, g_idx]) + zero[:, g_idx]
    q = q.clamp(0, MAXQ).to(torch.int64)  # (out, in)
    return {
        "qweight": pack_int4_rows(q.t()),
        "qzeros": pack_int4_cols((zero.to(torch.int64) - 1).t()),
        "scales": scale.t().contiguous().to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def gptq_dequantize(tensors: dict[str, torch.Tensor], group_size: int = 128) -> torch.Tensor:
    """(out, in) float32 weight of GPTQ v1 tensors: (q - (z + 1)) * s, by g_idx (or i // G when
    the tensors have no g_idx)."""
    q = unpack_int4_rows(tensors["qweight"])  # (in, out)
    zeros = unpack_int4_cols(tensors["qzeros"]) + 1  # (n_groups, out)
    scales = tensors["scales"].to(torch.float32)
    in_features = q.shape[0]
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features) // _group_size(group_size, in_features)
    g_idx = g_idx.to(torch.int64)
    return ((q - zeros[g_idx]).to(torch.float32) * scales[g_idx]).t().contiguous()


def awq_quantize(
    weight: torch.Tensor, group_size: int = 128, seed: int = 0
) -> dict[str, torch.Tensor]:
    """4-bit AWQ GEMM tensors of a (out, in) float weight: qweight, qzeros, scales (see the
    module doc); asymmetric, zero in [0, 15]. seed is accepted for a signature like
    gptq_quantize's; round-to-nearest uses no randomness."""
    del seed
    w = weight.detach().to(torch.float32).cpu()
    out_features, in_features = _check_shape(w)
    size = _group_size(group_size, in_features)
    n_groups = in_features // size

    grouped = w.view(out_features, n_groups, size)
    xmin = grouped.amin(dim=2).clamp(max=0.0)  # (out, n_groups)
    xmax = grouped.amax(dim=2).clamp(min=0.0)
    scale = _fp16_scale((xmax - xmin) / MAXQ)
    zero = torch.round(-xmin / scale).clamp(0, MAXQ)

    group_of = torch.arange(in_features) // size
    q = torch.round(w / scale[:, group_of]) + zero[:, group_of]
    q = q.clamp(0, MAXQ).to(torch.int64)  # (out, in)
    return {
        "qweight": pack_int4_cols(q.t(), AWQ_ORDER),
        "qzeros": pack_int4_cols(zero.to(torch.int64).t(), AWQ_ORDER),
        "scales": scale.t().contiguous().to(torch.float16),
    }


def awq_dequantize(tensors: dict[str, torch.Tensor], group_size: int = 128) -> torch.Tensor:
    """(out, in) float32 weight of AWQ GEMM tensors: (q - z) * s, input i in group i // G."""
    q = unpack_int4_cols(tensors["qweight"], AWQ_ORDER)  # (in, out)
    zeros = unpack_int4_cols(tensors["qzeros"], AWQ_ORDER)  # (n_groups, out)
    scales = tensors["scales"].to(torch.float32)
    in_features = q.shape[0]
    group_of = torch.arange(in_features) // _group_size(group_size, in_features)
    return ((q - zeros[group_of]).to(torch.float32) * scales[group_of]).t().contiguous()


# ---------------------------------------------------------------------------------------------
# Checkpoints


def gptq_quantization_config(
    group_size: int, desc_act: bool, sym: bool, **extra: Any
) -> dict[str, Any]:
    """`quantization_config` as AutoGPTQ (0.7) writes it into config.json and
    quantize_config.json; `extra` adds or overrides keys."""
    config: dict[str, Any] = {
        "bits": BITS,
        "group_size": group_size,
        "damp_percent": 0.01,
        "desc_act": desc_act,
        "static_groups": False,
        "sym": sym,
        "true_sequential": True,
        "model_name_or_path": None,
        "model_file_base_name": "model",
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
    }
    config.update(extra)
    return config


def awq_quantization_config(group_size: int, **extra: Any) -> dict[str, Any]:
    """`quantization_config` as AutoAWQ writes it into config.json (to_transformers_dict)."""
    config: dict[str, Any] = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": BITS,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    config.update(extra)
    return config


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> Any:
    from pagoda.loading.model_files import resolve_model
    from pagoda.loading.tokenizer import load_tokenizer

    return load_tokenizer(*resolve_model(None))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random parameters far from HF's init (as tests/conftest.py does): norms 1 + 0.1 N(0, 1),
    everything else 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def build_tiny_model(config: Any = None, seed: int = 0) -> torch.nn.Module:
    """A float32 random-weight causal LM from a config dict (kwargs of AutoConfig.for_model,
    `model_type` defaulting to llama; None for TINY_LLAMA) or a transformers config."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if config is None:
        config = TINY_LLAMA
    if not isinstance(config, PretrainedConfig):
        kwargs = dict(config)
        config = AutoConfig.for_model(kwargs.pop("model_type", "llama"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def _is_quantized(name: str, tensor: torch.Tensor, modules: tuple[str, ...]) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and tensor.dim() == 2 and module.rsplit(".", 1)[-1] in modules


def write_quantized_checkpoint(
    folder: str | os.PathLike[str],
    config_or_model: Any = None,
    method: str = "gptq",
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    float_dtype: torch.dtype = torch.float16,
    modules: tuple[str, ...] = QUANTIZED_MODULES,
    quant_config_extra: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a 4-bit GPTQ ("gptq") or AWQ ("awq") checkpoint into `folder` and return the float32
    reference state dict (HF names, `.weight`): the exact dequantized weights of the quantized
    linears and the stored (float_dtype-rounded) values of everything else, loadable with
    `model.load_state_dict(reference)` into a float model of the same config.

    config_or_model: None (TINY_LLAMA), a config dict (AutoConfig.for_model kwargs with an
    optional `model_type`), a transformers config, or a model whose weights are used as they
    are. desc_act and sym apply to GPTQ only (AWQ is asymmetric without act-order).
    tokenizer: saved into the folder; None for SmolLM2's (the fixtures' tokenizer).
    quant_config_extra: keys added to / overriding `quantization_config`.
    """
    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    if isinstance(config_or_model, torch.nn.Module):
        model = config_or_model
    else:
        model = build_tiny_model(config_or_model, seed=seed)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)

    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    quantized_modules: set[str] = set()
    for index, (name, tensor) in enumerate(state.items()):
        tensor = tensor.detach().cpu()
        if _is_quantized(name, tensor, modules):
            prefix = name.removesuffix(".weight")
            quantized_modules.add(prefix)
            if method == "gptq":
                packed = gptq_quantize(tensor, group_size, desc_act, sym, seed=seed + index)
                reference[name] = gptq_dequantize(packed, group_size)
            else:
                packed = awq_quantize(tensor, group_size, seed=seed + index)
                reference[name] = awq_dequantize(packed, group_size)
            for leaf, value in packed.items():
                tensors[f"{prefix}.{leaf}"] = value.contiguous()
            continue
        # Both tools save the rest of the model in float16 (biases of quantized linears too).
        module = name.rpartition(".")[0]
        dtype = torch.float16 if module in quantized_modules else float_dtype
        stored = tensor.to(dtype).contiguous()
        reference[name] = stored.to(torch.float32)
        if tied and name == "lm_head.weight":
            continue  # save_pretrained leaves a tied head out
        tensors[name] = stored
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})

    if method == "gptq":
        quant_config = gptq_quantization_config(
            group_size, desc_act, sym, **(quant_config_extra or {})
        )
        with open(os.path.join(folder, "quantize_config.json"), "w") as f:
            json.dump(quant_config, f, indent=2)
    else:
        quant_config = awq_quantization_config(group_size, **(quant_config_extra or {}))
    hf_config = json.loads(model.config.to_json_string(use_diff=False))
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = str(float_dtype).removeprefix("torch.")
    hf_config["quantization_config"] = quant_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)

    (tokenizer if tokenizer is not None else _smollm2_tokenizer()).save_pretrained(folder)
    return reference
