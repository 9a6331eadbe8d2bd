"""How one step picks its tokens: the Sampler over per-row sampling tensors.

The Sampler works on R rows (one per request that samples this step) in this order:

    raw logits -> logprobs (always from the raw logits, like vLLM's default)
    raw logits -> the params' edits (runner/sampling_table.py: allowed_token_ids, logit bias,
        min_tokens' banned stops) -> penalties, then
        greedy rows: argmax
        random rows: temperature -> top_k -> top_p -> min_p -> exponential race

The exponential race picks argmax(p_i / E_i) with E_i ~ Exponential(1), which draws i with
probability p_i. A seeded row draws its E from its own generator, so its tokens do not depend on
the batch it shares a step with nor on its row position. On CPU with pagoda's kernels, the rows
without a seed race in one pass over their logits (race.cpp's race_sample: exp, a counter-based
uniform and its log per element, no (R, vocab) tensors in between), its noise keyed by one draw
of torch's default generator per step, so torch.manual_seed still reproduces a run.

For a large vocabulary a step's sampling costs its passes over (R, vocab) tensors
(tests/unit/test_sampler_passes.py counts them), so a stage runs only when some row uses it
(a penalty only when some row's is not neutral), the raw logits may come in the model's 16-bit
dtype (each path widens them to float32 in its first pass: widening is exact, so the tokens are
those of float32 logits), and once the sampler holds its own float32 copy the later stages
write into it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagoda.runner.input_batch import BatchColumns, InputBatch, SamplingRows
from pagoda.runner.sampling_table import step_edits


class LogprobsTensors(NamedTuple):
    """Logprobs for N positions: column 0 is the chosen token, columns 1..k the top-k."""

    token_ids: torch.Tensor  # (N, k + 1) int64
    logprobs: torch.Tensor  # (N, k + 1) float32
    ranks: torch.Tensor  # (N,) int64, 1-based rank of the chosen token

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (R,) int64
    logprobs: LogprobsTensors | None


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for R rows; tensors live on the logits' device.

    A tensor is None when no row needs it (its column is neutral in every row: the sampling
    table's one encoding of "off"), which is what the fast paths test: a batch that is all
    greedy, without penalties, edits or logprobs, costs one argmax.
    """

    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # (R,) bool when greedy and random rows are mixed
    temperature: torch.Tensor | None  # (R,) float32, 1.0 where off (greedy rows too)
    top_k: torch.Tensor | None  # (R,) int64, 0 where off
    top_p: torch.Tensor | None  # (R,) float32, 1.0 where off
    min_p: torch.Tensor | None  # (R,) float32, 0.0 where off
    # (R,) float32 each; None when no row has that penalty (0, 0 and 1 are neutral)
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    generators: dict[int, torch.Generator]  # row -> generator, random seeded rows only
    max_num_logprobs: int | None
    # the step's logits edits (sampling_table.EDITS bound to their rows), in table order
    edits: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    max_top_k: int = 0  # the largest top_k (computed on the host: no device sync)
    # The persistent batch's penalty state: (R, vocab) output token counts (float32) and prompt
    # tokens seen (bool; repetition penalties only), on the device; None without penalties.
    output_counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return (
            self.repetition_penalties is None
            and self.frequency_penalties is None
            and self.presence_penalties is None
        )

    @classmethod
    def from_batch(
        cls,
        columns: BatchColumns,
        batch: InputBatch,
        rows: SamplingRows,
        generators: dict[int, torch.Generator],
        eos_token_ids: Sequence[int],
    ) -> SamplingMetadata:
        """The step's metadata: the rows' columns (built once while the rows stay the same),
        plus what changes every step: the edits' rows, penalty counts, generators."""
        edits: list[Callable[[torch.Tensor], None]] = []
        if columns.edits:
            params = [r.params for r in rows.leaders]
            edits.extend(step_edits(columns.edits, params, rows.num_outputs, eos_token_ids))
        output_counts = prompt_seen = None
        tensors = columns.tensors
        if columns.slots_t is not None:
            assert batch.output_counts is not None and batch.prompt_seen is not None
            output_counts = batch.output_counts.index_select(0, columns.slots_t)
            if columns.own is not None:  # siblings sampling their first token count nothing
                output_counts *= columns.own.unsqueeze(1)
            if "repetition_penalty" in tensors:
                prompt_seen = batch.prompt_seen.index_select(0, columns.slots_t)
        return cls(
            all_greedy=columns.all_greedy,
            all_random=columns.all_random,
            is_greedy=tensors.get("greedy"),
            temperature=tensors.get("temperature"),
            top_k=tensors.get("top_k"),
            top_p=tensors.get("top_p"),
            min_p=tensors.get("min_p"),
            presence_penalties=tensors.get("presence_penalty"),
            frequency_penalties=tensors.get("frequency_penalty"),
            repetition_penalties=tensors.get("repetition_penalty"),
            generators={row: g for row, g in generators.items() if not columns.greedy[row]},
            max_num_logprobs=columns.max_num_logprobs,
            edits=edits,
            max_top_k=columns.max_top_k,
            output_counts=output_counts,
            prompt_seen=prompt_seen,
        )


