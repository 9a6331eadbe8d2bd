"""InputBuffers.prepare: the exact index tensors of a step (flat rows, positions, slots, decode
and prefill tables), padding of pure-decode batches for CUDA graphs, and reuse across steps."""

from __future__ import annotations

import torch

from pagoda.runner.step_inputs import InputBuffers

BS = 4


def _buffers() -> InputBuffers:
    return InputBuffers(max_tokens=32, max_reqs=8, max_blocks_per_seq=6, device=torch.device("cpu"))


def test_mixed_step_exact_state() -> None:
    buf = _buffers()
    # request 0: decode at position 5 (seq 6); request 1: chunk of 3 after 4 cached (seq 7);
    # request 2: fresh prompt of 2; request 3: decode at position 8 (seq 9, a block boundary + 1)
    ids, pos, meta = buf.prepare(
        [[11], [21, 22, 23], [31, 32], [41]],
        [6, 7, 2, 9],
        [[7, 2], [5, 0, 9], [3], [1, 4, 6, 8]],
        BS,
    )
    assert ids.tolist() == [11, 21, 22, 23, 31, 32, 41]
    assert pos.tolist() == [5, 4, 5, 6, 0, 1, 8]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 0 * 4 + 0, 0 * 4 + 1, 0 * 4 + 2, 12, 13, 24]
    assert meta.num_tokens == 7 and meta.query_lens == [1, 3, 2, 1]
    assert meta.decode_token_idx.tolist() == [0, 6]
    assert meta.decode_seq_lens.tolist() == [6, 9]
    assert meta.decode_block_tables.shape == (2, 3)  # widest decode row: 3 blocks
    # contiguous (rows, used columns), not a slice of the full-width buffer: torch.compile
    # would otherwise guard on whether the batch or the width is 1
    assert meta.decode_block_tables.is_contiguous()
    assert meta.prefill_block_tables.shape == (2, 2) and meta.prefill_block_tables.is_contiguous()
    assert meta.decode_block_tables[0, :2].tolist() == [7, 2]
    assert meta.decode_block_tables[1].tolist() == [1, 4, 6]
    assert meta.prefill_token_start.tolist() == [1, 4]
    assert meta.prefill_query_lens.tolist() == [3, 2]
    assert meta.prefill_seq_lens.tolist() == [7, 2]
    assert meta.prefill_block_tables[0].tolist() == [5, 0]
    assert meta.prefill_block_tables[1, :1].tolist() == [3]
    assert [(p.token_start, p.token_end, p.seq_len) for p in meta.prefills] == [
        (1, 4, 7),
        (4, 6, 2),
    ]
    assert meta.max_prefill_query_len == 3


def test_pure_decode_padded_to_graph_size() -> None:
    buf = _buffers()
    ids, pos, meta = buf.prepare(
        [[5], [6], [7]], [3, 8, 1], [[2], [0, 3], [1]], BS, pad_to=4, full_width=True,
        decode_num_splits=3,
    )  # fmt: skip
    assert ids.tolist() == [5, 6, 7, 0] and pos.tolist() == [2, 7, 0, 0]
    assert meta.slot_mapping.tolist() == [10, 15, 4, -1]  # padding writes nowhere
    assert meta.decode_token_idx.tolist() == [0, 1, 2, 3]
    assert meta.decode_seq_lens.tolist() == [3, 8, 1, 0]  # padding reads nothing
    assert meta.decode_block_tables.shape == (4, 6)  # a captured graph's full-width view
    assert meta.decode_block_tables.stride(0) == 6 and meta.num_decodes == 4
    assert meta.decode_num_splits == 3 and meta.prefills == []
    # views of the persistent buffers: the next step writes where a captured graph reads
    _, _, again = buf.prepare([[9]], [2], [[5]], BS, pad_to=4, full_width=True)
    assert again.slot_mapping.data_ptr() == meta.slot_mapping.data_ptr()
    assert again.decode_block_tables.data_ptr() == meta.decode_block_tables.data_ptr()
    assert again.slot_mapping.tolist() == [21, -1, -1, -1]
    assert again.decode_seq_lens.tolist() == [2, 0, 0, 0]


def test_all_padding_batch_for_capture() -> None:
    ids, pos, meta = _buffers().prepare([], [], [], BS, pad_to=2, full_width=True)
    assert ids.tolist() == [0, 0] and meta.slot_mapping.tolist() == [-1, -1]
    assert meta.decode_seq_lens.tolist() == [0, 0] and meta.decode_token_idx.tolist() == [0, 1]


def test_row_index_of_the_sampling_rows() -> None:
    buf = _buffers()
    buf.prepare([[1, 2, 3], [4]], [3, 5], [[0], [1, 2]], BS)
    assert buf.row_index([2, 3]).tolist() == [2, 3]
    # forks sample several rows from one hidden state: more rows than requests (8) widen it
    rows = [2] * 5 + [3] * 6
    assert buf.row_index(rows).tolist() == rows
    assert buf.row_index([0]).tolist() == [0]
