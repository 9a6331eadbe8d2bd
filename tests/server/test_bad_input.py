"""Bad requests get OpenAI's error shape with the right status (never 422 or 500), and the
server keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess

MODEL = "$MODEL"  # replaced by the served model name
VOCAB = 49152  # SmolLM2's tokenizer, used by the tiny model
MESSAGES = [{"role": "user", "content": "hi"}]
C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


# (method, path, JSON body or raw bytes, expected status)
CASES: dict[str, tuple[str, str, dict[str, Any] | bytes | None, int]] = {
    # -- /v1/completions: sampling fields out of range or of the wrong type
    "temperature_negative": ("POST", C, cmpl(temperature=-1), 400),
    "temperature_string": ("POST", C, cmpl(temperature="hot"), 400),
    "top_p_zero": ("POST", C, cmpl(top_p=0), 400),
    "top_p_above_one": ("POST", C, cmpl(top_p=1.5), 400),
    "n_zero": ("POST", C, cmpl(n=0), 400),
    "n_string": ("POST", C, cmpl(n="two"), 400),
    "max_tokens_zero": ("POST", C, cmpl(max_tokens=0), 400),
    "max_tokens_string": ("POST", C, cmpl(max_tokens="abc"), 400),
    "max_tokens_fraction": ("POST", C, cmpl(max_tokens=1.5), 400),
    "logprobs_21": ("POST", C, cmpl(logprobs=21), 400),
    "logprobs_negative": ("POST", C, cmpl(logprobs=-1), 400),
    "presence_penalty_3": ("POST", C, cmpl(presence_penalty=3), 400),
    "frequency_penalty_minus_3": ("POST", C, cmpl(frequency_penalty=-3), 400),
    "seed_string": ("POST", C, cmpl(seed="x"), 400),
    "seed_too_big": ("POST", C, cmpl(seed=2**70), 400),
    "stop_int": ("POST", C, cmpl(stop=5), 400),
    "stop_empty_string": ("POST", C, cmpl(stop=[""]), 400),
    "stop_token_ids_negative": ("POST", C, cmpl(stop_token_ids=[-1]), 400),
    "min_tokens_above_max_tokens": ("POST", C, cmpl(min_tokens=5, max_tokens=2), 400),
    "repetition_penalty_zero": ("POST", C, cmpl(repetition_penalty=0), 400),
    "top_k_minus_5": ("POST", C, cmpl(top_k=-5), 400),
    "min_p_2": ("POST", C, cmpl(min_p=2), 400),
    "ignore_eos_not_bool": ("POST", C, cmpl(ignore_eos="maybe"), 400),
    "priority_string": ("POST", C, cmpl(priority="high"), 400),
    "cache_salt_int": ("POST", C, cmpl(cache_salt=5), 400),
    "logit_bias_out_of_range": ("POST", C, cmpl(logit_bias={"1": 101.0}), 400),
    "logit_bias_key_not_a_token_id": ("POST", C, cmpl(logit_bias={"eos": -100.0}), 400),
    "logit_bias_key_out_of_vocab": ("POST", C, cmpl(logit_bias={str(VOCAB): 1.0}), 400),
    "allowed_token_ids_empty": ("POST", C, cmpl(allowed_token_ids=[]), 400),
    "allowed_token_ids_negative": ("POST", C, cmpl(allowed_token_ids=[3, -1]), 400),
    "allowed_token_ids_out_of_vocab": ("POST", C, cmpl(allowed_token_ids=[3, VOCAB]), 400),
    "allowed_token_ids_not_a_list": ("POST", C, cmpl(allowed_token_ids=7), 400),
    "best_of_not_n": ("POST", C, cmpl(best_of=3), 400),
    "suffix_unsupported": ("POST", C, cmpl(suffix="x"), 400),
    "priority_fraction": ("POST", C, cmpl(priority=1.5), 400),
    # -- non-finite numbers: JSON has no inf, but 1e400 parses as inf, and Python's JSON reader
    # takes NaN and Infinity
    "temperature_1e400": (
        "POST",
        C,
        b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e400}',
        400,
    ),
    "temperature_infinity": ("POST", C, b'{"prompt": "hi", "temperature": Infinity}', 400),
    "temperature_nan": ("POST", C, b'{"prompt": "hi", "temperature": NaN}', 400),
    "repetition_penalty_1e400": ("POST", C, b'{"prompt": "hi", "repetition_penalty": 1e400}', 400),
    "presence_penalty_nan": ("POST", C, b'{"prompt": "hi", "presence_penalty": NaN}', 400),
    "frequency_penalty_minus_1e400": (
        "POST",
        C,
        b'{"prompt": "hi", "frequency_penalty": -1e400}',
        400,
    ),
    "top_p_1e400": ("POST", C, b'{"prompt": "hi", "top_p": 1e400}', 400),
    "min_p_nan": ("POST", C, b'{"prompt": "hi", "min_p": NaN}', 400),
    "logit_bias_1e400": ("POST", C, b'{"prompt": "hi", "logit_bias": {"1": 1e400}}', 400),
    "logit_bias_nan": ("POST", C, b'{"prompt": "hi", "logit_bias": {"1": NaN}}', 400),
    "priority_1e400": ("POST", C, b'{"prompt": "hi", "priority": 1e400}', 400),
    "chat_temperature_1e400": (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
        400,
    ),
    "chat_repetition_penalty_1e400": (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e400}',
        400,
    ),
    # -- /v1/completions: the prompt
    "prompt_1100_token_ids": ("POST", C, cmpl(prompt=[100] * 1100), 400),
    "prompt_plus_max_tokens_too_long": ("POST", C, cmpl(prompt=[100] * 1000, max_tokens=100), 400),
    "max_tokens_huge": ("POST", C, cmpl(max_tokens=10**13), 400),
    "prompt_empty_string": ("POST", C, cmpl(prompt=""), 400),
    "prompt_empty_list": ("POST", C, cmpl(prompt=[]), 400),
    "prompt_empty_token_list": ("POST", C, cmpl(prompt=[[]]), 400),
    "prompt_mixed_types": ("POST", C, cmpl(prompt=[1, "a"]), 400),
    "prompt_dict": ("POST", C, cmpl(prompt={"text": "hi"}), 400),
    "prompt_token_id_out_of_vocab": ("POST", C, cmpl(prompt=[1, VOCAB]), 400),
    "prompt_token_id_negative": ("POST", C, cmpl(prompt=[-1]), 400),
    "prompt_token_id_huge": ("POST", C, cmpl(prompt=[2**40]), 400),
    "prompt_batch_token_id_out_of_vocab": ("POST", C, cmpl(prompt=[[1, 2], [3, VOCAB]]), 400),
    "prompt_missing": ("POST", C, {"model": MODEL, "max_tokens": 2}, 400),
    "completion_unknown_model": ("POST", C, cmpl(model="no-such-model"), 404),
    # -- the body itself
    "malformed_json": ("POST", C, b'{"prompt": "hi", ', 400),
    "json_not_an_object": ("POST", C, b"[1, 2]", 400),
    "json_null": ("POST", C, b"null", 400),
    "empty_body": ("POST", C, b"", 400),
    "body_not_utf8": ("POST", C, b"\xff\xfe", 400),
    # -- /v1/chat/completions
    "chat_top_logprobs_without_logprobs": ("POST", CHAT, chat(top_logprobs=2), 400),
    "chat_top_logprobs_21": ("POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    "chat_messages_empty": ("POST", CHAT, chat(messages=[]), 400),
    # tools: "auto" (the default with tools) needs --enable-auto-tool-choice, as in vLLM
    "chat_tools_auto_not_enabled": (
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
    ),
    "chat_tool_call_without_a_name": (
        "POST",
        CHAT,
        chat(messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}]),
        400,
    ),
    "chat_messages_not_a_list": ("POST", CHAT, chat(messages="hi"), 400),
    "chat_messages_missing": ("POST", CHAT, {"model": MODEL}, 400),
    "chat_bad_role": ("POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400),
    "chat_message_without_role": ("POST", CHAT, chat(messages=[{"content": "x"}]), 400),
    "chat_content_int": ("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400),
    "chat_image_content": (
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        400,
    ),
    "chat_max_completion_tokens_zero": ("POST", CHAT, chat(max_completion_tokens=0), 400),
    "chat_temperature_negative": ("POST", CHAT, chat(temperature=-0.5), 400),
    # ints past 64 bits cannot be sent to the engine (the schema fuzz found a 500 here)
    "chat_huge_int_in_kv_transfer_params": (
        "POST",
        CHAT,
        chat(kv_transfer_params={"x": 10**30}),
        400,
    ),
    "chat_huge_priority": ("POST", CHAT, chat(priority=10**30), 400),
    "chat_prompt_too_long": (
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "word " * 1100}]),
        400,
    ),
    "chat_max_tokens_over_context": ("POST", CHAT, chat(max_tokens=1020), 400),
    "chat_tools_unsupported": ("POST", CHAT, chat(tools=[{"type": "function"}]), 400),
    "chat_unknown_model": ("POST", CHAT, chat(model="no-such-model"), 404),
    # -- /tokenize and /detokenize
    "tokenize_neither_prompt_nor_messages": ("POST", TOK, {"model": MODEL}, 400),
    "tokenize_both": ("POST", TOK, {"prompt": "a", "messages": MESSAGES}, 400),
    "tokenize_prompt_int": ("POST", TOK, {"prompt": 5}, 400),
    "tokenize_empty_messages": ("POST", TOK, {"messages": []}, 400),
    "tokenize_unknown_model": ("POST", TOK, {"model": "no-such-model", "prompt": "a"}, 404),
    "detokenize_out_of_vocab": ("POST", DETOK, {"tokens": [VOCAB]}, 400),
    "detokenize_negative": ("POST", DETOK, {"tokens": [-1]}, 400),
    "detokenize_not_a_list": ("POST", DETOK, {"tokens": "abc"}, 400),
    "detokenize_float": ("POST", DETOK, {"tokens": [1.5]}, 400),
    "detokenize_missing_tokens": ("POST", DETOK, {"model": MODEL}, 400),
    "detokenize_unknown_model": ("POST", DETOK, {"model": "no-such-model", "tokens": [1]}, 404),
    # -- routes and methods
    "unknown_route": ("POST", "/v1/no-such-route", {}, 404),
    "unknown_get_route": ("GET", "/v1/engines", None, 404),
    # a generating server: 400 naming --runner pooling (vLLM: "does not support Embeddings API")
    "embeddings_not_served": ("POST", "/v1/embeddings", {"input": "x"}, 400),
    "get_on_completions": ("GET", C, None, 405),
    "delete_models": ("DELETE", "/v1/models", None, 405),
}


PARAMS = [pytest.param(*case, id=name) for name, case in CASES.items()]


def _with_model(value: Any, model: str) -> Any:
    if value == MODEL:
        return model
    if isinstance(value, dict):
        return {k: _with_model(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_model(v, model) for v in value]
    return value


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] == status
    return dict(error)


@pytest.fixture(scope="module")
def model(tiny_server: ServerProcess) -> str:
    return str(tiny_server.get("/v1/models").json()["data"][0]["id"])


def still_serving(server: ServerProcess, model: str) -> None:
    ok = server.post("/v1/completions", {"model": model, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("method", "path", "body", "status"), PARAMS)
def test_bad_request(
    tiny_server: ServerProcess,
    model: str,
    method: str,
    path: str,
    body: dict[str, Any] | bytes | None,
    status: int,
) -> None:
    url = tiny_server.url + path
    with httpx.Client(timeout=30) as http:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            response = http.request(method, url, content=body, headers=headers)
        elif body is None:
            response = http.request(method, url)
        else:
            response = http.request(method, url, json=_with_model(body, model))
    assert_error_shape(response, status)
    still_serving(tiny_server, model)


def test_malformed_json_names_no_param(tiny_server: ServerProcess) -> None:
    response = httpx.post(
        tiny_server.url + C,
        content=b'{"prompt": "hi", ',
        headers={"content-type": "application/json"},
    )
    error = assert_error_shape(response, 400)
    assert error["param"] is None and "JSON" in error["message"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (C, "temperature", b"1e400"),
        (C, "temperature", b"-1e400"),
        (C, "repetition_penalty", b"1e400"),
        (C, "repetition_penalty", b"NaN"),
        (C, "top_p", b"NaN"),
        (C, "presence_penalty", b"Infinity"),
        (CHAT, "temperature", b"1e400"),
        (CHAT, "frequency_penalty", b"-Infinity"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(
    tiny_server: ServerProcess, path: str, field: str, value: bytes
) -> None:
    """inf and NaN pass pydantic's float fields; SamplingParams refuses them, naming the field,
    streamed or not."""
    what = b'"prompt": "hi"' if path == C else b'"messages": [{"role": "user", "content": "hi"}]'
    for stream in (b"false", b"true"):
        # Raw bytes: json.dumps would write inf as Infinity, and 1e400 is what a client can send.
        body = b'{%s, "max_tokens": 2, "stream": %s, "%s": %s}' % (
            what,
            stream,
            field.encode(),
            value,
        )
        response = httpx.post(
            tiny_server.url + path, content=body, headers={"content-type": "application/json"}
        )
        error = assert_error_shape(response, 400)
        assert error["param"] == field, error
        assert error["message"].startswith(f"{field} must be a finite number"), error


def test_too_long_prompt_fails_before_the_stream_starts(
    tiny_server: ServerProcess, model: str
) -> None:
    for path, body in [
        (C, cmpl(prompt=[100] * 1100, stream=True)),
        (C, cmpl(prompt=[100] * 1000, max_tokens=100, stream=True)),
        (CHAT, chat(messages=[{"role": "user", "content": "word " * 1100}], stream=True)),
    ]:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", tiny_server.url + path, json=_with_model(body, model)) as r:
                r.read()
        assert r.headers["content-type"].startswith("application/json")
        error = assert_error_shape(r, 400)
        assert "1024" in error["message"]  # names the context length
    still_serving(tiny_server, model)


def test_huge_n_is_refused_without_stalling_the_server(
    tiny_server: ServerProcess, model: str
) -> None:
    """n is bounded by max_num_seqs; a huge n must be refused before the API process builds one
    detokenizer per sample (which would block the event loop for every client): the refusal is
    the check that runs before any request state (AsyncEngineClient._check_before_state), and
    the server keeps serving."""
    response = httpx.post(tiny_server.url + C, json=cmpl(model=model, n=2**18), timeout=60)
    error = assert_error_shape(response, 400)
    assert error["message"].startswith(f"n={2**18} exceeds max_num_seqs="), error
    still_serving(tiny_server, model)
