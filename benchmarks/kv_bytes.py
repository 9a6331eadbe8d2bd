"""KV-cache bytes per token, the engine's own sizing (ModelConfig.kv_bytes_per_token), for each
family's published shape: the GQA families cache K and V per kv head; DeepSeek-V3's latent
attention caches one row of kv_lora_rank + qk_rope_head_dim values per token and layer
(layers/latent_attention.py). The configs are built here from their published sizes (no
download); "as MHA" is the same DeepSeek-V3 with each head's key and value cached.

    python benchmarks/kv_bytes.py --out benchmarks/results/issue40/kv_bytes.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from pagoda.model_config import ModelConfig, kv_cache_dims_of

DTYPE = "bfloat16"


def shapes() -> dict[str, Any]:
    return {
        "Qwen2.5-Coder-1.5B": Qwen2Config(
            hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
        ),
        "Gemma-3-270M": Gemma3TextConfig(
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
        ),
        "Llama-3.1-8B": LlamaConfig(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
        ),
        "Mixtral-8x7B": MixtralConfig(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
        ),
        "Qwen3-30B-A3B": Qwen3MoeConfig(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
        "DeepSeek-V3": DeepseekV3Config(),  # transformers' defaults are V3's shape
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    rows = []
    for name, hf_config in shapes().items():
        config = ModelConfig(hf_config, name, DTYPE, 4096)
        heads, k_dim, v_dim = kv_cache_dims_of(hf_config)
        rows.append(
            {
                "model": name,
                "layers": config.num_layers,
                "kv_heads": heads,
                "k_values": k_dim,
                "v_values": v_dim,
                "bytes_per_token": config.kv_bytes_per_token(),
                "bytes_per_token_int8": config.kv_bytes_per_token("int8"),
            }
        )
    v3 = shapes()["DeepSeek-V3"]
    mha = v3.num_hidden_layers * v3.num_attention_heads * (v3.qk_head_dim + v3.v_head_dim) * 2
    rows.append({"model": "DeepSeek-V3 as MHA (not run: the comparison)", "bytes_per_token": mha})
    for row in rows:
        print(f"{row['model']:48} {row['bytes_per_token']:>10,} B/token ({DTYPE})")
    result = {
        "what": "KV-cache bytes per token over all layers, one rank, the engine's sizing",
        "dtype": DTYPE,
        "how": "python benchmarks/kv_bytes.py (ModelConfig.kv_bytes_per_token on each "
        "family's published shape, built locally)",
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
