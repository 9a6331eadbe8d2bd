"""What the engine knows of a loaded checkpoint (ModelConfig), and the dtype sizes it counts
bytes with. Plain data: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.pooler_config import Classifier, PoolerConfig

# Weight schemes (--quantization; layers/quant.py).
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8", "gguf", "awq", "gptq")

# dtypes are named as torch names them (getattr(torch, name) is the dtype); bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
# The KV cache dtypes stored with a scale per (token, kv head) (config.KV_STORAGE_DTYPES), and
# the scale's dtype.
SCALED_KV_DTYPES = ("int8", "float8_e4m3fn")
KV_SCALE_DTYPE = "float32"


def head_dim_of(hf_config: Any) -> int:
    """Attention head size: explicit `head_dim` (Qwen3) or hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def kv_cache_dims_of(hf_config: Any) -> tuple[int, int, int]:
    """(kv heads, key values, value values) per token of one layer's cache. Multi-head latent
    attention (DeepSeek-V2/V3: `kv_lora_rank` set) caches one shared row per token, the
    compressed latent and the rotary key part (512 + 64 = 576 values for V3), and no separate
    values (they are the latent's first kv_lora_rank values): (1, rank + rope, 0)."""
    rank = int(getattr(hf_config, "kv_lora_rank", 0) or 0)
    if rank:
        return 1, rank + int(hf_config.qk_rope_head_dim), 0
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = head_dim_of(hf_config)
    return int(heads), head_dim, head_dim


def sliding_window_of(hf_config: Any, index: int) -> int | None:
    """The attention window of layer `index` (HF's rule): `sliding_window` where `layer_types`
    marks the layer "sliding_attention", or on every layer when the config has a window and no
    layer types (Mistral); None: the full causal context."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if not window:
        return None
    if layer_types is None or layer_types[index] == "sliding_attention":
        return int(window)
    return None


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know of a checkpoint, derived once from its HF config."""

    hf_config: Any
    architecture: str
    dtype: str  # the activations' and KV cache's dtype, e.g. "float32"
    max_model_len: int
    quantization: str = "none"  # the weight scheme in effect (see layers/quant.py)
    weight_bytes: int = 0  # bytes of every parameter and buffer of the loaded model (one rank's)
    tensor_parallel_size: int = 1  # ranks sharing each layer (layers/parallel.py)
    # KV heads in this rank's cache (TensorParallel.heads; the engine holds the config of the
    # rank whose cache per token is the largest); 0: all of them
    rank_kv_heads: int = 0
    pipeline_parallel_size: int = 1  # stages the layers are split into (PipelineStage)
    rank_layers: int = 0  # layers in this rank's stage (PipelineStage.layers); 0: all of them
    # ranks sharing each request's KV along the sequence (layers/context_parallel.py)
    prefill_context_parallel_size: int = 1
    # --runner pooling: the pooling in effect (--pooler-config over the checkpoint's own,
    # loading/pooling.py), fields all set; None: the model generates
    pooler: PoolerConfig | None = None
    # a pooling model's classification head (loading/classifier.py); None: an embedding model
    classifier: Classifier | None = None

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_layers_per_rank(self) -> int:
        """Layers (and KV caches) this rank holds: all of them without pipeline parallelism."""
        return self.rank_layers or self.num_layers

    @property
    def sliding_window_layers(self) -> int:
        """Layers attending a sliding window (all the others see the whole context)."""
        return sum(sliding_window_of(self.hf_config, i) is not None for i in range(self.num_layers))

    @property
    def num_kv_heads(self) -> int:
        return kv_cache_dims_of(self.hf_config)[0]

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads in this rank's cache: all of them at tensor_parallel_size 1."""
        return self.rank_kv_heads or self.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Values per kv head of the cache's keys (MLA: the latent row, kv_cache_dims_of)."""
        return kv_cache_dims_of(self.hf_config)[1]

    @property
    def v_head_dim(self) -> int:
        """Values per kv head of the cache's values (MLA: 0, the keys hold them)."""
        return kv_cache_dims_of(self.hf_config)[2]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """K and V bytes of one token over all layers in one rank's cache: head_dim (keys) and
        v_head_dim (values) values per kv head in `kv_dtype` (CacheConfig.kv_dtype; None: the
        model dtype), plus one KV_SCALE_DTYPE scale each for a SCALED_KV_DTYPES one; a
        context-parallel rank holds 1/N of the tokens."""
        values = self.head_dim + self.v_head_dim
        per_head = values * DTYPE_BYTES[kv_dtype or self.dtype]
        if kv_dtype in SCALED_KV_DTYPES:
            per_head += 2 * DTYPE_BYTES[KV_SCALE_DTYPE]
        per_token = self.num_layers_per_rank * self.num_kv_heads_per_rank * per_head
        return -(-per_token // self.prefill_context_parallel_size)
