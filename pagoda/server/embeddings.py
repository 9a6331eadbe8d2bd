"""/v1/embeddings: one vector per input (text or token ids) from a server started with
`--runner pooling`; the inputs batch in the engine like any other prompts."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.client.pooling import (
    check_embedder,
    check_pooling_params,
    check_runner,
    embedding,
)
from pagoda.client.tokenizer import Prompt
from pagoda.pooler_config import PoolingParams
from pagoda.server.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagoda.server.errors import APIError
from pagoda.server.generation import add_pooling, collect_pooled, until_disconnect
from pagoda.server.state import ServerState


async def create_embedding(
    state: ServerState, body: EmbeddingRequest, request: Request
) -> Response:
    state.check_model(body.model)
    info = state.engine.info
    assert info is not None  # the routes answer 503 until the engine is ready
    try:
        check_runner(info, pooling=True)
        check_embedder(info)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    params = _pooling_params(body)
    try:
        check_pooling_params(info, params)
    except ValueError as e:
        raise APIError(400, str(e), "dimensions") from e
    if body.kv_transfer_params is not None:
        raise APIError(400, "embeddings take no kv_transfer_params", "kv_transfer_params")
    prompts = _truncated(state.engine.completion_prompts(body.input, "input"), body)
    rid = body.request_id or f"embd-{uuid.uuid4().hex}"
    streams = await add_pooling(state, rid, prompts, body, "input")

    async def work() -> Response:
        data = []
        for i, pooled in enumerate(await collect_pooled(state.engine, streams)):
            vector = embedding(pooled, params, info)
            data.append(EmbeddingData(index=i, embedding=_encoded(vector, body.encoding_format)))
        num_tokens = sum(len(ids) for _, ids in prompts)
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        response = EmbeddingResponse(id=rid, model=state.model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump())

    return await until_disconnect(request, work)


def _pooling_params(body: EmbeddingRequest) -> PoolingParams:
    try:
        return PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    except ValueError as e:
        field = "dimensions" if str(e).startswith("dimensions") else "normalize"
        raise APIError(400, str(e), field) from e


def _truncated(prompts: list[Prompt], body: EmbeddingRequest) -> list[Prompt]:
    """vLLM's truncate_prompt_tokens: each input's last N tokens (its text dropped)."""
    n = body.truncate_prompt_tokens
    if n is None:
        return prompts
    if n < 1:
        raise APIError(
            400, f"truncate_prompt_tokens must be >= 1, got {n}", "truncate_prompt_tokens"
        )
    return [(text if len(ids) <= n else None, ids[-n:]) for text, ids in prompts]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