def apply_penalty_counts(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    out_counts: torch.Tensor,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI/vLLM) penalties (out of place;
    float32) over (R, vocab) prompt_seen (bool; read by repetition penalties only) and
    out_counts (float32). A penalty given as None is neutral in every row (presence and
    frequency 0, repetition 1), so its pass is skipped: it would leave every logit as it is.

    repetition: a token seen in the prompt or the output has a positive logit divided by the
        penalty and a negative one multiplied by it.
    frequency, presence: logit -= frequency * count_in_output + presence * (count_in_output > 0).
    """
    in_output = out_counts > 0
    if repetition_penalties is not None:
        assert prompt_seen is not None
        rep = repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(prompt_seen | in_output, penalized, logits)
    if frequency_penalties is not None:
        logits = logits - frequency_penalties.unsqueeze(1) * out_counts
    if presence_penalties is not None:
        # A bool factor is 0.0 or 1.0 inside the product: no float32 copy of in_output.
        logits = logits - presence_penalties.unsqueeze(1) * in_output
    return logits.float()


def apply_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None, inplace: bool = False
) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept); k = 0 keeps all (off, the
    sampling table's encoding; an on k is below the vocabulary size).
    max_k: the largest k, when the caller knows it (reading it off top_k syncs).
    inplace: write into `logits` (here and in apply_top_p, apply_min_p)."""
    enabled = top_k > 0
    if max_k is None:
        max_k = int(top_k.max())
    top_values = logits.topk(max_k, dim=-1).values  # (R, max_k), descending
    kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1).unsqueeze(1))
    kth = torch.where(enabled.unsqueeze(1), kth, float("-inf"))
    return _masked(logits, logits < kth, inplace)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    A token is kept when the probability of the tokens ranked before it is < top_p, so the
    most likely token always survives; rows with top_p = 1 keep everything.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # A row with top_p = 1 compares with +inf, which no mass reaches: it drops nothing.
    limit = torch.where(top_p < 1.0, top_p, math.inf).unsqueeze(1)
    drop_sorted = mass_before >= limit
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return _masked(logits, drop, inplace)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return _masked(logits, probs < threshold, inplace)


