"""Reasoning output (`pagoda serve --reasoning-parser qwen3`), through the `openai` client.

One server on a tiny random Qwen3 whose tokenizer has `<think>` and `</think>` as tokens (added,
not special, as in Qwen3's) and a Qwen3-style chat template with `enable_thinking`. A random
model thinks no words, so `logit_bias` on `</think>` makes it emit the tag at seeded, random
places; the same request on /v1/completions (no parser) gives the raw text, which the chat
answer must split exactly: the text before the first `</think>` is `reasoning_content` (and
`reasoning`), the rest `content`, whole or streamed, and `reasoning_tokens` counts the tokens up
to and including the tag.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from tests.server.conftest import SMALL_POOL, ServerProcess

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
SEEDS = [1, 2, 3, 4]
BIAS = 10.0  # on </think>: about a third of the draws at temperature 1


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    folder: Path = tmp_path_factory.mktemp("tiny-thinking-qwen3")
    smollm2_tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def server(thinking_model: str) -> Iterator[ServerProcess]:
    process = ServerProcess(thinking_model, (*SMALL_POOL, "--reasoning-parser", "qwen3"))
    yield process.wait_ready()
    process.stop()


@pytest.fixture(scope="module")
def tokenizer(thinking_model: str) -> Any:
    return AutoTokenizer.from_pretrained(thinking_model)


def _end_id(tokenizer: Any) -> int:
    ids = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(ids) == 1
    return int(ids[0])


def _prompt_ids(tokenizer: Any, **kwargs: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _raw(server: ServerProcess, prompt: list[int], seed: int, bias: dict[str, float]) -> str:
    out = server.client().completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        seed=seed,
        logit_bias=bias,  # type: ignore[arg-type]
    )
    return out.choices[0].text


def _split(raw: str) -> tuple[str | None, str | None]:
    """qwen3's split of an output without `<think>` after a prompt without a tag."""
    before, tag, after = raw.partition("</think>")
    return (before, after or None) if tag else (None, raw)


def _reasoning(message: Any) -> tuple[Any, Any]:
    extra = message.model_extra or {}
    return extra.get("reasoning_content"), extra.get("reasoning")


def test_the_answer_and_the_reasoning_come_apart(server: ServerProcess, tokenizer: Any) -> None:
    end = _end_id(tokenizer)
    bias = {str(end): BIAS}
    prompt = _prompt_ids(tokenizer)
    client = server.client()
    thought_before_the_tag = 0
    for seed in SEEDS:
        raw = _raw(server, prompt, seed, bias)
        reasoning, content = _split(raw)
        thought_before_the_tag += bool(reasoning)
        out = client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,  # type: ignore[arg-type]
            logprobs=True,
        )
        message = out.choices[0].message
        assert _reasoning(message) == (reasoning, reasoning)
        assert message.content == content
        tokens = [t.token for t in out.choices[0].logprobs.content]  # type: ignore[union-attr]
        counted = tokens.index("</think>") + 1 if "</think>" in tokens else 0
        assert out.usage is not None and out.usage.completion_tokens_details is not None
        assert out.usage.completion_tokens_details.reasoning_tokens == counted
        assert out.usage.prompt_tokens == len(prompt)
        left_out = client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,  # type: ignore[arg-type]
            extra_body={"include_reasoning": False},
        )
        assert _reasoning(left_out.choices[0].message) == (None, None)
        assert left_out.choices[0].message.content == content
    assert thought_before_the_tag >= 1  # some seed put text before the tag


