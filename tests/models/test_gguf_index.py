"""pagoda/loading/gguf_index.py against the gguf package's own GGUFReader on the shipped SmolLM2
file: the same tensors (names, types, shapes, and the same bytes laid out the same way) and the
same scalar and string metadata; arrays are skipped; a file that is not GGUF is a ValueError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from pagoda.loading.gguf_index import read_gguf_index


def test_index_equals_gguf_reader(smollm2_path: str) -> None:
    index = read_gguf_index(smollm2_path)
    reader = GGUFReader(smollm2_path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for got, want in zip(index.tensors, reader.tensors, strict=True):
        assert got.tensor_type == want.tensor_type, got.name
        assert got.shape == tuple(int(d) for d in want.shape), got.name
        assert (got.data.shape, got.data.dtype) == (want.data.shape, want.data.dtype), got.name
        assert np.array_equal(got.data, want.data), got.name
    scalars = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own header entries
            continue
        kind = field.types[0].name
        if kind == "ARRAY":
            assert key not in index.fields
            continue
        value = field.parts[field.data[0]]
        want = bytes(value).decode() if kind == "STRING" else value[0].item()
        assert index.fields[key] == want, key
        scalars += 1
    assert scalars == len(index.fields) and "tokenizer.chat_template" in index.fields


def test_not_a_gguf_file_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(str(path))
