"""IncrementalDetokenizer against full decodes with the SmolLM2 tokenizer (byte-level BPE), and
the client's RequestState around it."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.client.detokenizer import IncrementalDetokenizer
from pagoda.client.output_processor import RequestState
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineCoreOutput, sample_request_id

TEXTS = [
    "Hello world, this is a plain sentence.",
    "Héllo wörld: naïve café, crème brûlée, Ångström, façade.",
    "Emoji 😀🎉 and flags 🇫🇷🇯🇵, family 👨‍👩‍👧 and 👍🏽 done.",
    "中文测试：你好世界。日本語のテキスト、한국어 텍스트.",
    "Mixed: 東京 is 🗼, π≈3.14159, ∑x², “quotes” — and tabs\tnewlines\n\nend",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    """SmolLM2's tokenizer (tests/conftest.py: loader.load_tokenizer, loaded once a session)."""
    return smollm2_tokenizer


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(PROMPT, add_special_tokens=False))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def detok(tokenizer: Any, prompt_ids: list[int], **kwargs: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**kwargs))


def id_of(tokenizer: Any, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


# ---------------------------------------------------------------- text


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer: Any, prompt_ids: list[int], text: str):
    ids = encode(tokenizer, text)
    d = detok(tokenizer, prompt_ids)
    for i, token_id in enumerate(ids):
        assert d.update([token_id]) is None
        full = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        # Never a replacement character mid-character; the text is always a prefix.
        assert "\ufffd" not in d.output_text
        assert full.startswith(d.output_text)
        # Only an incomplete trailing character may be held back.
        assert len(full) - len(d.output_text) <= 1 or full.endswith("\ufffd")
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert d.token_ids == ids


def test_multi_token_characters_are_held_until_complete(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "😀")
    assert len(ids) > 1  # one character, several byte-level tokens
    d = detok(tokenizer, prompt_ids)
    for token_id in ids[:-1]:
        d.update([token_id])
        assert d.output_text == "" and d.get_delta() == ""
    d.update(ids[-1:])
    assert d.output_text == "😀" and d.get_delta() == "😀"


def test_several_tokens_per_update(tokenizer: Any, prompt_ids: list[int]):
    text = " ".join(TEXTS)
    ids = encode(tokenizer, text)
    d = detok(tokenizer, prompt_ids)
    for start in range(0, len(ids), 3):
        d.update(ids[start : start + 3])
    assert d.output_text == text


def test_skip_special_tokens(tokenizer: Any, prompt_ids: list[int]):
    im_end, file_sep = id_of(tokenizer, "<|im_end|>"), id_of(tokenizer, "<file_sep>")
    ids = [file_sep, *encode(tokenizer, "Hi there"), im_end, *encode(tokenizer, " more")]
    d = detok(tokenizer, prompt_ids)
    d.update(ids)
    assert d.output_text == "Hi there more" == tokenizer.decode(ids, skip_special_tokens=True)
    d = detok(tokenizer, prompt_ids, skip_special_tokens=False)
    for token_id in ids:
        d.update([token_id])
    assert d.output_text == "<file_sep>Hi there<|im_end|> more"
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=False)


def test_stop_terminated_leaves_out_the_stop_token(tokenizer: Any, prompt_ids: list[int]):
    stop_id = encode(tokenizer, " END")[0]
    ids = encode(tokenizer, "Some text") + [stop_id]
    d = detok(tokenizer, prompt_ids)
    assert d.update(ids, stop_terminated=True) is None
    assert d.output_text == "Some text" and d.token_ids == ids
    d = detok(tokenizer, prompt_ids, include_stop_str_in_output=True)
    d.update(ids, stop_terminated=True)
    assert d.output_text == tokenizer.decode(ids)


def test_no_detokenize(tokenizer: Any, prompt_ids: list[int]):
    d = detok(tokenizer, prompt_ids, detokenize=False)
    ids = encode(tokenizer, "Hello world")
    assert d.update(ids) is None
    assert d.output_text == "" and d.get_delta(finished=True) == "" and d.token_ids == ids


