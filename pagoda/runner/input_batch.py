"""The runner's persistent batch: per-request rows kept between steps and updated from the
scheduler's deltas (scheduling/messages.py, SchedulerOutput).

A request's prompt, sampling params and block table arrive once, in NewRequestData; later steps
carry only block-table changes, and finished or preempted ids (a preempted request comes back
whole). Each row owns a slot in column arrays of its sampling params and a row of the block
table, so a step's sampling tensors and block tables are gathers, not walks over SamplingParams
objects and lists (and the sampling tensors are gathered again only when the rows change). Rows with penalties
keep, on the device, the counts of their output tokens and the set of their prompt tokens: a
sampled token is counted on the device in the step that samples it (so a step scheduled before
the last one's results reach the host already sees it), and sampled tokens are appended to the
rows' host token lists when they reach the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.runner.device import numpy_to_device, to_device
from pagoda.runner.sampling_table import COLUMN_DTYPES, COLUMNS, EDITS, Edit, encode_row
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass
class RequestRow:
    """The runner's copy of one request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # known outputs; a sample is appended when it reaches the host
    params: SamplingParams
    sample_index: int
    slot: int  # its index in InputBatch's column arrays and block table
    batch: InputBatch = field(repr=False, compare=False)

    @property
    def block_ids(self) -> list[int]:
        return self.batch.block_table[self.slot, : self.batch.num_blocks[self.slot]].tolist()


