"""/v1/score and /v1/rerank (and vLLM's other paths for them) on `pagoda serve` with a tiny
random Qwen3ForSequenceClassification, which runner "auto" serves as a pooling model: scores
equal HF's (sigmoid of the `score` logit of the tokenizer's text pair) within 1e-4, the shapes,
rerank's ordering, top_n and return_documents, and each bad input a 400 in OpenAI's shape
naming the field with nothing queued."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.pooling_reference import hf_scores, save_classifier
from tests.server.conftest import SMALL_POOL, ServerProcess

QUERY = "What does paged attention keep in blocks?"
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks, like virtual memory pages.",
    "A",
]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    return save_classifier(tmp_path_factory.mktemp("cls") / "m", "qwen3", smollm2_tokenizer)


@pytest.fixture(scope="module")
def want(classifier_dir: str, smollm2_tokenizer: Any) -> list[float]:
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32)
    return hf_scores(hf.eval(), smollm2_tokenizer, [(QUERY, d) for d in DOCUMENTS])


@pytest.fixture(scope="module")
def score_server(classifier_dir: str) -> Iterator[ServerProcess]:
    # no --runner: "auto" pools for a sequence-classification checkpoint
    server = ServerProcess(classifier_dir, (*SMALL_POOL, "--max-num-batched-tokens", "8"))
    server.wait_ready()
    yield server
    server.stop()


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert all(abs(g - w) <= 1e-4 for g, w in zip(got, want)), (got, want)


def test_score_pairs_one_to_n_and_n_to_n(
    score_server: ServerProcess, want: list[float], smollm2_tokenizer: Any
) -> None:
    before = score_server.metric('pagoda:request_success_total{finished_reason="stop"')
    r = score_server.post("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(3)]
    _close([d["score"] for d in body["data"]], want)
    num_tokens = sum(len(smollm2_tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    after = score_server.metric('pagoda:request_success_total{finished_reason="stop"')
    assert after - before == len(DOCUMENTS)

    n_to_n = score_server.post("/score", {"text_1": [QUERY] * 2, "text_2": DOCUMENTS[1:]})
    _close([d["score"] for d in n_to_n.json()["data"]], want[1:])
    one = score_server.post("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[2]})
    _close([d["score"] for d in one.json()["data"]], want[2:])


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_by_score_and_cuts_to_top_n(
    score_server: ServerProcess, want: list[float], path: str
) -> None:
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    r = score_server.post(path, {"query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and set(body) == {"id", "model", "usage", "results"}
    assert [x["index"] for x in body["results"]] == order
    assert [x["document"] for x in body["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    _close([x["relevance_score"] for x in body["results"]], [want[i] for i in order])
    assert body["usage"]["total_tokens"] > 0

    top = score_server.post(
        path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    ).json()["results"]
    assert [x["index"] for x in top] == order[:2]
    assert all("document" not in x for x in top)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/score", {"text_1": "a"}, "text_2", ""),
        ("/v1/score", {"text_1": [], "text_2": "b"}, "text_1", "text_1 must not be empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_1", "1:1, 1:N or N:N"),
        ("/v1/score", {"text_1": "a", "text_2": [1]}, "text_2", ""),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", ">= 0"),
        ("/v1/rerank", {"documents": ["d"]}, "query", ""),
        ("/v1/rerank", {"query": "q", "documents": ["d" * 5000]}, "documents", ""),
        ("/v1/embeddings", {"input": "x"}, None, "not embeddings"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    score_server: ServerProcess, path: str, body: dict[str, Any], param: str | None, words: str
) -> None:
    before = score_server.metric("pagoda:request_success_total")
    r = score_server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"] or "").split(".")[0] == (param or "") and words in error["message"]
    assert score_server.metric("pagoda:request_success_total") == before  # nothing ran


def test_a_generating_server_refuses_scores(tiny_server: ServerProcess) -> None:
    for path, body in [
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ]:
        r = tiny_server.post(path, body)
        assert r.status_code == 400, r.text
        assert "--runner pooling" in r.json()["error"]["message"]
