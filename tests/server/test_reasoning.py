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
