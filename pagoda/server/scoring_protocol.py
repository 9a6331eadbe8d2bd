"""/v1/score and /v1/rerank schemas: vLLM's score request and response, and the Jina / Cohere
rerank shape vLLM and llama.cpp's server use (pydantic, at the HTTP edge only)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagoda.server.protocol import OpenAIModel


class _PoolingFields(OpenAIModel):
    """vLLM's extra fields of a pooling request, and what generation.add_all reads."""

    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return None

    @property
    def grammar_field(self) -> str:
        return "text_1"


class ScoreRequest(_PoolingFields):
    model: str | None = None
    # one text_1 against each text_2 (1:1, 1:N), or element-wise (N:N)
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(_PoolingFields):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # the best N results; None or 0: all of them
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
