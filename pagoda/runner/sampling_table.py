"""The sampling table: what the runner keeps of each request's SamplingParams and what it does
with it. It drives the persistent batch's per-slot columns (runner/input_batch.py) and the
sampler's stages (runner/sampler.py).

- COLUMNS: one scalar per request, with its encoding (decided here, once) and its neutral value,
  which is the one way to say "off": a stage whose column is neutral in every sampling row is
  skipped, and its tensor is never built.
- EDITS: changes a request's params make to its logits rows before penalties and sampling
  (logit bias, min_tokens, allowed_token_ids), each applied to the rows that ask for it in the
  sampler's float32 copy of the logits. Each has a bool column `wants_<name>` (the params ask for
  it at all); `active` then says, each step, whether a row applies it now.

A new sampling parameter touches three files: its field in SamplingParams (with its checks;
token ids it names go in `token_id_fields`, which the client checks against the vocabulary),
its field in the server's protocol, and its entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.runner.device import to_device
from pagoda.sampling_params import SamplingParams

Scalar = float | int | bool


@dataclass(frozen=True)
class Column:
    """A per-request scalar: `encode(params, vocab_size)` is its value, `neutral` means off.
    `stage`: a sampler stage reads it on the device (as `torch_dtype`); else it stays on the host."""

    name: str
    dtype: type[np.generic]
    encode: Callable[[SamplingParams, int], Scalar]
    neutral: Scalar
    stage: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, np.dtype(self.dtype).name)  # float32, int64
        return dtype


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return p.top_k if p.top_k < vocab_size else 0  # k >= vocab keeps every token: off


def _penalized(p: SamplingParams, vocab_size: int) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


COLUMNS: tuple[Column, ...] = (
    Column("greedy", np.bool_, lambda p, v: p.greedy, False),
    # greedy rows take the argmax: their temperature, top_k, top_p and min_p are neutral
    Column(
        "temperature", np.float32, lambda p, v: 1.0 if p.greedy else p.temperature, 1.0, stage=True
    ),
    Column("top_k", np.int64, _top_k, 0, stage=True),
    Column("top_p", np.float32, lambda p, v: p.top_p, 1.0, stage=True),
    Column("min_p", np.float32, lambda p, v: p.min_p, 0.0, stage=True),
    Column("presence_penalty", np.float32, lambda p, v: p.presence_penalty, 0.0, stage=True),
    Column("frequency_penalty", np.float32, lambda p, v: p.frequency_penalty, 0.0, stage=True),
    Column("repetition_penalty", np.float32, lambda p, v: p.repetition_penalty, 1.0, stage=True),
    # rows with any penalty keep output counts and prompt tokens on the device
    Column("penalized", np.bool_, _penalized, False),
    Column("num_logprobs", np.int64, lambda p, v: -1 if p.logprobs is None else p.logprobs, -1),
)


@dataclass(frozen=True)
class EditRows:
    """The rows of one step that apply an edit: their indices among the logits rows, their
    params, how many tokens each has sampled before this step, and the model's EOS ids."""

    index: list[int]
    params: list[SamplingParams]
    num_outputs: list[int]
    eos_token_ids: Sequence[int]


@dataclass(frozen=True)
class Edit:
    """A change the params make to a row's logits (in place, on float32 logits)."""

    name: str
    wants: Callable[[SamplingParams], bool]  # whether the params ask for it at all
    active: Callable[[SamplingParams, int], bool]  # ... and in a step after this many outputs
    apply: Callable[[torch.Tensor, EditRows], None]

    @property
    def column(self) -> str:
        return f"wants_{self.name}"


def _index(logits: torch.Tensor, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, ...]:
    return to_device(rows, torch.int64, logits.device), to_device(cols, torch.int64, logits.device)


def add_logit_bias_(logits: torch.Tensor, rows: EditRows) -> None:
    """Each row's (token id, bias) pairs added to its logits."""
    pairs = [(r, t, b) for r, p in zip(rows.index, rows.params) for t, b in p.logit_bias]
    index = _index(logits, [r for r, _, _ in pairs], [t for _, t, _ in pairs])
    bias = to_device([b for _, _, b in pairs], logits.dtype, logits.device)
    logits.index_put_(index, bias, accumulate=True)


def ban_tokens_(logits: torch.Tensor, banned: Sequence[tuple[int, Sequence[int]]]) -> None:
    """(row, token ids) pairs: those tokens' logits become -inf."""
    pairs = [(r, t) for r, ids in banned for t in ids]
    index = _index(logits, [r for r, _ in pairs], [t for _, t in pairs])
    logits.index_put_(index, logits.new_full((), float("-inf")))


def _ban_stops(logits: torch.Tensor, rows: EditRows) -> None:
    """min_tokens: EOS and the stop token ids are banned until the row has that many outputs."""
    eos = list(rows.eos_token_ids)
    ban_tokens_(logits, [(r, [*eos, *p.stop_token_ids]) for r, p in zip(rows.index, rows.params)])


def _allow_only(logits: torch.Tensor, rows: EditRows) -> None:
    """allowed_token_ids: every other token's logit becomes -inf."""
    pairs = [(i, t) for i, p in enumerate(rows.params) for t in p.allowed_token_ids or ()]
    drop = torch.ones(len(rows.index), logits.shape[1], dtype=torch.bool, device=logits.device)
    drop.index_put_(
        _index(logits, [i for i, _ in pairs], [t for _, t in pairs]), drop.new_zeros(())
    )
    index = to_device(rows.index, torch.int64, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(drop, float("-inf")))


EDITS: tuple[Edit, ...] = (
    Edit(
        "allowed_token_ids",
        lambda p: p.allowed_token_ids is not None,
        lambda p, n: True,
        _allow_only,
    ),
    Edit("logit_bias", lambda p: bool(p.logit_bias), lambda p, n: True, add_logit_bias_),
    Edit("min_tokens", lambda p: p.min_tokens > 0, lambda p, n: n < p.min_tokens, _ban_stops),
)

COLUMN_DTYPES: dict[str, type[np.generic]] = {
    **{c.name: c.dtype for c in COLUMNS},
    **{e.column: np.bool_ for e in EDITS},
}


def encode_row(params: SamplingParams, vocab_size: int) -> dict[str, Scalar]:
    """One request's value in every column."""
    values = {c.name: c.encode(params, vocab_size) for c in COLUMNS}
    values.update({e.column: e.wants(params) for e in EDITS})
    return values


@dataclass(frozen=True)
class StepEdit:
    """An edit bound to the rows that apply it in one step."""

    edit: Edit
    rows: EditRows

    def __call__(self, logits: torch.Tensor) -> None:
        self.edit.apply(logits, self.rows)


def step_edits(
    edits: Sequence[tuple[Edit, list[int]]],
    params: Sequence[SamplingParams],
    num_outputs: Sequence[int],
    eos_token_ids: Sequence[int],
) -> list[StepEdit]:
    """The edits that some row applies this step, bound to their rows. `edits`: each edit some
    row wants, with the rows that want it (their `wants_` column); row i has `params[i]` and
    `num_outputs[i]` outputs before this step."""
    bound: list[StepEdit] = []
    for edit, wanting in edits:
        index = [i for i in wanting if edit.active(params[i], num_outputs[i])]
        if index:
            rows = EditRows(
                index, [params[i] for i in index], [num_outputs[i] for i in index], eos_token_ids
            )
            bound.append(StepEdit(edit, rows))
    return bound
