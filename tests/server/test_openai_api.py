"""The OpenAI API of `pagoda serve`, driven by the official `openai` client and raw httpx.

Most tests run on the tiny random Llama (fast, gibberish text); the greedy-equality tests run
on the embedded SmolLM2 and compare streamed, non-streamed and offline `LLM` outputs.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pagoda import LLM, SamplingParams, __version__
from tests.server.conftest import ServerProcess

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
CHATS: list[list[ChatCompletionMessageParam]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
    ],
]


def model_id(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def tiny(tiny_server: ServerProcess) -> tuple[ServerProcess, str]:
    return tiny_server, model_id(tiny_server)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    events = [e for e in response.text.split("\n\n") if e.strip()]
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
    assert events and events[-1] == "data: [DONE]"
    return [e.removeprefix("data: ") for e in events]


def stream_json(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(timeout=60) as http:
        response = http.post(server.url + path, json={**body, "stream": True})
        assert response.status_code == 200, response.text
        events = sse_events(response)
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def greedy_text(server: ServerProcess, model: str, prompt: Any, max_tokens: int) -> str:
    out = server.client().completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text


# ---- completions ------------------------------------------------------------------------------
def test_completion_non_streamed(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().completions.create(
        model=model,
        prompt="Hello there",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == model
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    n_prompt = server.post("/tokenize", {"model": model, "prompt": "Hello there"}).json()["count"]
    usage = out.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 5)
    assert usage.total_tokens == n_prompt + 5
    assert usage.prompt_tokens_details is not None
    assert isinstance(usage.prompt_tokens_details.cached_tokens, int)


def test_completion_streamed_matches_non_streamed(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    expected = server.client().completions.create(
        model=model, prompt="A streamed prompt", max_tokens=12, temperature=0
    )
    chunks = list(
        server.client().completions.create(
            model=model,
            prompt="A streamed prompt",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    *content, last = chunks
    assert last.choices == [] and last.usage == expected.usage
    assert all(c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == expected.choices[0].text
    reasons = [c.choices[0].finish_reason for c in content]
    assert reasons[-1] == expected.choices[0].finish_reason and set(reasons[:-1]) <= {None}


def test_stream_without_include_usage_has_no_usage(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    chunks = list(
        server.client().completions.create(model=model, prompt="hi", max_tokens=4, stream=True)
    )
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_completion_n_greater_than_one(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().completions.create(
        model=model, prompt="Sample me", n=3, max_tokens=4, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 12

    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, list[str]] = defaultdict(list)
    for chunk in server.client().completions.create(
        model=model, prompt="Sample me", n=3, max_tokens=4, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index].append(c.finish_reason)
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    assert finished == {0: ["length"], 1: ["length"], 2: ["length"]}


def test_chat_n_greater_than_one(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().chat.completions.create(
        model=model, messages=CHATS[0], n=2, max_tokens=3, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 6

    roles: dict[int, list[str | None]] = defaultdict(list)
    finished: dict[int, list[str]] = defaultdict(list)
    for chunk in server.client().chat.completions.create(
        model=model, messages=CHATS[0], n=2, max_tokens=3, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for c in chunk.choices:
            roles[c.index].append(c.delta.role)
            if c.finish_reason is not None:
                finished[c.index].append(c.finish_reason)
    assert {i: r[0] for i, r in roles.items()} == {0: "assistant", 1: "assistant"}
    assert finished == {0: ["length"], 1: ["length"]}


def test_stop_string_cuts_the_text(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    prompt = "Stop strings are checked on text"
    full = greedy_text(server, model, prompt, 16)
    k = len(full) // 2
    stop = full[k : k + 3]
    cut = full.index(stop)
    client = server.client()

    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, stop=[stop], temperature=0
    )
    assert out.choices[0].text == full[:cut]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra is not None
    assert out.choices[0].model_extra["stop_reason"] == stop

    kept = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, stop=stop, temperature=0,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == full[: cut + len(stop)]

    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=16, stop=[stop], stream=True, temperature=0
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_full = server.client().chat.completions.create(
        model=model, messages=CHATS[0], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].message.content  # fmt: skip
    assert chat_full
    chat_stop = chat_full[len(chat_full) // 2 :][:3]
    chat = client.chat.completions.create(
        model=model, messages=CHATS[0], max_tokens=16, stop=chat_stop, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == chat_full[: chat_full.index(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_completion_logprobs(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().completions.create(
        model=model, prompt="Logprobs please", max_tokens=6, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert out.usage is not None
    n = out.usage.completion_tokens
    assert n == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    offset = 0
    for token, logprob, top, text_offset in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    ):
        assert logprob is not None and logprob <= 0.0
        assert text_offset == offset
        offset += len(token)
        assert 1 <= len(top) <= 2 and all(v <= 0.0 for v in top.values())
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert top.get(token) == pytest.approx(logprob, abs=1e-4)
    assert "".join(lp.tokens) == choice.text

    # Streamed, every chunk carries the logprobs of its own tokens.
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in server.client().completions.create(
        model=model, prompt="Logprobs please", max_tokens=6, logprobs=2, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        clp = chunk.choices[0].logprobs
        assert clp is not None and clp.tokens is not None and clp.text_offset is not None
        tokens += clp.tokens
        offsets += clp.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().chat.completions.create(
        model=model, messages=CHATS[1], max_tokens=5, logprobs=True, top_logprobs=2,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert out.usage is not None and len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in content) == choice.message.content

    # Without top_logprobs: the sampled token's logprob only.
    plain = server.client().chat.completions.create(
        model=model, messages=CHATS[1], max_tokens=3, logprobs=True, temperature=0
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    no_lp = server.client().chat.completions.create(
        model=model, messages=CHATS[1], max_tokens=3, temperature=0
    )
    assert no_lp.choices[0].logprobs is None


def test_cached_tokens_of_a_repeated_prompt(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    rng = random.Random(1234)
    prompt = [rng.randrange(100, 40000) for _ in range(150)]
    client = server.client()
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 150
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < 150 and cached % 16 == 0, cached
    assert cached >= 144 - 16  # every full block but (perhaps) the last
    assert first.choices[0].text == second.choices[0].text

    # Streamed with include_usage reports the hit too; a cache_salt isolates the cache.
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached
    salted = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0,
        extra_body={"cache_salt": "some-tenant"},
    )  # fmt: skip
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_seed_reproducible_at_temperature_one(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()

    def sample(seed: int) -> str:
        out = client.completions.create(
            model=model, prompt="Roll the dice", max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)

    def chat(seed: int) -> str | None:
        out = client.chat.completions.create(
            model=model, messages=CHATS[0], max_tokens=8, temperature=1.0, seed=seed
        )
        return out.choices[0].message.content

    assert chat(99) == chat(99)


def test_vllm_extra_fields_accepted(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    extra = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 3,
        "ignore_eos": True,
        "priority": 0,
        "cache_salt": "salt",
    }
    out = server.client().completions.create(
        model=model, prompt="Extras", max_tokens=6, temperature=0.8, extra_body=extra
    )
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.choices[0].finish_reason == "length"
    chat = server.client().chat.completions.create(
        model=model, messages=CHATS[0], max_tokens=6, temperature=0.8, extra_body=extra
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    # Unknown fields are ignored, as vLLM does.
    raw = server.post(
        "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1, "no_such_field": 1}
    )
    assert raw.status_code == 200, raw.text


def test_chat_max_completion_tokens(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    out = server.client().chat.completions.create(
        model=model, messages=CHATS[0], max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"
    # It wins over the deprecated max_tokens.
    body = {
        "model": model,
        "messages": CHATS[0],
        "max_tokens": 9,
        "max_completion_tokens": 2,
        "ignore_eos": True,
    }
    raw = server.post("/v1/chat/completions", body)
    assert raw.status_code == 200 and raw.json()["usage"]["completion_tokens"] == 2


def test_chat_streamed_matches_non_streamed(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    # the prompt once before, so that both requests below find the same blocks in the prefix
    # cache (usage.prompt_tokens_details.cached_tokens), whichever tests ran before this one
    client.chat.completions.create(model=model, messages=CHATS[1], max_tokens=1)
    expected = client.chat.completions.create(
        model=model, messages=CHATS[1], max_tokens=10, temperature=0
    )
    assert expected.object == "chat.completion" and expected.id.startswith("chatcmpl-")
    assert expected.choices[0].message.role == "assistant"
    n_prompt = server.post("/tokenize", {"model": model, "messages": CHATS[1]}).json()["count"]
    assert expected.usage is not None and expected.usage.prompt_tokens == n_prompt
    chunks = list(
        client.chat.completions.create(
            model=model, messages=CHATS[1], max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert last.choices == [] and last.usage == expected.usage
    details = expected.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens  # the warm-up's full blocks
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == expected.choices[0].message.content
    assert content[-1].choices[0].finish_reason == expected.choices[0].finish_reason


def test_prompt_as_token_ids(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    text = "Token ids are a prompt too"
    ids = server.post("/tokenize", {"model": model, "prompt": text}).json()["tokens"]
    out = server.client().completions.create(
        model=model, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].text == greedy_text(server, model, text, 6)


def test_logit_bias_forces_and_bans_tokens(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    client = server.client()
    forced = client.completions.create(
        model=model, prompt="hello", max_tokens=4, temperature=0, logit_bias={"1234": 100}
    )
    assert (
        forced.choices[0].text
        == server.post("/detokenize", {"tokens": [1234] * 4}).json()["prompt"]
    )
    plain = client.completions.create(model=model, prompt="hello", max_tokens=1, temperature=0)
    first = server.post("/tokenize", {"prompt": plain.choices[0].text, "add_special_tokens": False})
    banned = first.json()["tokens"][0]
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=1, temperature=0, logit_bias={str(banned): -100}
    )
    assert out.choices[0].text != plain.choices[0].text


def test_allowed_token_ids_are_the_only_tokens_sampled(tiny: tuple[ServerProcess, str]) -> None:
    """vLLM's allowed_token_ids (an extra field): greedy and random samples stay in the set."""
    server, model = tiny
    allowed = [1234, 77, 4096]
    texts = {server.post("/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
    assert len(texts) == 3
    for temperature in (0.0, 1.0):
        out = server.post(
            "/v1/completions",
            {"model": model, "prompt": "hello", "max_tokens": 6, "temperature": temperature,
             "seed": 3, "allowed_token_ids": allowed, "logprobs": 0, "ignore_eos": True},
        ).json()  # fmt: skip
        tokens = out["choices"][0]["logprobs"]["tokens"]  # each sampled token's text
        assert len(tokens) == 6 and set(tokens) <= texts, tokens


def test_list_of_prompts(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    expected = [greedy_text(server, model, p, 5) for p in PROMPTS]
    out = server.client().completions.create(
        model=model, prompt=PROMPTS, n=2, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == list(range(6))
    by_index = {c.index: c.text for c in out.choices}
    for p, text in enumerate(expected):
        assert by_index[2 * p] == by_index[2 * p + 1] == text
    assert out.usage is not None and out.usage.completion_tokens == 30

    streamed: dict[int, str] = defaultdict(str)
    for chunk in server.client().completions.create(
        model=model, prompt=PROMPTS, n=2, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert dict(streamed) == by_index

    ids = [
        server.post("/tokenize", {"model": model, "prompt": p}).json()["tokens"] for p in PROMPTS
    ]
    from_ids = server.client().completions.create(
        model=model, prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(from_ids.choices, key=lambda c: c.index)] == expected


def test_models_version_tokenize_detokenize(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model]
    raw = server.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert raw["data"][0]["max_model_len"] == 1024
    assert server.get("/version").json() == {"version": __version__}

    text = "Hello, world! Round trip."
    tok = server.post("/tokenize", {"model": model, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert all(isinstance(t, int) for t in tok["tokens"])
    back = server.post("/detokenize", {"model": model, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    # model is optional on both.
    assert server.post("/tokenize", {"prompt": text}).json()["tokens"] == tok["tokens"]

    chat = server.post("/tokenize", {"model": model, "messages": CHATS[1]}).json()
    assert chat["count"] == len(chat["tokens"]) > tok["count"]
    rendered = server.post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert "You are a terse assistant." in rendered and "Name a color." in rendered
    bare = server.post("/tokenize", {"messages": CHATS[1], "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]


def test_sse_framing(tiny: tuple[ServerProcess, str]) -> None:
    server, model = tiny
    events = stream_json(
        server, "/v1/completions",
        {"model": model, "prompt": "frame", "max_tokens": 6, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1
    chat = stream_json(
        server, "/v1/chat/completions",
        {"model": model, "messages": CHATS[0], "max_tokens": 6},
    )  # fmt: skip
    assert all(e["object"] == "chat.completion.chunk" for e in chat)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-1]["choices"][0]["finish_reason"] in {"stop", "length"}


# ---- greedy equality on SmolLM2: streamed == non-streamed == offline LLM ----------------------
@pytest.fixture(scope="module")
def smollm2_offline() -> Iterator[LLM]:
    yield LLM(None, num_gpu_blocks_override=512)


SMOL_GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_greedy_completions_equal_offline(
    smollm2_server: ServerProcess, smollm2_offline: LLM
) -> None:
    server, model = smollm2_server, model_id(smollm2_server)
    client = server.client()
    for prompt in PROMPTS[:2]:
        offline = smollm2_offline.generate(prompt, SMOL_GREEDY, use_tqdm=False)[0].outputs[0]
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
        )
        assert plain.choices[0].text == streamed == offline.text, prompt
        assert plain.choices[0].finish_reason == offline.finish_reason
        assert plain.usage is not None and plain.usage.completion_tokens == len(offline.token_ids)


def test_greedy_chat_equals_offline(smollm2_server: ServerProcess, smollm2_offline: LLM) -> None:
    server, model = smollm2_server, model_id(smollm2_server)
    client = server.client()
    for messages in CHATS:
        conversation = [dict(m) for m in messages]
        offline = smollm2_offline.chat(conversation, SMOL_GREEDY, use_tqdm=False)[0].outputs[0]
        plain = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0
        )
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=24, temperature=0, stream=True
            )
            if c.choices
        )
        assert plain.choices[0].message.content == streamed == offline.text, messages
        assert plain.choices[0].finish_reason == offline.finish_reason
