"""`--speculative-config` (vLLM's flag and field names): n-gram prompt lookup or a draft model,
the target's own checkpoint kept quantized included (runner/speculative.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.model_config import QUANTIZATION_METHODS

SPEC_METHODS = ("ngram", "draft_model")
SELF_DRAFT = "self"  # `model` value: the target's own checkpoint, kept quantized as the draft
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both prompt_lookup_min and prompt_lookup_max
DEFAULT_MAX_BACKOFF_STEPS = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
AUTO = "auto"
CPU_MAX_CATCH_UP_RATIO = 2.0  # max_catch_up_ratio "auto" on CPU (measured there)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: which proposer, and k, the draft tokens per step.
    `--speculative-config` / `LLM(speculative_config=...)`, vLLM's field names; the scheduler
    may read it. Accepted as a dict or a JSON object string:

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
        {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}
        {"model": "self", "quantization": "gguf", "num_speculative_tokens": 4}

    As in vLLM: `method` defaults to "draft_model" when a `model` is given; for "ngram", a
    missing prompt_lookup_min or prompt_lookup_max follows the other, and both default to 5
    when neither is given. Pagoda's own field `max_backoff_steps` (not vLLM's) caps the
    per-request backoff of the proposer: after two verifications in a row that reject all its
    drafts a request proposes nothing for 1 step, after each further one for 3, 7, ... steps
    (never more than max_backoff_steps), until a draft is accepted again; 0 turns backoff off.

    A request with k draft tokens is scheduled for k + 1 tokens; verification keeps the accepted
    drafts plus one token of the target's (so 1 to k + 1 tokens per step).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    # ngram: the suffix n-gram lengths tried, longest first; None only before __post_init__
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: the draft's HF folder or GGUF file, or "self" (the target's checkpoint)
    model: str | None = None
    # draft_model: the draft's weight scheme (QUANTIZATION_METHODS); None: the
    # draft checkpoint's own
    quantization: str | None = None
    max_backoff_steps: int = DEFAULT_MAX_BACKOFF_STEPS
    # vLLM's (v0) speculative_disable_by_batch_size: no proposals while more requests than this
    # run. Verifying drafts pays where a step is memory-bound (small batches); a large batch's
    # step is compute-bound, so its drafts cost about what they save, and the steps they join
    # lose the compiled decode path (measured W-CPU, benchmarks/README.md). None: never.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # Pagoda's own (draft_model with a cache of its own): a request's draft catches up (feeds
    # the tokens its cache lacks, the whole context the first time) only while those are at
    # most this many times the tokens the request may still produce (max_tokens,
    # max_model_len); None: always; "auto": CPU_MAX_CATCH_UP_RATIO on CPU, always elsewhere
    # (as vLLM, whose draft sees every token; on a GPU a draft's prefill costs far less of a
    # decode step, and it was not measured there). A request that ran in a batch above
    # disable_by_batch_size joins speculation when the batch shrinks, with its whole context
    # to feed: on two Zen 5 cores the 0.5B drafting for the 1.5B feeds ~0.9 ms a token and its
    # drafts save 1.5-3.7 ms per token produced (1.07-1.19x), so above 1.7-4.1 tokens fed per
    # token left the catch-up costs more than its drafts can save (W-CPU's tail: 8 requests,
    # 2,860 tokens fed, 2.6 s, for 2-40 tokens left each; benchmarks/README.md, issue 43
    # fourth part).
    max_catch_up_ratio: float | str | None = AUTO

    def __post_init__(self) -> None:
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}; "
                f"got {self.method!r}"
            )
        if (
            isinstance(self.max_backoff_steps, bool)
            or not isinstance(self.max_backoff_steps, int)
            or self.max_backoff_steps < 0
        ):
            raise ValueError(
                "speculative_config: max_backoff_steps must be an int >= 0 (0: never back "
                f"off), got {self.max_backoff_steps!r}"
            )
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        self._check_catch_up_ratio()
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_catch_up_ratio(self) -> None:
        ratio = self.max_catch_up_ratio
        if ratio is None or ratio == AUTO:
            return
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
            raise ValueError(
                f"speculative_config: max_catch_up_ratio must be a number > 0, {AUTO!r} or "
                f"null (always catch up), got {ratio!r}"
            )
        object.__setattr__(self, "max_catch_up_ratio", float(ratio))

    def catch_up_ratio(self, device_type: str) -> float | None:
        """max_catch_up_ratio on a device of this type ("cpu", "cuda"), "auto" resolved."""
        if self.max_catch_up_ratio == AUTO:
            return CPU_MAX_CATCH_UP_RATIO if device_type == "cpu" else None
        assert not isinstance(self.max_catch_up_ratio, str)
        return self.max_catch_up_ratio

    def _check_ngram(self) -> None:
        for name in ("model", "quantization"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config: {name} is for method 'draft_model', not 'ngram'"
                )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None:
            low = _positive_int("prompt_lookup_min", low)
        if high is not None:
            high = _positive_int("prompt_lookup_max", high)
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        assert low is not None and high is not None
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= "
                f"prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_draft_model(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config: {name} is for method 'ngram', not 'draft_model'"
                )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config: method 'draft_model' needs a model (a draft checkpoint's "
                f"path, or {SELF_DRAFT!r} with a quantization); got {self.model!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                "speculative_config: quantization must be one of "
                f"{', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}"
            )
        if self.is_self_draft and self.quantization in (None, "none"):
            raise ValueError(
                f"speculative_config: model {SELF_DRAFT!r} drafts with the target's own "
                "checkpoint, so it needs a quantization for the draft (e.g. gguf or int4)"
            )

    @property
    def num_lookahead_slots(self) -> int:
        """The most tokens one request asks for in a step beyond its first: k."""
        return self.num_speculative_tokens

    @property
    def is_self_draft(self) -> bool:
        """A draft_model whose weights are the target's checkpoint, quantized."""
        return self.method == "draft_model" and self.model == SELF_DRAFT

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's field names; unknown fields and bad values raise ValueError."""
        if not isinstance(values, Mapping):
            raise ValueError(
                f"speculative_config must be a JSON object or a dict, got {type(values).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        kwargs = dict(values)
        if kwargs.get("method") is None:
            if kwargs.get("model") is None:
                raise ValueError(
                    "speculative_config: set method to 'ngram', or give a draft model "
                    "(method 'draft_model')"
                )
            kwargs["method"] = "draft_model"
        return cls(**kwargs)

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """The config from a JSON object string (the CLI flag), a dict (the Python API), a config
        (returned as is), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, str):
            return cls.from_dict(value)
        try:
            values = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, by vLLM's names (for logs and benchmark JSON)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