def test_streamed_pieces_add_up_to_the_whole_answer(server: ServerProcess, tokenizer: Any) -> None:
    bias = {str(_end_id(tokenizer)): BIAS}
    client = server.client()
    for seed in SEEDS:
        kwargs: dict[str, Any] = dict(
            model=None, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed, n=2
        )
        whole = client.chat.completions.create(**kwargs, logit_bias=bias)
        reasoning: dict[int, list[str]] = {0: [], 1: []}
        content: dict[int, list[str]] = {0: [], 1: []}
        usage = None
        for chunk in client.chat.completions.create(
            **kwargs, logit_bias=bias, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                extra = c.delta.model_extra or {}
                assert extra.get("reasoning") == extra.get("reasoning_content")
                reasoning[c.index].append(extra.get("reasoning_content") or "")
                content[c.index].append(c.delta.content or "")
        for c in whole.choices:
            assert "".join(reasoning[c.index]) == (_reasoning(c.message)[0] or "")
            assert "".join(content[c.index]) == (c.message.content or "")
        assert usage is not None and usage.completion_tokens_details is not None
        assert whole.usage.completion_tokens_details is not None
        assert (
            usage.completion_tokens_details.reasoning_tokens
            == whole.usage.completion_tokens_details.reasoning_tokens
        )


def test_enable_thinking_false_reaches_the_template(server: ServerProcess, tokenizer: Any) -> None:
    """The template writes an empty think block into the prompt: the output is all answer,
    `</think>` in it included."""
    bias = {str(_end_id(tokenizer)): BIAS}
    prompt = _prompt_ids(tokenizer, enable_thinking=False)
    assert prompt != _prompt_ids(tokenizer)
    for seed in SEEDS[:2]:
        raw = _raw(server, prompt, seed, bias)
        out = server.client().chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
        assert out.choices[0].message.content == raw
        assert _reasoning(out.choices[0].message) == (None, None)
        assert out.usage.completion_tokens_details is not None
        assert out.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_template_kwarg_the_render_sets_is_refused(server: ServerProcess) -> None:
    for kwargs in ({"add_generation_prompt": False}, {"messages": []}, "not an object"):
        response = server.post(
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_the_grammar_applies_after_the_reasoning(server: ServerProcess, tokenizer: Any) -> None:
    """`</think>` is pushed to every position; the grammar ("yes" or "no") refuses it. Thinking:
    the first token is free, so the tag comes, then the grammar holds. Not thinking (the prompt
    closed the block): the grammar holds from the first token, and no tag comes."""
    bias = {str(_end_id(tokenizer)): 100.0}
    base: dict[str, Any] = dict(
        model=None,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.0,
        logit_bias=bias,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    out = server.client().chat.completions.create(**base)
    assert _reasoning(out.choices[0].message) == ("", "")
    assert out.choices[0].message.content in ("yes", "no")
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens_details.reasoning_tokens == 1  # type: ignore[union-attr]
    off = {"structured_outputs": {"choice": ["yes", "no"]}}
    off["chat_template_kwargs"] = {"enable_thinking": False}  # type: ignore[dict-item]
    out = server.client().chat.completions.create(**{**base, "extra_body": off})
    assert _reasoning(out.choices[0].message) == (None, None)
    assert out.choices[0].message.content in ("yes", "no")


def test_a_named_tool_call_after_the_reasoning(server: ServerProcess, tokenizer: Any) -> None:
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_time", "parameters": no_arguments}}
    out = server.client().chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0.0,
        logit_bias={str(_end_id(tokenizer)): 100.0},  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    message = out.choices[0].message
    assert _reasoning(message) == ("", "")
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    assert message.tool_calls[0].function.name == "get_time"  # type: ignore[union-attr]
    assert message.tool_calls[0].function.arguments == "{}"  # type: ignore[union-attr]
    assert out.choices[0].finish_reason == "stop"  # a named call stops, as OpenAI's does


def test_an_unknown_reasoning_parser_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--reasoning-parser", "qwen2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--reasoning-parser: invalid choice: 'qwen2'" in run.stderr
    assert "'qwen3', 'deepseek_r1'" in run.stderr


# ---- /v1/responses -----------------------------------------------------------------------------
def _sampled(seed: int, bias: dict[str, float], **extra: Any) -> dict[str, Any]:
    """The Responses request fields of `_raw`'s sampling (seed and logit_bias are extras)."""
    return dict(
        model=None,
        input=MESSAGES[0]["content"],
        max_output_tokens=12,
        temperature=1.0,
        extra_body={"seed": seed, "logit_bias": bias, **extra},
    )


def _items(response: Any) -> list[tuple[str, str, str | None]]:
    """A response's output as (type, text, status), ids left out."""
    out = []
    for item in response.output:
        out.append((item.type, "".join(p.text for p in item.content), item.status))
    return out


def _expected(raw: str, status: str) -> list[tuple[str, str, str | None]]:
    reasoning, content = _split(raw)
    thought = [("reasoning", reasoning, "completed")] if reasoning else []
    return [*thought, ("message", content or "", status)]


def test_a_response_begins_with_its_reasoning(server: ServerProcess, tokenizer: Any) -> None:
    bias = {str(_end_id(tokenizer)): BIAS}
    prompt = _prompt_ids(tokenizer)
    client = server.client()
    thought = 0
    for seed in SEEDS:
        raw = _raw(server, prompt, seed, bias)
        r = client.responses.create(**_sampled(seed, bias))  # type: ignore[call-overload]
        chat = client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,  # type: ignore[arg-type]
        )
        status = "incomplete" if r.status == "incomplete" else "completed"
        assert r.status == (
            "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
        )
        assert _items(r) == _expected(raw, status)
        assert r.output_text == (_split(raw)[1] or "")
        if r.output[0].type == "reasoning":
            thought += 1
            item = r.output[0]
            assert item.id.startswith("rs_") and item.summary == []
            assert [c.type for c in item.content or []] == ["reasoning_text"]
        assert r.usage is not None and chat.usage is not None
        assert chat.usage.completion_tokens_details is not None
        assert (
            r.usage.output_tokens_details.reasoning_tokens
            == chat.usage.completion_tokens_details.reasoning_tokens
        )
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), 12)
    assert thought >= 1


