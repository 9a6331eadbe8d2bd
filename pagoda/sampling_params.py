"""What a request asks for: SamplingParams and BeamSearchParams, plain data validated once.

SamplingParams mirrors vLLM's field names, defaults and meanings, so user code ports unchanged.
Nothing here imports torch: the scheduler, the contract and the client read these types.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.structured_outputs import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's SAMPLING_EPS)
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, allowed: str) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    assert isinstance(value, int)
    if value < low:
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _number(name: str, value: object) -> float:
    """`value` as a float; ValueError unless it is a finite int or float (NaN, +-inf and ints
    too large for a float are refused: no range check holds for them)."""
    if _is_number(value):
        assert isinstance(value, (int, float))
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to sample one request's completion; vLLM's names, defaults and ranges.

    Frozen and hashable: `stop` and `stop_token_ids` are stored as tuples. top_k = -1 (vLLM's
    old spelling of "disabled") is stored as 0. Greedy requests (temperature < 1e-5) store
    top_p = 1, top_k = 0 and min_p = 0, as vLLM does, since those cannot change an argmax.
    """

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias added to its logit)
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    detokenize: bool
    # The output must match this grammar (JSON schema, regex, choice list, Lark/GBNF grammar).
    structured_outputs: StructuredOutputsParams | None
    allowed_token_ids: tuple[int, ...] | None  # sample only among these tokens (vLLM's)

    def __init__(
        self,
        n: int = 1,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | tuple[str, ...] | None = None,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
        logit_bias: dict[int, float] | Sequence[Sequence[float]] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        detokenize: bool = True,
        structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
        allowed_token_ids: list[int] | tuple[int, ...] | None = None,
    ) -> None:
        values: dict[str, Any] = dict(locals())
        del values["self"]
        values["structured_outputs"] = StructuredOutputsParams.from_value(structured_outputs)
        values["stop"] = _normalize_stop(stop)
        values["stop_token_ids"] = _normalize_stop_token_ids(stop_token_ids)
        values["logit_bias"] = _normalize_logit_bias(logit_bias)
        values["allowed_token_ids"] = _normalize_allowed_token_ids(allowed_token_ids)
        for name in _FLOAT_FIELDS:
            values[name] = _number(name, values[name])
        if _is_int(top_k) and top_k == -1:
            values["top_k"] = 0
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()
        if self.greedy:
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    def _validate(self) -> None:
        _check_int("n", self.n, 1, ">= 1")
        _check_float("temperature", self.temperature, self.temperature >= 0.0, ">= 0")
        _check_float("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an int >= 1, got {self.top_k!r}")
        _check_float("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value, -2.0 <= value <= 2.0, "in [-2, 2]")
        _check_float(
            "repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0.0, "> 0"
        )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, ">= 1 (or None for up to max_model_len)")
        _check_int("min_tokens", self.min_tokens, 0, ">= 0 and <= max_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be >= 0 and <= max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, f"in [0, {MAX_LOGPROBS}] or None")
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        if self.seed is not None and not (
            _is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise ValueError(
                f"seed must be None or an int in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed!r}"
            )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; set detokenize=True or drop stop")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax (the one place this is decided)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def token_id_fields(self) -> dict[str, tuple[int, ...]]:
        """The token ids each field names, which the client checks against the vocabulary."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": tuple(t for t, _ in self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids or (),
        }

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop must not contain empty strings")
    return tuple(items)


def _normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """A dict or (token id, bias) pairs -> sorted pairs; biases in [-100, 100] as OpenAI's."""
    if bias is None:
        return ()
    if isinstance(bias, dict):
        pairs = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in bias
    ):
        pairs = [(p[0], p[1]) for p in bias]
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    out: dict[int, float] = {}
    for tid, value in pairs:
        if not (_is_int(tid) and tid >= 0):
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid!r}")
        number = _number("logit_bias values", value)
        if not -100.0 <= number <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
        out[int(tid)] = number
    return tuple(sorted(out.items()))


def _normalize_allowed_token_ids(ids: object) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"allowed_token_ids must be a list of ints >= 0, got {ids!r}")
    if not ids:
        raise ValueError("allowed_token_ids must not be empty: give at least one token id")
    return tuple(sorted(set(ids)))


def _normalize_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return tuple(ids)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search request (vLLM's names, plus HF transformers' `early_stopping`); validated
    like SamplingParams.

    A hypothesis scores cum_logprob / generated_len ** length_penalty. early_stopping says when
    the search for a prompt ends before max_tokens, as in HF's `generate`:
      True: once beam_width hypotheses are finished;
      False (HF's default): once beam_width are finished and the best live beam, scored at its
        current length, cannot beat the worst of them;
      "never": once no live beam can beat the worst finished one at any length up to
        max_tokens (canonical beam search).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, ">= 1")
        _check_int("max_tokens", self.max_tokens, 1, ">= 1")
        temperature = _number("temperature", self.temperature)
        _check_float("temperature", temperature, temperature >= 0.0, ">= 0")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "length_penalty", _number("length_penalty", self.length_penalty))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