class InputBatch:
    def __init__(
        self,
        vocab_size: int,
        capacity: int = 64,
        device: torch.device | str = "cpu",
        max_blocks_per_seq: int = 16,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.rows: dict[str, RequestRow] = {}
        # Each slot's block ids in row slot, columns [0, num_blocks[slot]) (host memory; the
        # step's rows are gathered from it). Widens if a table outgrows it.
        self.block_table = np.zeros((capacity, max_blocks_per_seq), np.int64)
        self.num_blocks = np.zeros(capacity, np.int64)
        # (capacity, vocab) per slot, allocated when the first row with penalties arrives:
        # output token counts (float32) and prompt tokens seen (bool). Valid for rows with
        # penalties only (others' slots hold zeros or a former row's values, which zero
        # penalties ignore).
        self.output_counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self.version = 0  # changes whenever a row is added or removed
        self.columns: dict[str, np.ndarray] = {
            name: np.zeros(capacity, dtype) for name, dtype in COLUMN_DTYPES.items()
        }
        self._free_slots = list(range(capacity - 1, -1, -1))

    # ---- deltas -------------------------------------------------------------------------
    def apply(self, out: SchedulerOutput) -> None:
        """Bring the rows up to date with one step's SchedulerOutput (its documented order)."""
        for rid in out.finished_request_ids:
            self._remove(rid)
        for rid in out.preempted_request_ids:
            self._remove(rid)
        for new in out.new_requests:
            self._add(new)
        for change in out.cached_requests:
            self._write_blocks(self.rows[change.request_id].slot, change.start, change.block_ids)

    def record_sampled(self, rows: list[RequestRow | None], tokens: list[int]) -> None:
        """Append each sampled token to the row that sampled it, if that row is still held (a
        request finished or preempted meanwhile is gone; an id reused since is another row)."""
        for row, token in zip(rows, tokens):
            if row is not None and self.rows.get(row.request_id) is row:
                row.output_token_ids.append(token)

    def _add(self, new: NewRequestData) -> None:
        assert new.request_id not in self.rows, f"{new.request_id} is already in the batch"
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self.version += 1
        self.rows[new.request_id] = RequestRow(
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            params=new.sampling_params,
            sample_index=new.sample_index,
            slot=slot,
            batch=self,
        )
        self._write_blocks(slot, 0, new.block_ids)
        self._write_columns(slot, new.sampling_params)
        if self.columns["penalized"][slot]:
            self._init_penalty_state(slot, new.prompt_token_ids, new.output_token_ids)

    def _remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.version += 1
            self._free_slots.append(row.slot)

    def _write_blocks(self, slot: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            wider = np.zeros(
                (len(self.block_table), max(end, 2 * self.block_table.shape[1])), np.int64
            )
            wider[:, : self.block_table.shape[1]] = self.block_table
            self.block_table = wider
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def _grow(self) -> None:
        old = len(self.columns["temperature"])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        for name, column in self.columns.items():
            grown = np.zeros(2 * old, column.dtype)
            grown[:old] = column
            self.columns[name] = grown
        if self.output_counts is not None and self.prompt_seen is not None:
            self.output_counts = torch.cat(
                [self.output_counts, torch.zeros_like(self.output_counts)]
            )
            self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
        self._free_slots.extend(range(2 * old - 1, old - 1, -1))

    def _init_penalty_state(self, slot: int, prompt: list[int], outputs: list[int]) -> None:
        if self.output_counts is None or self.prompt_seen is None:
            shape = (len(self.columns["temperature"]), self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        counts, seen = self.output_counts[slot], self.prompt_seen[slot]
        counts.zero_()
        seen.zero_()
        if outputs:
            ids = to_device(outputs, torch.int64, self.device)
            counts.index_put_((ids,), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
        seen[to_device(prompt, torch.int64, self.device)] = True

    def count_sampled(self, rows: SamplingRows, sampled: torch.Tensor) -> None:
        """Count each row's sampled token (sampled: (R,) on the device) in its output counts,
        for rows with penalties, in stream order: no host sync."""
        if self.output_counts is None:
            return
        which = [
            (i, row.slot)
            for i, row in enumerate(rows.own_rows)
            if row is not None and self.columns["penalized"][row.slot]
        ]
        if not which:
            return
        index = to_device([i for i, _ in which], torch.int64, self.device)
        slots = to_device([slot for _, slot in which], torch.int64, self.device)
        ones = torch.ones(len(which), dtype=torch.float32, device=self.device)
        self.output_counts.index_put_((slots, sampled[index]), ones, accumulate=True)

    def _write_columns(self, slot: int, p: SamplingParams) -> None:
        for name, value in encode_row(p, self.vocab_size).items():
            self.columns[name][slot] = value

    # ---- reading ------------------------------------------------------------------------
    def block_tables(
        self, request_ids: list[str], seq_lens: list[int], block_size: int
    ) -> np.ndarray:
        """The block tables of these requests, a row each, which must cover seq_lens (columns
        past a row's blocks hold stale ids: no reader looks past a sequence's length)."""
        slots = np.fromiter((self.rows[r].slot for r in request_ids), np.int64, len(request_ids))
        covered = self.num_blocks[slots] * block_size
        assert (covered >= np.asarray(seq_lens, np.int64)).all(), "a block table is too short"
        return self.block_table[slots]

    def gather(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Column `name` at `slots`, in that order (a fresh array)."""
        return self.columns[name][slots]

    def penalty_state(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts, prompt tokens seen) of a row with penalties, each (vocab,)."""
        assert self.output_counts is not None and self.prompt_seen is not None
        slot = self.rows[request_id].slot
        return self.output_counts[slot], self.prompt_seen[slot]

    def state(self) -> dict[str, tuple[list[int], list[int], SamplingParams, list[int], int]]:
        """Every row's contents, without slots (for comparisons)."""
        return {
            rid: (r.prompt_token_ids, r.output_token_ids, r.params, r.block_ids, r.sample_index)
            for rid, r in self.rows.items()
        }


class SamplingRows:
    """The rows that sample in one step, in order: each request that catches up, and on the
    step its prompt completes, its n > 1 siblings (which sample from the same logits row, with
    the leader's params)."""

    def __init__(self) -> None:
        self.row_ids: list[str] = []
        self.flat_rows: list[int] = []  # the row of the step's hidden states each samples from
        self.leaders: list[RequestRow] = []  # whose params and prompt each uses
        self.own_rows: list[RequestRow | None] = []  # None: a sibling not yet in the batch
        self.indices: list[int] = []  # index among the n samples (seed + index)
        self.num_outputs: list[int] = []  # sampled before this step, placeholders included

    def add(self, s: ScheduledRequest, row: RequestRow, flat_row: int) -> None:
        for rid, index in zip(s.sample_ids, s.sample_indices):
            is_self = rid == s.request_id
            self.row_ids.append(rid)
            self.flat_rows.append(flat_row)
            self.leaders.append(row)
            self.own_rows.append(row if is_self else None)
            self.indices.append(index)
            self.num_outputs.append(s.num_output_tokens if is_self else 0)

    def expanded(self, counts: list[int]) -> SamplingRows:
        """Each row i as counts[i] consecutive rows at its next positions: hidden-state rows
        flat_rows[i] + j with num_outputs[i] + j outputs before them, j < counts[i] (a row's
        draft positions, or the tokens it emits after verifying them)."""
        out = SamplingRows()
        for i, count in enumerate(counts):
            for j in range(count):
                out.row_ids.append(self.row_ids[i])
                out.flat_rows.append(self.flat_rows[i] + j)
                out.leaders.append(self.leaders[i])
                out.own_rows.append(self.own_rows[i])
                out.indices.append(self.indices[i])
                out.num_outputs.append(self.num_outputs[i] + j)
        return out

    def slots_array(self) -> np.ndarray:
        return np.fromiter((r.slot for r in self.leaders), np.int64, len(self.leaders))

    def generators(
        self, store: dict[str, torch.Generator], device: torch.device
    ) -> dict[int, torch.Generator]:
        """Each seeded row's generator, by row index; a row's first sample makes it (seed +
        its index among n) and keeps it in `store` (the runner's, by request id)."""
        generators: dict[int, torch.Generator] = {}
        for i, (rid, row, index) in enumerate(zip(self.row_ids, self.leaders, self.indices)):
            seed = row.params.seed
            if seed is None:
                continue
            gen = store.get(rid)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed + index)
                store[rid] = gen
            generators[i] = gen
        return generators

    def own_mask(self) -> list[bool]:
        """Whether each row is its request's own (False: a sibling sampling for the first time,
        with no outputs yet)."""
        return [r is not None for r in self.own_rows]


@dataclass
class BatchColumns:
    """The sampling inputs that depend only on which rows sample (their params), gathered
    from the persistent batch's columns: built when the sampling rows change, reused while
    they stay the same (a steady decode batch)."""

    greedy: np.ndarray  # (R,) bool
    all_greedy: bool
    all_random: bool
    # the stage columns (sampling_table.COLUMNS) that some row sets off neutral, on the device;
    # "greedy" too when the rows are mixed
    tensors: dict[str, torch.Tensor]
    max_top_k: int  # the largest top_k (0: no row's is on)
    slots_t: torch.Tensor | None  # (R,) the rows' slots on the device; None: no penalties
    own: torch.Tensor | None  # (R,) 1.0 for a request's own row, 0.0 for a forking sibling
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    # the edits (sampling_table.EDITS) some row wants, each with the rows that want it
    edits: tuple[tuple[Edit, list[int]], ...]

    @classmethod
    def gather(cls, batch: InputBatch, rows: SamplingRows, device: torch.device) -> BatchColumns:
        slots = rows.slots_array()
        host = {c.name: batch.gather(c.name, slots) for c in COLUMNS}
        greedy = host["greedy"]
        all_greedy, all_random = bool(greedy.all()), bool(len(slots)) and not greedy.any()
        tensors = {
            c.name: numpy_to_device(host[c.name], c.torch_dtype, device)
            for c in COLUMNS  # greedy rows' sampling stages are neutral (the table)
            if c.stage and bool((host[c.name] != c.neutral).any())
        }
        if not all_greedy and not all_random:
            tensors["greedy"] = numpy_to_device(greedy, torch.bool, device)
        slots_t = own = None
        if bool(host["penalized"].any()):
            slots_t = numpy_to_device(slots, torch.int64, device)
            mask = rows.own_mask()
            if not all(mask):
                own = numpy_to_device(np.asarray(mask), torch.float32, device)
        num_logprobs = host["num_logprobs"]
        return cls(
            greedy=greedy,
            all_greedy=all_greedy,
            all_random=all_random,
            tensors=tensors,
            max_top_k=int(host["top_k"].max()) if len(slots) else 0,
            slots_t=slots_t,
            own=own,
            num_logprobs=[None if k < 0 else k for k in num_logprobs.tolist()],
            max_num_logprobs=int(num_logprobs.max()) if bool((num_logprobs >= 0).any()) else None,
            edits=_wanted_edits(batch, slots),
        )


def _wanted_edits(batch: InputBatch, slots: np.ndarray) -> tuple[tuple[Edit, list[int]], ...]:
    """Each edit some of these slots' rows want, with those rows (indices into `slots`)."""
    wanted = ((e, np.flatnonzero(batch.gather(e.column, slots)).tolist()) for e in EDITS)
    return tuple((e, rows) for e, rows in wanted if rows)