def _collapsed(kinds: list[str]) -> list[str]:
    """Event types with runs of deltas written once."""
    return [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]


def test_a_streamed_response_adds_up_to_the_whole(server: ServerProcess, tokenizer: Any) -> None:
    bias = {str(_end_id(tokenizer)): BIAS}
    client = server.client()
    for seed in SEEDS:
        whole = client.responses.create(**_sampled(seed, bias))  # type: ignore[call-overload]
        events = list(client.responses.create(**_sampled(seed, bias), stream=True))
        kinds = [e.type for e in events]
        final = events[-1].response
        assert _items(final) == _items(whole)
        assert final.usage == whole.usage
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert thinking == (whole.output[0].content[0].text if len(whole.output) == 2 else "")
        assert text == whole.output_text
        message = [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        reasoning = [k.replace("output_text", "reasoning_text") for k in message]
        expected = [
            "response.created",
            "response.in_progress",
            *(reasoning if len(whole.output) == 2 else []),
            *message,
            f"response.{final.status}",
        ]
        assert _collapsed(kinds) == expected
        assert [e.sequence_number for e in events] == list(range(len(events)))
        if len(whole.output) == 2:
            added = next(e for e in events if e.type == "response.output_item.added")
            assert added.item.type == "reasoning" and added.item.status == "in_progress"
            done = next(e for e in events if e.type == "response.reasoning_text.done")
            assert done.text == thinking and done.item_id == final.output[0].id


def test_enable_thinking_false_on_a_response(server: ServerProcess, tokenizer: Any) -> None:
    bias = {str(_end_id(tokenizer)): BIAS}
    prompt = _prompt_ids(tokenizer, enable_thinking=False)
    for seed in SEEDS[:2]:
        raw = _raw(server, prompt, seed, bias)
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        r = server.client().responses.create(**_sampled(seed, bias, **off))  # type: ignore[call-overload]
        assert _items(r) == [("message", raw, r.status)]
        assert r.usage is not None and r.usage.input_tokens == len(prompt)
        assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_a_response_grammar_applies_after_the_reasoning(
    server: ServerProcess, tokenizer: Any
) -> None:
    r = server.client().responses.create(
        model=None,  # type: ignore[arg-type]
        input=MESSAGES[0]["content"],
        max_output_tokens=10,
        temperature=0.0,
        extra_body={
            "logit_bias": {str(_end_id(tokenizer)): 100.0},
            "structured_outputs": {"choice": ["yes", "no"]},
        },
    )
    [item] = r.output  # the thinking is empty: the tag came first
    assert item.type == "message" and r.output_text in ("yes", "no")
    assert r.status == "completed"
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 1


def test_a_reasoning_item_is_left_out_of_the_next_prompt(
    server: ServerProcess, tokenizer: Any
) -> None:
    """Chained by previous_response_id, or sent back as input items, the earlier turn is its
    answer alone: the prompt is the template's render of the conversation without thinking."""
    bias = {str(_end_id(tokenizer)): BIAS}
    client = server.client()
    first = next(
        r
        for seed in SEEDS
        if (r := client.responses.create(**_sampled(seed, bias))).output[0].type == "reasoning"  # type: ignore[call-overload]
    )
    answer = first.output_text
    conversation = [*MESSAGES, {"role": "assistant", "content": answer}]
    conversation.append({"role": "user", "content": "And the sea?"})
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    follow: dict[str, Any] = dict(model=None, max_output_tokens=2, temperature=0.0)
    chained = client.responses.create(**follow, input="And the sea?", previous_response_id=first.id)
    assert chained.usage is not None and chained.usage.input_tokens == expected
    items = [MESSAGES[0], *(i.model_dump() for i in first.output)]
    items.append({"role": "user", "content": "And the sea?"})
    assert items[1]["type"] == "reasoning"
    resent = client.responses.create(**follow, input=items)
    assert resent.usage is not None and resent.usage.input_tokens == expected
    assert _items(resent) == _items(chained)


# ---- /v1/messages ------------------------------------------------------------------------------
# The Messages API has no seed or logit_bias: the prompt opens the thinking (a user text ending in
# `<think>`), and greedy decoding of the random model never closes it.
THINK_FIRST = [{"role": "user", "content": "Why is the sky blue? <think>"}]


def _anthropic(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def _greedy(server: ServerProcess) -> dict[str, Any]:
    """A greedy Messages request's fields (anthropic's client takes temperature in the body)."""
    model = server.get("/v1/models").json()["data"][0]["id"]
    return dict(model=model, max_tokens=12, extra_body={"temperature": 0.0})


def _greedy_raw(server: ServerProcess, tokenizer: Any, messages: list[Any], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    out = server.client().completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=tokenizer.encode(text, add_special_tokens=False),
        max_tokens=12,
        temperature=0.0,
    )
    return out.choices[0].text


def _blocks(message: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_a_message_begins_with_its_thinking(server: ServerProcess, tokenizer: Any) -> None:
    raw = _greedy_raw(server, tokenizer, THINK_FIRST)
    assert raw and "<think>" not in raw and "</think>" not in raw
    client = _anthropic(server)
    greedy = _greedy(server)
    message = client.messages.create(**greedy, messages=THINK_FIRST)  # type: ignore[arg-type]
    assert _blocks(message) == [("thinking", raw)]
    assert message.content[0].signature == ""  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens"
    # no tag in the prompt, none in the output: all answer
    plain = client.messages.create(**greedy, messages=MESSAGES)  # type: ignore[arg-type]
    assert _blocks(plain) == [("text", _greedy_raw(server, tokenizer, MESSAGES))]
    # an earlier turn's thinking block is left out of the prompt
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Rayleigh.", "signature": ""},
                {"type": "text", "text": "Scattering."},
            ],
        },
        *THINK_FIRST,
    ]
    rendered = [*MESSAGES, {"role": "assistant", "content": "Scattering."}, *THINK_FIRST]
    again = client.messages.create(**greedy, messages=history)  # type: ignore[arg-type]
    prompt = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert again.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert _blocks(again) == [("thinking", _greedy_raw(server, tokenizer, rendered))]
    user_thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**greedy, messages=user_thinking)  # type: ignore[arg-type]
    assert "messages.0.content.0" in str(caught.value)


