"""Speculative decoding's methods, one registered entry each (METHODS, by
SpeculativeConfig.method): how to build the method's proposer, whether it runs a draft model
beside the target (loading/draft.py loads it; runner/draft_step.py runs its forward), and what
the engine sizes for it: the KV positions it writes past a step's tokens in the target's block
table, and the draft's own KV bytes per token. A new method is its proposer module and an entry
here (its name also in speculative_config.SPEC_METHODS, which validates configs without
importing this).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagoda.loading.draft import DraftModel
from pagoda.spec_decode.draft_model import DraftModelProposer, DraftStepFn
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    """What every method's proposer does, for the runner (runner/speculative.py)."""

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """Drafts for (request id, token ids, most drafts allowed) triples, in order."""
        ...

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None: ...

    def remove(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ProposerContext:
    """What the runner hands a method's builder: the draft model's forward (a method that runs
    one), the most tokens one of its passes takes, whether it shares the target's KV cache,
    and the config's max_catch_up_ratio resolved for the runner's device."""

    draft_step: DraftStepFn | None = None
    max_step_tokens: int = 2048
    shares_target_kv: bool = False
    max_catch_up_ratio: float | None = None


@dataclass(frozen=True)
class SpecMethod:
    name: str
    uses_draft_model: bool
    build: Callable[[SpeculativeConfig, ProposerContext], Proposer]

    def kv_lookahead(self, config: SpeculativeConfig) -> int:
        """KV positions the proposer writes past a step's tokens in the target's block table:
        a draft model's k proposals (draft_model.py); none for drafts from the tokens alone."""
        return config.num_speculative_tokens if self.uses_draft_model else 0

    def draft_kv_bytes_per_token(self, draft: DraftModel | None, kv_quant: str | None) -> int:
        """Bytes per token of the draft's own KV cache, which has the target's block count
        (runner/draft_step.py); 0 without one, or where it shares the target's."""
        if draft is None or draft.shares_target_kv:
            return 0
        return draft.config.kv_bytes_per_token(kv_quant)

    def waits_for_first_token(self, shares_target_kv: bool) -> bool:
        """A draft with a cache of its own catches up on the prompt at its first proposal,
        which waits for the step after the first token: the draft's prefill is not in TTFT."""
        return self.uses_draft_model and not shares_target_kv


def draft_kv_bytes_per_token(
    config: SpeculativeConfig | None, draft: DraftModel | None, kv_quant: str | None
) -> int:
    """Bytes per token of the draft model's own KV cache under `config` (0 without
    speculation, a draft model, or a cache of its own): what a rank holds beside the target's."""
    if config is None:
        return 0
    return spec_method(config).draft_kv_bytes_per_token(draft, kv_quant)


def _ngram(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    return NgramProposer.from_config(config)


def _draft_model(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    assert context.draft_step is not None, "method draft_model needs the draft's step"
    return DraftModelProposer(
        config,
        context.draft_step,
        context.max_step_tokens,
        context.shares_target_kv,
        context.max_catch_up_ratio,
    )


METHODS: dict[str, SpecMethod] = {
    "ngram": SpecMethod("ngram", uses_draft_model=False, build=_ngram),
    "draft_model": SpecMethod("draft_model", uses_draft_model=True, build=_draft_model),
}


def spec_method(config: SpeculativeConfig) -> SpecMethod:
    return METHODS[config.method]


def kv_lookahead(config: SpeculativeConfig | None) -> int:
    """KV positions past a step's tokens the scheduler reserves for the config's method (0
    without speculative decoding)."""
    return 0 if config is None else spec_method(config).kv_lookahead(config)
