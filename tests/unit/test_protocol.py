"""The HTTP schemas -> SamplingParams mapping, and the engine-process wire messages."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineInput,
    EngineRequest,
    SchedulerStats,
)
from pagoda.server.protocol import ChatCompletionRequest, CompletionRequest


def test_completion_fields_map_to_sampling_params() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [3],
            "ignore_eos": True,
            "min_tokens": 2,
            "logprobs": 3,
            "unknown_field": "ignored, as vLLM does",
        }
    )
    p = req.sampling_params(req.max_tokens, req.logprobs)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (7, ("END",), (3,), True)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 2, 3)


def test_defaults_follow_openai() -> None:
    completion = CompletionRequest.model_validate({"prompt": "x"})
    p = completion.sampling_params(completion.max_tokens, completion.logprobs)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.logprobs) == (16, 1.0, 1.0, 1, None)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.sampling_params(chat.max_tokens, None).max_tokens is None  # up to max_model_len


def test_out_of_range_values_raise_value_error_naming_the_field() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "top_p": 1.5})
    with pytest.raises(ValueError, match="^top_p"):
        req.sampling_params(req.max_tokens, None)
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": 500}})
    with pytest.raises(ValueError, match="^logit_bias"):
        req.sampling_params(req.max_tokens, None)
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"one": 5}})
    with pytest.raises(ValueError, match="^logit_bias"):
        req.sampling_params(req.max_tokens, None)


def test_logit_bias_keys_become_token_ids() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": 5, "2": -100}})
    assert req.sampling_params(16, None).logit_bias == ((2, -100.0), (7, 5.0))


def test_wrong_types_fail_validation() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "many"})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"max_tokens": 3})


def test_chat_message_parts_join_into_text() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )
    assert req.messages[0].text() == "ab"


def test_engine_request_round_trips_as_it_is() -> None:
    params = SamplingParams(n=3, temperature=0.7, stop=["x", "y"], seed=1, max_tokens=9)
    msg = EngineRequest("r1", [1, 2], params, priority=2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineInput)
    assert isinstance(decoded, EngineRequest)
    req = decoded
    assert req.request_id == "r1" and req.prompt_token_ids == [1, 2] and req.priority == 2
    assert req.sampling_params == params
    abort = AbortRequest(["r1#2"], all_samples=False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(abort), type=EngineInput) == abort


def test_outputs_out_round_trips() -> None:
    out = EngineCoreOutput(
        request_id="r1#1",
        new_token_ids=[5],
        new_logprobs=[([5, 6], [-0.1, -2.0], 1)],
        new_prompt_logprobs=[],
        finish_reason="stop",
        stop_reason=2,
        num_cached_tokens=16,
        first_scheduled_time=1.5,
        parent_id="r1",
        sample_index=1,
    )
    msg = EngineCoreOutputs(
        4,
        SchedulerStats(1, 2, 0.25, 10, 5, 0),
        outputs=[out],
        accepted=["r2"],
        errors={"r3": "too long"},
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineCoreOutputs)
    assert decoded == msg
