"""The client's side of `--runner pooling`: which calls a runner takes, a pooling request's
checks, and the vector the engine pooled (runner/pooler.py) cut to `dimensions` and
normalized as the request asks."""

from __future__ import annotations

import numpy as np

from pagoda.pooler_config import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineInfo

# What a pooling request asks of the engine: its prompt computed once, no token kept.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def check_runner(info: EngineInfo, pooling: bool) -> None:
    """ValueError unless the engine runs what the call needs: pooling or generating."""
    if pooling and info.pooling_type is None:
        raise ValueError(
            "this model generates text; embeddings need a server or LLM started with "
            "--runner pooling (LLM(..., runner='pooling'))"
        )
    if not pooling and info.pooling_type is not None:
        raise ValueError(
            "this model runs with --runner pooling: it serves embeddings (/v1/embeddings, "
            "LLM.embed) or, a classifier, scores (/v1/score, /v1/rerank, LLM.score), not "
            "generation"
        )


def check_embedder(info: EngineInfo) -> None:
    """ValueError for a classifier: its pooled values are label logits, not an embedding."""
    if info.num_labels:
        raise ValueError(
            "this model is a classifier: it serves scores (/v1/score, /v1/rerank, LLM.score, "
            "LLM.classify), not embeddings"
        )


def check_pooling_params(info: EngineInfo, params: PoolingParams) -> None:
    """ValueError for a `dimensions` the model cannot give (vLLM's rule and words)."""
    dims, allowed = params.dimensions, info.matryoshka_dimensions
    if dims is None:
        return
    if allowed is None:
        raise ValueError(
            "Model does not support matryoshka representation, changing output dimensions "
            "will lead to poor results."
        )
    if allowed and dims not in allowed:
        raise ValueError(f"dimensions must be one of {allowed}, got {dims}")
    if dims > info.hidden_size:
        raise ValueError(f"dimensions must be at most {info.hidden_size}, got {dims}")


def embedding(pooled: bytes, params: PoolingParams, info: EngineInfo) -> list[float]:
    """The engine's vector: its first `dimensions` values, then scaled to unit length when
    the request (else the pooler) normalizes."""
    vector = np.frombuffer(pooled, dtype=np.float32)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = info.normalize if params.normalize is None else params.normalize
    if normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        vector = vector / np.float32(max(norm, 1e-12))  # F.normalize's eps
    return [float(x) for x in vector]