def test_decode_token(tokenizer: Any, prompt_ids: list[int]):
    d = detok(tokenizer, prompt_ids)
    assert d.decode_token(id_of(tokenizer, "Ġworld")) == " world"
    assert d.decode_token(id_of(tokenizer, "<|im_end|>")) == "<|im_end|>"


# ---------------------------------------------------------------- stop strings


def feed(d: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    """Feed one token at a time until a stop string hits: (stop, tokens fed)."""
    for i, token_id in enumerate(ids):
        stop = d.update([token_id])
        if stop is not None:
            return stop, i + 1
    return None, len(ids)


def test_stop_string_cuts_text(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "The answer is 42. Next question: why?")
    d = detok(tokenizer, prompt_ids, stop=". Next")
    stop, fed = feed(d, ids)
    assert stop == ". Next" and d.finished and d.stop_reason == ". Next"
    assert d.output_text == "The answer is 42"
    assert tokenizer.decode(ids[:fed]).endswith("Next")  # hit on the token that completes it
    assert d.update(ids[fed:]) is None  # tokens in flight after the stop are ignored
    assert d.output_text == "The answer is 42" and d.token_ids == ids[:fed]


def test_stop_string_spanning_two_tokens(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "Hello world, how are you")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:2] == ["Hello", "Ġworld"]
    d = detok(tokenizer, prompt_ids, stop="lo wo")  # "Hel|lo" + " wo|rld"
    stop, fed = feed(d, ids)
    assert (stop, fed) == ("lo wo", 2)
    assert d.output_text == "Hel"


def test_stop_string_inside_one_token_drops_the_rest(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "Hello world, how are you")
    d = detok(tokenizer, prompt_ids, stop="or")
    assert feed(d, ids) == ("or", 2)
    assert d.output_text == "Hello w"
    d = detok(tokenizer, prompt_ids, stop="or", include_stop_str_in_output=True)
    assert feed(d, ids) == ("or", 2)
    assert d.output_text == "Hello wor"


def test_include_stop_str_in_output(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "Step one. STOP then more text")
    d = detok(tokenizer, prompt_ids, stop=["STOP"], include_stop_str_in_output=True)
    assert feed(d, ids)[0] == "STOP"
    assert d.output_text == "Step one. STOP"


def test_multiple_stops_earliest_wins(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "alpha beta gamma delta")
    # All at once: both stops appear in the same update; the earlier one wins, not list order.
    d = detok(tokenizer, prompt_ids, stop=["delta", "beta"])
    assert d.update(ids) == "beta"
    assert d.output_text == "alpha "
    d = detok(tokenizer, prompt_ids, stop=["gamma", "ta gam"])
    assert d.update(ids) == "ta gam"
    assert d.output_text == "alpha be"
    d = detok(tokenizer, prompt_ids, stop=["gamma", "ta gam"], include_stop_str_in_output=True)
    assert d.update(ids) == "ta gam"
    assert d.output_text == "alpha beta gam"
    d = detok(tokenizer, prompt_ids, stop=["zzz", "delta"])
    assert feed(d, ids)[0] == "delta"
    assert d.output_text == "alpha beta gamma "


