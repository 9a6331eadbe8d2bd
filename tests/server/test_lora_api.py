"""LoRA adapters on `pagoda serve --enable-lora`, through the official openai client: an adapter
named as `model` (from --lora-modules, or loaded at run time with
PAGODA_ALLOW_RUNTIME_LORA_UPDATING) gives the offline engine's greedy text with that adapter
(itself HF+PEFT's tokens: tests/models/test_lora.py), /v1/models lists base and
adapters, unloading makes the name a 404, a bad adapter is a 400 and the server goes on, the
load routes need the API key, Anthropic's Messages route runs and names the adapter, and /metrics
names the adapters in pagoda:lora_requests_info."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import AdapterSpec, save_adapter
from tests.server.conftest import SMALL_POOL, ServerProcess

KEY = "sk-lora"
PROMPT = [1, 450, 2232, 310, 263]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(
    tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    base = tiny_model_dir("llama")
    out = {"base": base}
    for name, spec in {
        "sql": AdapterSpec(rank=8, alpha=16),
        "chat": AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=2),
        "huge": AdapterSpec(rank=32, alpha=32, seed=3),
    }.items():
        out[name] = save_adapter(base, str(tmp_path_factory.mktemp(f"lora-{name}")), spec)
    return out


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[ServerProcess]:
    flags = (
        *SMALL_POOL,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={adapters['sql']}",
    )
    env = {"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    proc = ServerProcess(adapters["base"], flags, api_key=KEY, env=env).wait_ready()
    yield proc
    proc.stop()


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(adapters: dict[str, str]) -> Callable[[str | None], str]:
    """The offline engine's greedy text of PROMPT with an adapter (a path) or none."""
    llm = LLM(adapters["base"], enable_lora=True, max_loras=1, max_lora_rank=8)

    def text(path: str | None) -> str:
        lora = (
            None
            if path is None
            else LoRARequest("x", 1 + sorted(adapters.values()).index(path), path)
        )
        outs = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False, lora_request=lora)
        return outs[0].outputs[0].text

    return text


def _greedy(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text


def test_static_and_runtime_adapters_give_the_offline_engines_text(
    server: ServerProcess, adapters: dict[str, str], offline: Callable[[str | None], str]
) -> None:
    client = server.client()
    base_name = client.models.list().data[0].id
    assert offline(None) != offline(adapters["sql"]) != offline(adapters["chat"])  # not vacuous
    assert _greedy(client, base_name) == offline(None)
    assert _greedy(client, "sql") == offline(adapters["sql"])

    loaded = server.post(
        "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert _greedy(client, "chat") == offline(adapters["chat"])

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base_name, "sql", "chat"}
    assert models["chat"].parent == base_name and models["chat"].root == adapters["chat"]  # type: ignore[attr-defined]

    again = server.post(
        "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]}
    )
    assert again.status_code == 400
    assert "has already been loaded" in again.json()["error"]["message"]

    gone = server.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "chat")
    missing = server.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."


def test_the_messages_route_runs_the_named_adapter_and_names_it(server: ServerProcess) -> None:
    """Anthropic's Messages route (and its stream's message_start) names the adapter the request
    named, as the OpenAI routes do, and gives the chat completion's text with it."""
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    chat = server.client().chat.completions.create(
        model="sql", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    # anthropic's client takes no sampling arguments: temperature goes in the body
    greedy: dict[str, Any] = {"max_tokens": MAX_TOKENS, "extra_body": {"temperature": 0.0}}
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    message = client.messages.create(model="sql", messages=messages, **greedy)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert message.model == "sql" and text == chat.choices[0].message.content
    with client.messages.stream(model="sql", messages=messages, **greedy) as stream:
        started = [e.message.model for e in stream if e.type == "message_start"]
        streamed = stream.get_final_message()
    assert started == ["sql"] and streamed.model == "sql"
    assert "".join(b.text for b in streamed.content if b.type == "text") == text


def test_bad_adapters_are_400s_and_the_server_goes_on(
    server: ServerProcess, adapters: dict[str, str], tmp_path: Any
) -> None:
    too_big = server.post(
        "/v1/load_lora_adapter", {"lora_name": "huge", "lora_path": adapters["huge"]}
    )
    assert too_big.status_code == 400
    assert "above --max-lora-rank 8" in too_big.json()["error"]["message"]
    nowhere = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert nowhere.status_code == 400
    assert "adapter_config.json" in nowhere.json()["error"]["message"]
    assert "huge" not in {m.id for m in server.client().models.list().data}
    assert _greedy(server.client(), "sql")  # its usage holds MAX_TOKENS tokens


def test_the_load_routes_need_the_api_key(server: ServerProcess, adapters: dict[str, str]) -> None:
    body = {"lora_name": "chat2", "lora_path": adapters["chat"]}
    no_key = server.post("/v1/load_lora_adapter", body, headers={"Authorization": "Bearer wrong"})
    assert no_key.status_code == 401


def test_metrics_name_the_adapters(server: ServerProcess) -> None:
    _greedy(server.client(), "sql")
    lines = [
        line
        for line in server.get("/metrics").text.splitlines()
        if line.startswith("pagoda:lora_requests_info{")
    ]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0], lines


def test_without_the_runtime_switch_there_are_no_load_routes(adapters: dict[str, str]) -> None:
    flags = (*SMALL_POOL, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}")
    proc = ServerProcess(adapters["base"], flags).wait_ready()
    try:
        body = {"lora_name": "chat", "lora_path": adapters["chat"]}
        assert proc.post("/v1/load_lora_adapter", body).status_code == 404
        assert "sql" in {m.id for m in proc.client().models.list().data}
    finally:
        proc.stop()
