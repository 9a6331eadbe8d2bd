"""The step's flat inputs in persistent buffers: token ids, positions, slot mapping, block
tables and the attention metadata over them (layout: pagoda/layers/forward_context.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.layers.forward_context import AttentionMetadata, PrefillSeq


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """One-off metadata in fresh tensors (tests, profiling); the runner uses `InputBuffers`.

    block_tables[i] must cover positions [0, seq_lens[i]) of request i.
    """
    max_blocks = max((-(-s // block_size) for s in seq_lens), default=1)
    buffers = InputBuffers(
        max(sum(query_lens), 1), max(len(query_lens), 1), max_blocks, torch.device(device)
    )
    token_ids = [[0] * q for q in query_lens]
    _, _, meta = buffers.prepare(token_ids, seq_lens, block_tables, block_size)
    return meta


class InputBuffers:
    """Persistent step inputs. Each step fills host arrays in place (pinned on CUDA) and copies
    the used rows to device buffers of the same shapes with non_blocking copies; the tensors
    handed to the model are views of the device buffers, so CUDA graphs captured on them see
    each step's values. On CPU the host buffers are the device buffers.

    Invariant: host buffers are refilled only after the previous step's copies ran: prepare()
    records an event after its copies and waits on the previous one before writing (a step that
    samples nothing does not sync with the host otherwise).
    """

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Recorded after each step's host-to-device copies (CUDA only).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        int64, int32 = torch.int64, torch.int32
        self.input_ids = self._pair((max_tokens,), int64)
        self.positions = self._pair((max_tokens,), int64)
        self.slot_mapping = self._pair((max_tokens,), int64)
        self.decode_token_idx = self._pair((max_reqs,), int64)
        self.decode_seq_lens = self._pair((max_reqs,), int32)
        self.decode_block_tables = self._pair((max_reqs, max_blocks_per_seq), int32)
        self.prefill_token_start = self._pair((max_reqs,), int32)
        self.prefill_query_lens = self._pair((max_reqs,), int32)
        self.prefill_seq_lens = self._pair((max_reqs,), int32)
        self.prefill_block_tables = self._pair((max_reqs, max_blocks_per_seq), int32)
        self.query_start_loc = self._pair((max_reqs + 1,), int32)
        self.req_seq_lens = self._pair((max_reqs,), int32)
        self.req_block_tables = self._pair((max_reqs, max_blocks_per_seq), int32)
        # The hidden-state row each sampling row reads (filled by row_index, after prepare).
        self.sample_rows = self._pair((max_reqs,), int64)

    def _pair(self, shape: tuple[int, ...], dtype: torch.dtype, index: int | None = None) -> int:
        """A (host, device) pair of buffers, appended, or replacing pair `index`."""
        pin = self.device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        dev = (
            host
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=self.device)
        )
        if index is not None:
            self._pairs[index] = (host, dev)
            return index
        self._pairs.append((host, dev))
        return len(self._pairs) - 1

    def host(self, buf: int) -> np.ndarray:
        return self._pairs[buf][0].numpy()

    def device_view(self, buf: int, rows: int) -> torch.Tensor:
        """Rows [0, rows) of a device buffer, copied from the host first."""
        host, dev = self._pairs[buf]
        if dev is not host:
            dev[:rows].copy_(host[:rows], non_blocking=True)
        return dev[:rows]

    def host_table(self, buf: int, rows: int, cols: int) -> np.ndarray:
        """A block-table buffer as a contiguous (rows, cols) array over its first elements."""
        return self._pairs[buf][0].view(-1)[: rows * cols].view(rows, cols).numpy()

    def device_table(self, buf: int, rows: int, cols: int) -> torch.Tensor:
        """The device side of host_table(buf, rows, cols), copied from the host first.
        Contiguous, so that no consumer depends on the buffer's full width."""
        host, dev = self._pairs[buf]
        n = rows * cols
        if dev is not host:
            dev.view(-1)[:n].copy_(host.view(-1)[:n], non_blocking=True)
        return dev.view(-1)[:n].view(rows, cols)

    def prepare(
        self,
        token_ids: list[list[int]],
        seq_lens: list[int],
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
        pad_to: int | None = None,
        decode_num_splits: int = 1,
        full_width: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a step: request i brings token_ids[i], the last
        tokens of its first seq_lens[i] positions, and block_tables[i] covers those positions
        (a list per request, or the rows of a 2-D array such as the persistent batch's).

        pad_to: a pure-decode batch is padded to that many rows (ids 0, position 0, slot -1,
        seq_len 0). full_width: decode block tables span every column (a captured graph's view).
        """
        layout = _Layout.of(token_ids, seq_lens, block_tables, block_size)
        rows = layout.num_tokens if pad_to is None else pad_to
        assert layout.num_tokens <= rows <= self.max_tokens and layout.num_reqs <= self.max_reqs
        if self._copied is not None:
            self._copied.synchronize()
        self._fill_tokens(token_ids, layout, block_size)
        # A padded batch's rows past num_tokens are decodes too (their tables are never read).
        num_decode_rows = len(layout.decode) + rows - layout.num_tokens
        cols_d = self._fill_decodes(layout, num_decode_rows, full_width)
        cols_p, prefills = self._fill_prefills(layout)
        num_all, cols_all = self._fill_requests(layout) if prefills else (0, 0)
        if rows > layout.num_tokens:
            assert not prefills, "only pure-decode batches are padded"
            self._fill_padding(layout.num_tokens, rows)
        meta = AttentionMetadata(
            num_tokens=rows,
            query_lens=[len(t) for t in token_ids],
            seq_lens=list(seq_lens),
            slot_mapping=self.device_view(self.slot_mapping, rows),
            decode_token_idx=self.device_view(self.decode_token_idx, num_decode_rows),
            decode_seq_lens=self.device_view(self.decode_seq_lens, num_decode_rows),
            decode_block_tables=self.device_table(
                self.decode_block_tables, num_decode_rows, cols_d
            ),
            prefill_token_start=self.device_view(self.prefill_token_start, len(prefills)),
            prefill_query_lens=self.device_view(self.prefill_query_lens, len(prefills)),
            prefill_seq_lens=self.device_view(self.prefill_seq_lens, len(prefills)),
            prefill_block_tables=self.device_table(
                self.prefill_block_tables, len(prefills), cols_p
            ),
            prefills=prefills,
            max_prefill_query_len=max((p.token_end - p.token_start for p in prefills), default=0),
            query_start_loc=self.device_view(self.query_start_loc, num_all + 1 if num_all else 0),
            req_seq_lens=self.device_view(self.req_seq_lens, num_all),
            req_block_tables=self.device_table(self.req_block_tables, num_all, cols_all),
            decode_num_splits=decode_num_splits,
        )
        input_ids = self.device_view(self.input_ids, rows)
        positions = self.device_view(self.positions, rows)
        if self._copied is not None:
            self._copied.record()
        return input_ids, positions, meta

    def row_index(self, rows: list[int]) -> torch.Tensor:
        """`rows` (the hidden-state row of each sampling row) as an int64 device tensor, copied
        through the persistent sample_rows buffer. Call after prepare() in the same step: it
        waited for the previous step's copies, and the event is recorded again after this one."""
        n = len(rows)
        if n > len(self._pairs[self.sample_rows][0]):  # n > 1 forks: more rows than requests
            self._pair((2 * n,), torch.int64, self.sample_rows)
        self.host(self.sample_rows)[:n] = rows
        index = self.device_view(self.sample_rows, n)
        if self._copied is not None:
            self._copied.record()
        return index

    def _fill_tokens(self, token_ids: list[list[int]], layout: _Layout, block_size: int) -> None:
        """Input ids, positions and slot mapping of the flat batch's real rows."""
        n = layout.num_tokens
        ids, pos, slots = (
            self.host(b) for b in (self.input_ids, self.positions, self.slot_mapping)
        )
        ids[:n] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=n)
        pos[:n] = layout.positions
        blocks = layout.tables[layout.req, layout.positions // block_size]
        slots[:n] = blocks * block_size + layout.positions % block_size

    def _fill_decodes(self, layout: _Layout, num_rows: int, full_width: bool) -> int:
        """The decode rows' token index, length and block table; returns the tables' width."""
        decode = layout.decode
        cols = (
            self.max_blocks_per_seq if full_width else int(layout.n_blocks[decode].max(initial=0))
        )
        tables = self.host_table(self.decode_block_tables, num_rows, cols)
        self.host(self.decode_token_idx)[: len(decode)] = layout.starts[decode]
        self.host(self.decode_seq_lens)[: len(decode)] = layout.s_lens[decode]
        width = min(cols, layout.tables.shape[1])
        tables[: len(decode), :width] = layout.tables[decode, :width]
        return cols

    def _fill_prefills(self, layout: _Layout) -> tuple[int, list[PrefillSeq]]:
        """The prefill rows' start, query length, length and block table; returns the tables'
        width and each prefill's span."""
        prefill = layout.prefill
        num = len(prefill)
        cols = int(layout.n_blocks[prefill].max(initial=0))
        tables = self.host_table(self.prefill_block_tables, num, cols)
        self.host(self.prefill_token_start)[:num] = layout.starts[prefill]
        self.host(self.prefill_query_lens)[:num] = layout.q_lens[prefill]
        self.host(self.prefill_seq_lens)[:num] = layout.s_lens[prefill]
        tables[:num, :cols] = layout.tables[prefill, :cols]
        starts, q_lens, s_lens = layout.starts, layout.q_lens, layout.s_lens
        spans = [
            PrefillSeq(int(starts[i]), int(starts[i] + q_lens[i]), int(s_lens[i])) for i in prefill
        ]
        return cols, spans

    def _fill_requests(self, layout: _Layout) -> tuple[int, int]:
        """Every request's first row, length and block table, in flat order; returns the number
        of requests and the tables' width."""
        num = layout.num_reqs
        cols = int(layout.n_blocks.max(initial=0))
        starts = self.host(self.query_start_loc)
        starts[:num] = layout.starts
        starts[num] = layout.num_tokens
        self.host(self.req_seq_lens)[:num] = layout.s_lens
        self.host_table(self.req_block_tables, num, cols)[:] = layout.tables[:, :cols]
        return num, cols

    def _fill_padding(self, num_tokens: int, rows: int) -> None:
        """Rows [num_tokens, rows) of a padded decode batch: id 0, position 0, no slot, length 0."""
        pad = slice(num_tokens, rows)
        for buf, value in ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, -1)):
            self.host(buf)[pad] = value
        self.host(self.decode_token_idx)[pad] = np.arange(num_tokens, rows)
        self.host(self.decode_seq_lens)[pad] = 0


@dataclass
class _Layout:
    """Where each request's rows, positions and blocks sit in a step's flat batch (vectorized
    over requests: a decode step of hundreds of requests is host time)."""

    q_lens: np.ndarray  # (num_reqs,) tokens of each request this step
    s_lens: np.ndarray  # (num_reqs,) each request's length after this step
    n_blocks: np.ndarray  # (num_reqs,) blocks covering s_lens
    starts: np.ndarray  # (num_reqs,) first flat row of each request
    req: np.ndarray  # (num_tokens,) request of each flat row
    positions: np.ndarray  # (num_tokens,) position of each flat row in its sequence
    # (num_reqs, >= max n_blocks) each request's block table in a row; columns past its
    # n_blocks are never read
    tables: np.ndarray
    decode: np.ndarray  # indices of the requests with one token this step
    prefill: np.ndarray  # indices of the others

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.req)

    @classmethod
    def of(
        cls,
        token_ids: list[list[int]],
        seq_lens: list[int],
        block_tables: list[list[int]] | np.ndarray,
        block_size: int,
    ) -> _Layout:
        q_lens = np.asarray([len(t) for t in token_ids], dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        n_blocks = -(-s_lens // block_size)
        assert (q_lens > 0).all() and (q_lens <= s_lens).all()
        tables = _as_table(block_tables, n_blocks)
        starts = np.cumsum(q_lens) - q_lens
        req = np.repeat(np.arange(len(q_lens)), q_lens)
        num_tokens = int(q_lens.sum())
        return cls(
            q_lens=q_lens,
            s_lens=s_lens,
            n_blocks=n_blocks,
            starts=starts,
            req=req,
            positions=np.arange(num_tokens) - starts[req] + (s_lens - q_lens)[req],
            tables=tables,
            decode=np.flatnonzero(q_lens == 1),
            prefill=np.flatnonzero(q_lens > 1),
        )


def _as_table(block_tables: list[list[int]] | np.ndarray, n_blocks: np.ndarray) -> np.ndarray:
    """Block tables as a 2-D array, checking that row i holds n_blocks[i] blocks (an array's
    rows are taken as they are: their owner keeps the counts)."""
    if isinstance(block_tables, np.ndarray):
        assert block_tables.ndim == 2 and block_tables.shape[1] >= n_blocks.max(initial=0)
        return block_tables
    assert (np.asarray([len(t) for t in block_tables], dtype=np.int64) >= n_blocks).all()
    table = np.zeros((len(block_tables), max(int(n_blocks.max(initial=0)), 1)), np.int64)
    for i, (t, n) in enumerate(zip(block_tables, n_blocks.tolist())):
        table[i, :n] = t[:n]
    return table