def test_stop_strings_wait_for_min_tokens(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "x y x y x")
    d = detok(tokenizer, prompt_ids, stop="y", min_tokens=2, max_tokens=10)
    # The first "y" arrives as token 2 (not > min_tokens); the second one stops.
    stop, fed = feed(d, ids)
    assert stop == "y" and fed == 4
    assert d.output_text == "x y x "


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_final_text(tokenizer: Any, prompt_ids: list[int], text: str):
    ids = encode(tokenizer, text)
    for stop in ([], ["zzz-never"], [text[len(text) // 2 : len(text) // 2 + 3]]):
        d = detok(tokenizer, prompt_ids, stop=stop)
        streamed = ""
        hit = None
        for token_id in ids:
            hit = d.update([token_id])
            delta = d.get_delta()
            streamed += delta
            assert "\ufffd" not in delta
            assert d.output_text.startswith(streamed)
            if hit is not None:
                break
        streamed += d.get_delta(finished=True)
        assert streamed == d.output_text
        if stop:
            assert stop[0] not in streamed
        if hit is None:
            assert streamed == text


def test_stream_holds_back_possible_stop_prefix(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "The result is <END> and beyond")
    d = detok(tokenizer, prompt_ids, stop=["<END>"])
    streamed = []
    for token_id in ids:
        hit = d.update([token_id])
        streamed.append(d.get_delta())
        if hit is None:
            # The last len("<END>") - 1 = 4 characters are held back while running.
            assert len("".join(streamed)) == max(len(d.output_text) - 4, 0)
            assert "<" not in "".join(streamed)
        else:
            break
    assert "".join(streamed) == d.output_text == "The result is "
    assert d.get_delta(finished=True) == ""


def test_stream_without_stop_or_with_include_has_no_holdback(tokenizer: Any, prompt_ids: list[int]):
    ids = encode(tokenizer, "abc def ghi")
    for kwargs in ({}, {"stop": ["zzzz"], "include_stop_str_in_output": True}):
        d = detok(tokenizer, prompt_ids, **kwargs)
        out = ""
        for token_id in ids:
            d.update([token_id])
            out += d.get_delta()
            assert out == d.output_text


class FakeSlowTokenizer:
    """A sentencepiece-like slow tokenizer: added tokens bypass convert_tokens_to_string."""

    is_fast = False
    all_special_ids = [0]
    added_tokens_decoder: dict = {}
    pieces = {0: "<s>", 1: "<sep>", 2: "▁hi", 3: "▁there"}

    def get_added_vocab(self) -> dict[str, int]:
        return {"<s>": 0, "<sep>": 1}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens).replace("▁", " ")


def test_slow_tokenizer_spaces_between_special_tokens():
    fake = FakeSlowTokenizer()
    ids = [0, 2, 1, 3]
    expected = {True: " hi <sep>  there", False: " hi<sep> there"}
    for spaces, text in expected.items():
        d = detok(fake, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        for token_id in ids:
            d.update([token_id])
        assert d.output_text == "<s>" + (" " if spaces else "") + text
    d = detok(fake, [], skip_special_tokens=True)
    d.update(ids)
    assert d.output_text == " hi <sep>  there"  # <sep> is added but not special


# ---------------------------------------------------------------- the client's request state


def _out(sample: int, tokens: list[int], finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput("r", tokens, [], [], finish, parent_id="r", sample_index=sample)


def test_request_state_ignores_tokens_after_a_client_stop(tokenizer: Any, prompt_ids: list[int]):
    """n = 2, sample 0 hits a stop string in the client: it is finished there and its engine
    sample is aborted, but outputs already on their way (the server's core process, async
    scheduling) still arrive; they must not grow the finished sample."""
    params = SamplingParams(n=2, stop=". Next", max_tokens=50)
    state = RequestState("r", None, prompt_ids, params, tokenizer, arrival_time=0.0)
    ids = encode(tokenizer, "The answer is 42. Next question")
    stop_at = next(i for i in range(1, len(ids)) if "Next" in tokenizer.decode(ids[:i]))
    aborts = [state.add(_out(0, [t])) for t in ids[:stop_at]]
    assert aborts[:-1] == [None] * (stop_at - 1) and aborts[-1] == sample_request_id("r", 0)
    s0 = state.samples[0]
    assert (s0.finish_reason, s0.stop_reason) == ("stop", ". Next") and not state.finished
    assert state.add(_out(0, ids[stop_at : stop_at + 1])) is None  # in flight: ignored
    assert state.add(_out(0, [ids[0]], finish="length")) is None
    assert s0.token_ids == ids[:stop_at] and (s0.finish_reason, s0.stop_reason) == (
        "stop",
        ". Next",
    )
    state.add(_out(1, [ids[0]]))
    assert not state.finished
    state.add(_out(1, [ids[1]], finish="length"))
    assert state.finished and state.samples[1].finish_reason == "length"
    out = state.make_output()
    assert out.finished and [c.text for c in out.outputs][0] == "The answer is 42"