def _masked(logits: torch.Tensor, drop: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        return logits.masked_fill_(drop, float("-inf"))
    return logits.masked_fill(drop, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(probs / E), E ~ Exponential(1) per entry; (R,) int64.

    E is drawn as -log(U), U ~ Uniform[0, 1) (on CPU several times faster than exponential_).
    A row in `generators` draws its noise from its own generator only; other rows share the
    default generator.

    probs / log(U) = -(probs / E) exactly (division rounds symmetrically), so its argmin is the
    race's winner, ties included (both take the first index), without a pass that negates.
    U == 0 gives log(U) == -inf: that entry's ratio is -0.0, it cannot win.
    """
    uniform = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    return exponential_race(probs, uniform)


def _race_kernel(logits: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """race.cpp's race_sample where the logits are on the CPU and pagoda's kernels are on."""
    if logits.device.type != "cpu":
        return None
    from pagoda.kernels.cpu import kernels

    ops = kernels()
    return None if ops is None else ops.race_sample


def exponential_race(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """random_sample's race over (N, V) nonnegative weights (need not sum to 1) with its noise
    U ~ Uniform[0, 1) already drawn: argmax(w / E), E = -log(U); (N,) int64. `uniform` is
    overwritten."""
    return torch.div(weights, uniform.log_(), out=uniform).argmin(dim=-1)


def compute_logprobs_for(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprob and 1-based rank of `token_ids` (N,), on the logits' device, under `logits`
    (N, vocab), plus the top-k."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    ids = token_ids.unsqueeze(1)
    if num_logprobs > 0:
        top = logprobs.topk(num_logprobs, dim=-1)
        chosen = torch.cat([chosen, top.values], dim=1)
        ids = torch.cat([ids, top.indices], dim=1)
    return LogprobsTensors(ids, chosen, ranks)


class Sampler:
    """Picks one token per row from (R, vocab) logits, float32 or the model's 16-bit dtype (as
    if widened to float32 first); see the module docstring. `logits` is never written."""

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, greedy: torch.Tensor | None = None
    ) -> SamplerOutput:
        """greedy: (R,) int64 argmax of `logits` when the caller has it (a decode graph computes
        it), used unless logit bias, banned tokens or penalties change the logits."""
        processed, own = self.process(logits, meta)
        sampled = self.sample(processed, meta, own, greedy if processed is logits else None)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs_for(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, bool]:
        """The params' edits and penalties -> (logits, whether they are a float32 tensor of the
        sampler's own, which later stages may write into; else `logits` itself)."""
        own = False
        if meta.edits:
            logits, own = logits.to(torch.float32, copy=True), True
            for edit in meta.edits:
                edit(logits)
        if meta.no_penalties:
            return logits, own
        penalties = (meta.presence_penalties, meta.frequency_penalties, meta.repetition_penalties)
        assert meta.output_counts is not None, "penalties read the batch's counts"
        logits = apply_penalty_counts(logits, meta.prompt_seen, meta.output_counts, *penalties)
        return logits, True

    @staticmethod
    def sample(
        logits: torch.Tensor,
        meta: SamplingMetadata,
        own: bool = False,
        greedy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy and random rows of already penalized logits -> (R,) int64 token ids. own:
        `logits` is the sampler's float32 copy, which the random rows' stages write into.
        greedy: logits.argmax(dim=-1), if already computed."""
        if meta.all_random:
            greedy = None
        elif greedy is None:
            greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        sampled = Sampler.random_rows(logits, meta, own)
        if greedy is None:
            return sampled
        assert meta.is_greedy is not None
        return torch.where(meta.is_greedy, greedy, sampled)

    @staticmethod
    def random_rows(
        logits: torch.Tensor, meta: SamplingMetadata, own: bool = False
    ) -> torch.Tensor:
        """Every row's draw from its final distribution, (R,) int64 (what greedy rows draw is
        not used). On CPU with pagoda's kernels, the rows without a generator of their own run
        race.cpp's race on the logits in one pass, its noise from one draw of torch's default
        generator (no (R, vocab) probabilities, noise or ratios); seeded rows draw as
        random_sample does, so their tokens are those of the torch path."""
        race = _race_kernel(logits)
        if race is None or len(meta.generators) == logits.shape[0]:
            return random_sample(Sampler.probabilities(logits, meta, own), meta.generators)
        seed = torch.empty((), dtype=torch.int64).random_()  # read by the kernel
        inv_temperature = None
        filtered = meta.top_k is not None or meta.top_p is not None or meta.min_p is not None
        if filtered or meta.generators:
            logits = Sampler.filtered_logits(logits, meta, own)
        elif meta.temperature is not None:
            inv_temperature = meta.temperature.reciprocal()
        rows = logits if logits.dtype == torch.float32 else logits.float()
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        sampled = race(rows, inv_temperature, seed, 2)  # isa_limit 2: the CPU's best path
        for row, generator in meta.generators.items():  # slices: no host index to upload
            probs = logits[row : row + 1].softmax(dim=-1, dtype=torch.float32)
            sampled[row] = random_sample(probs, {0: generator})[0]
        return sampled

    @staticmethod
    def probabilities(
        logits: torch.Tensor, meta: SamplingMetadata, own: bool = False
    ) -> torch.Tensor:
        """The random rows' final distributions (R, vocab) float32 from already penalized
        logits: temperature -> top_k -> top_p -> min_p -> softmax (greedy rows: the softmax of
        their logits, which nothing reads). own: as for sample."""
        return Sampler.filtered_logits(logits, meta, own).softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def filtered_logits(
        logits: torch.Tensor, meta: SamplingMetadata, own: bool = False
    ) -> torch.Tensor:
        """probabilities' logits before its softmax: temperature -> top_k -> top_p -> min_p
        (dropped tokens at -inf); `logits` itself where no stage applies. own: as for sample."""
        temperature = meta.temperature
        if temperature is not None:  # 1.0 in greedy rows, whose argmax the caller takes
            divisor = temperature.unsqueeze(1)
            logits = logits.div_(divisor) if own else logits / divisor
        elif not own and (
            meta.top_k is not None or meta.top_p is not None or meta.min_p is not None
        ):
            logits = logits.to(torch.float32, copy=True)  # the stages below write into it
        if meta.top_k is not None:
            apply_top_k(logits, meta.top_k, meta.max_top_k or None, inplace=True)
        if meta.top_p is not None:
            apply_top_p(logits, meta.top_p, inplace=True)
        if meta.min_p is not None:
            apply_min_p(logits, meta.min_p, inplace=True)
        return logits

    compute_logprobs_for = staticmethod(compute_logprobs_for)
