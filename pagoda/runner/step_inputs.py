"""The step's flat inputs in persistent buffers: token ids, positions, slot mapping, block
tables and the attention metadata over them (layout: pagoda/layers/forward_context.py).
"""

from __future__ import annotations

import itertools

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

    def _pair(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        pin = self.device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        dev = (
            host
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=self.device)
        )
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
        block_tables: list[list[int]],
        block_size: int,
        pad_to: int | None = None,
        decode_num_splits: int = 1,
        full_width: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a step: request i brings token_ids[i], the last
        tokens of its first seq_lens[i] positions, and block_tables[i] covers those positions.

        pad_to: a pure-decode batch is padded to that many rows (ids 0, position 0, slot -1,
        seq_len 0). full_width: decode block tables span every column (a captured graph's view).
        """
        query_lens = [len(t) for t in token_ids]
        num_reqs = len(query_lens)
        num_tokens = sum(query_lens)
        rows = num_tokens if pad_to is None else pad_to
        assert num_tokens <= rows <= self.max_tokens and num_reqs <= self.max_reqs
        if self._copied is not None:
            self._copied.synchronize()
        ids, pos, slots = (
            self.host(b) for b in (self.input_ids, self.positions, self.slot_mapping)
        )
        d_idx, d_lens = (self.host(b) for b in (self.decode_token_idx, self.decode_seq_lens))
        p_start, p_qlens, p_lens = (
            self.host(b)
            for b in (self.prefill_token_start, self.prefill_query_lens, self.prefill_seq_lens)
        )
        # Vectorized over requests (a decode step of hundreds of requests is host time).
        q_lens = np.asarray(query_lens, dtype=np.int64)
        s_lens = np.asarray(seq_lens, dtype=np.int64)
        n_blocks = -(-s_lens // block_size)
        assert (q_lens > 0).all() and (q_lens <= s_lens).all()
        assert (np.asarray([len(t) for t in block_tables], dtype=np.int64) >= n_blocks).all()
        starts = np.cumsum(q_lens) - q_lens  # first flat row of each request
        req = np.repeat(np.arange(num_reqs), q_lens)  # request of each flat row
        p = np.arange(num_tokens) - starts[req] + (s_lens - q_lens)[req]
        flat_tables = np.fromiter(
            itertools.chain.from_iterable(t[:n] for t, n in zip(block_tables, n_blocks.tolist())),
            dtype=np.int64,
            count=int(n_blocks.sum()),
        )
        table_start = np.cumsum(n_blocks) - n_blocks
        ids[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(token_ids), dtype=np.int64, count=num_tokens
        )
        pos[:num_tokens] = p
        blocks = flat_tables[table_start[req] + p // block_size]
        slots[:num_tokens] = blocks * block_size + p % block_size

        decode = np.flatnonzero(q_lens == 1)
        prefill = np.flatnonzero(q_lens > 1)
        num_decodes = len(decode)
        # A padded batch's rows past num_tokens are decodes too (their tables are never read).
        num_decode_rows = num_decodes + rows - num_tokens
        cols_d = self.max_blocks_per_seq if full_width else int(n_blocks[decode].max(initial=0))
        d_tables = self.host_table(self.decode_block_tables, num_decode_rows, cols_d)
        d_idx[:num_decodes] = starts[decode]
        d_lens[:num_decodes] = s_lens[decode]
        _scatter_rows(d_tables, flat_tables, table_start[decode], n_blocks[decode])
        num_prefills = len(prefill)
        cols_p = int(n_blocks[prefill].max(initial=0))
        p_tables = self.host_table(self.prefill_block_tables, num_prefills, cols_p)
        p_start[:num_prefills] = starts[prefill]
        p_qlens[:num_prefills] = q_lens[prefill]
        p_lens[:num_prefills] = s_lens[prefill]
        _scatter_rows(p_tables, flat_tables, table_start[prefill], n_blocks[prefill])
        prefills = [
            PrefillSeq(int(starts[i]), int(starts[i] + q_lens[i]), int(s_lens[i])) for i in prefill
        ]
        if rows > num_tokens:
            assert not prefills, "only pure-decode batches are padded"
            pad = slice(num_tokens, rows)
            ids[pad], pos[pad], slots[pad] = 0, 0, -1
            d_idx[pad] = np.arange(num_tokens, rows)
            d_lens[pad] = 0
        meta = AttentionMetadata(
            num_tokens=rows,
            query_lens=query_lens,
            seq_lens=list(seq_lens),
            slot_mapping=self.device_view(self.slot_mapping, rows),
            decode_token_idx=self.device_view(self.decode_token_idx, num_decode_rows),
            decode_seq_lens=self.device_view(self.decode_seq_lens, num_decode_rows),
            decode_block_tables=self.device_table(
                self.decode_block_tables, num_decode_rows, cols_d
            ),
            prefill_token_start=self.device_view(self.prefill_token_start, num_prefills),
            prefill_query_lens=self.device_view(self.prefill_query_lens, num_prefills),
            prefill_seq_lens=self.device_view(self.prefill_seq_lens, num_prefills),
            prefill_block_tables=self.device_table(self.prefill_block_tables, num_prefills, cols_p),
            prefills=prefills,
            max_prefill_query_len=max((p.token_end - p.token_start for p in prefills), default=0),
            decode_num_splits=decode_num_splits,
        )
        input_ids = self.device_view(self.input_ids, rows)
        positions = self.device_view(self.positions, rows)
        if self._copied is not None:
            self._copied.record()
        return input_ids, positions, meta


def _scatter_rows(dst: np.ndarray, flat: np.ndarray, first: np.ndarray, counts: np.ndarray) -> None:
    """dst[r, :counts[r]] = flat[first[r] : first[r] + counts[r]] for every row r."""
    if not len(counts):  # no request of this kind (most steps lack prefills or decodes)
        return
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    dst[rows, cols] = flat[np.repeat(first, counts) + cols]
