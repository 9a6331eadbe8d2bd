"""/v1/embeddings schemas: OpenAI's request and response, plus vLLM's extra fields (pydantic,
at the HTTP edge only)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagoda.server.protocol import OpenAIModel


class EmbeddingRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only
    user: str | None = None
    # vLLM's extra fields
    normalize: bool | None = None  # None: the pooler's (--pooler-config, the checkpoint's)
    truncate_prompt_tokens: int | None = None  # keep each input's last N tokens
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # refused: pooling has no transfer

    @property
    def grammar_field(self) -> str:
        return "input"


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
