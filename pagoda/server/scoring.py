"""/v1/score (and /score) and /v1/rerank (and /rerank, /v2/rerank, as vLLM serves them): one
score per (text_1, text_2) or (query, document) pair, from a one-label classifier run with
`--runner pooling` (client/scoring.py builds each pair's prompt and its score). The pairs batch
in the engine like any other prompts; a rerank's results are sorted by score, best first."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, params
from fastapi.responses import JSONResponse, Response

from pagoda.client.scoring import check_classifier, label_probs, pair_prompt, score_pairs
from pagoda.client.tokenizer import Prompt
from pagoda.server.errors import APIError
from pagoda.server.generation import (
    RequestFields,
    add_pooling,
    collect_pooled,
    until_disconnect,
)
from pagoda.server.scoring_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from pagoda.server.state import ServerState


def add_scoring_routes(app: FastAPI, state: ServerState, deps: list[params.Depends]) -> None:
    for path in ("/v1/score", "/score"):

        @app.post(path, dependencies=deps)
        async def score(body: ScoreRequest, request: Request) -> Response:
            return await create_score(state, body, request)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):

        @app.post(path, dependencies=deps)
        async def rerank(body: RerankRequest, request: Request) -> Response:
            return await create_rerank(state, body, request)


async def create_score(state: ServerState, body: ScoreRequest, request: Request) -> Response:
    _check(state, "/v1/score", body.model)
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from e
    rid = body.request_id or f"score-{uuid.uuid4().hex}"
    prompts = [pair_prompt(state.engine.tokenizer, a, b) for a, b in pairs]
    scores_of = await _scores(state, rid, prompts, body, "text_2")

    async def work() -> Response:
        scores = await scores_of()
        num_tokens = sum(len(ids) for _, ids in prompts)
        response = ScoreResponse(
            id=rid,
            model=state.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    return await until_disconnect(request, work)


async def create_rerank(state: ServerState, body: RerankRequest, request: Request) -> Response:
    _check(state, "/v1/rerank", body.model)
    if not body.documents:
        raise APIError(400, "documents must not be empty", "documents")
    if body.top_n is not None and body.top_n < 0:
        raise APIError(400, f"top_n must be >= 0, got {body.top_n}", "top_n")
    rid = body.request_id or f"rerank-{uuid.uuid4().hex}"
    tokenizer = state.engine.tokenizer
    prompts = [pair_prompt(tokenizer, body.query, d) for d in body.documents]
    scores_of = await _scores(state, rid, prompts, body, "documents")

    async def work() -> Response:
        scores = await scores_of()
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
            )
            for i in order[: body.top_n or None]
        ]
        usage = RerankUsage(total_tokens=sum(len(ids) for _, ids in prompts))
        response = RerankResponse(id=rid, model=state.model_name, usage=usage, results=results)
        return JSONResponse(response.model_dump(exclude_none=True))

    return await until_disconnect(request, work)


def _check(state: ServerState, what: str, model: str | None) -> None:
    state.check_model(model)
    info = state.engine.info
    assert info is not None  # the routes answer 503 until the engine is ready
    try:
        check_classifier(info, what, one_label=True)
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def _scores(
    state: ServerState, rid: str, prompts: list[Prompt], body: RequestFields, field: str
) -> Callable[[], Awaitable[list[float]]]:
    """Send the pairs' prompts (a refusal is a 400 naming `field`); returns what awaits their
    scores."""
    streams = await add_pooling(state, rid, prompts, body, field)

    async def scores() -> list[float]:
        return [label_probs(p)[0] for p in await collect_pooled(state.engine, streams)]

    return scores
