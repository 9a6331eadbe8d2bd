"""/v1/embeddings on `pagoda serve --runner pooling`, through the official openai client: the
vectors equal HF's pooled hidden states, both encodings, token-id inputs, Matryoshka
`dimensions`, usage and metrics, and each bad input a 400 in OpenAI's shape with nothing queued."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from tests.pooling_reference import check_close, hf_vectors, with_files
from tests.server.browser import Page
from tests.server.conftest import SMALL_POOL, ServerProcess

INPUTS = ["Paged attention keeps the KV cache in blocks.", "A", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def embed_dir(
    tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The tiny Qwen3 as a Matryoshka embedding model (sizes 16, 32, 64), no
    sentence-transformers files: LAST pooling, normalized."""
    src = tiny_model_dir("qwen3")
    config = json.loads((Path(src) / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    return with_files(src, tmp_path_factory.mktemp("embed") / "m", {"config.json": config})


@pytest.fixture(scope="module")
def embed_server(embed_dir: str) -> Iterator[ServerProcess]:
    flags = (*SMALL_POOL, "--runner", "pooling", "--max-num-batched-tokens", "8")
    server = ServerProcess(embed_dir, flags).wait_ready()
    yield server
    server.stop()


def test_the_openai_client_gets_hf_s_vectors_in_both_encodings(
    embed_server: ServerProcess,
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    client = embed_server.client()
    before = embed_server.metric('pagoda:request_success_total{finished_reason="stop"')
    # The client asks for base64 unless told otherwise, and decodes it.
    got = client.embeddings.create(input=INPUTS, model=embed_server_model(embed_server))
    assert [d.index for d in got.data] == [0, 1, 2]
    want = hf_vectors(tiny_hf_model("qwen3"), smollm2_tokenizer, INPUTS, "LAST", True)
    check_close([d.embedding for d in got.data], want)
    num_tokens = sum(len(smollm2_tokenizer.encode(t)) for t in INPUTS)
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (num_tokens, num_tokens)
    after = embed_server.metric('pagoda:request_success_total{finished_reason="stop"')
    assert after - before == len(INPUTS)

    # One input alone is scheduled the same way each time, so its vector is the same bits
    # (several inputs batch and chunk as they arrive, which moves float32 rounding).
    floats = embed_server.post("/v1/embeddings", {"input": INPUTS[0], "encoding_format": "float"})
    raw = embed_server.post("/v1/embeddings", {"input": INPUTS[0], "encoding_format": "base64"})
    data = floats.json()["data"]
    assert floats.json()["object"] == "list" and data[0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == np.asarray(data[0]["embedding"], dtype=np.float32).tolist()


def embed_server_model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def test_token_ids_dimensions_and_normalize(
    embed_server: ServerProcess,
    tiny_hf_model: Callable[[str], torch.nn.Module],
    smollm2_tokenizer: Any,
) -> None:
    ids = smollm2_tokenizer.encode(INPUTS[0])
    hf = tiny_hf_model("qwen3")
    by_ids = embed_server.post("/v1/embeddings", {"input": ids, "encoding_format": "float"})
    check_close(
        [by_ids.json()["data"][0]["embedding"]],
        hf_vectors(hf, smollm2_tokenizer, INPUTS[:1], "LAST", True),
    )
    client = embed_server.client()
    cut = client.embeddings.create(
        input=INPUTS[0],
        dimensions=16,
        encoding_format="float",
        model=embed_server_model(embed_server),
    )
    raw = hf_vectors(hf, smollm2_tokenizer, INPUTS[:1], "LAST", False)[0]
    check_close([cut.data[0].embedding], [raw[:16] / np.linalg.norm(raw[:16])])
    plain = embed_server.post(
        "/v1/embeddings", {"input": INPUTS[0], "encoding_format": "float", "normalize": False}
    )
    check_close([plain.json()["data"][0]["embedding"]], [raw])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "dimensions": 8}, "dimensions", "dimensions must be one of [16, 32, 64]"),
        ({"input": "x", "dimensions": 0}, "dimensions", "dimensions must be an int >= 1"),
        ({"input": []}, "input", "input must not be empty"),
        ({"input": [""]}, "input", "input must not be empty"),
        ({"input": [[1], "a"]}, "input", "should be a valid"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": [10**9]}, "input", "prompt token ids must be integers"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
        ({}, "input", ""),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    embed_server: ServerProcess, body: dict[str, Any], param: str | None, words: str
) -> None:
    before = embed_server.metric("pagoda:request_success_total")
    r = embed_server.post("/v1/embeddings", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # pydantic names the union member a mixed list failed as (e.g. "input.str")
    assert (error["param"] or "").split(".")[0] == (param or "") and words in error["message"]
    assert embed_server.metric("pagoda:request_success_total") == before  # nothing ran


def test_each_runner_refuses_the_other_s_endpoints(
    embed_server: ServerProcess, tiny_server: ServerProcess
) -> None:
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        embed_server.client().completions.create(
            model=embed_server_model(embed_server), prompt="hi"
        )
    r = tiny_server.post("/v1/embeddings", {"input": "hi"})
    assert r.status_code == 400 and "embeddings need" in r.json()["error"]["message"]


def test_the_ui_playground_embeds(
    embed_server: ServerProcess, open_page: Callable[[str], Page]
) -> None:
    """/ui's playground in embedding mode shows the vector the API gives for the same input."""
    ui = open_page(embed_server.url)
    page = ui.page
    page.wait_for_selector("#feed-state.live", timeout=30_000)
    page.check("input[name=mode][value=embedding]")
    page.fill("#prompt", INPUTS[0])
    page.click("#send")
    page.wait_for_selector(".message.embedding .content")
    shown = json.loads(ui.data(".message.embedding .content", "embedding"))
    want = embed_server.post("/v1/embeddings", {"input": INPUTS[0], "encoding_format": "float"})
    assert shown == want.json()["data"][0]["embedding"]  # one input alone: the same bits
    assert page.text_content(".message.embedding .content").startswith("64 values, length 1.0000")
    assert ui.errors == []