def test_a_streamed_message_adds_up_to_the_whole(server: ServerProcess) -> None:
    client = _anthropic(server)
    greedy = _greedy(server)
    whole = client.messages.create(**greedy, messages=THINK_FIRST)  # type: ignore[arg-type]
    events = list(client.messages.create(**greedy, messages=THINK_FIRST, stream=True))  # type: ignore[arg-type]
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in events]
    # the client keeps pings out of its stream
    assert [k for i, k in enumerate(kinds) if k != kinds[i - 1]] == [
        "message_start",
        "content_block_start",
        "thinking_delta",
        "signature_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[1]
    assert start.content_block.model_dump() == {"type": "thinking", "thinking": "", "signature": ""}  # type: ignore[union-attr]
    thinking = "".join(
        e.delta.thinking  # type: ignore[union-attr]
        for e, kind in zip(events, kinds)
        if kind == "thinking_delta"
    )
    assert [("thinking", thinking)] == _blocks(whole)
    with client.messages.stream(**greedy, messages=THINK_FIRST) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.content == whole.content
    assert final.usage.output_tokens == whole.usage.output_tokens == 12


def test_thinking_disabled_on_a_message(server: ServerProcess, tokenizer: Any) -> None:
    """`thinking: {"type": "disabled"}` renders the template with enable_thinking false: its
    empty think block comes after the user's `<think>`, so the output is all answer."""
    raw = _greedy_raw(server, tokenizer, THINK_FIRST, enable_thinking=False)
    text = tokenizer.apply_chat_template(
        THINK_FIRST, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    client = _anthropic(server)
    greedy = _greedy(server)
    off: dict[str, Any] = dict(
        model=greedy.pop("model"), messages=THINK_FIRST, thinking={"type": "disabled"}
    )
    message = client.messages.create(**off, **greedy)
    assert _blocks(message) == [("text", raw)]
    assert message.usage.input_tokens == len(prompt)
    assert client.messages.count_tokens(**off).input_tokens == len(prompt)
    on = {"type": "enabled", "budget_tokens": 1024}
    thinking = client.messages.create(**{**off, "thinking": on}, **greedy)
    assert [t for t, _ in _blocks(thinking)] == ["thinking"]
