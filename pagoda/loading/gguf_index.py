"""A GGUF file's scalar and string metadata and its tensors (memory-mapped, laid out as the `gguf`
package's GGUFReader lays them out), read without decoding the metadata arrays.

GGUFReader builds a numpy view for every item of every metadata array: for SmolLM2's file (a
49,152-token vocabulary and 48,900 merges) that is about 3 s of an engine's start, and the
engine never reads those arrays (the tokenizer is converted once and cached: tokenizer.py).
Here the arrays are skipped (their string lengths are read, nothing else), so the index takes
milliseconds. Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count;
the metadata (key, type, value); the tensor infos (name, dims, type, offset); then the tensor
data from the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

_MAGIC = b"GGUF"
# metadata value types -> struct format (fixed size); 8 is STRING, 9 ARRAY
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types (by name) stored as items of their own dtype; every other type is bytes (blocks)
_ITEM_DTYPES: dict[str, Any] = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: shape in GGUF order (ne0, the row length, first), data a read-only view of
    the file, shaped as GGUFReader shapes it (reversed dims; blocks as bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    fields: dict[str, Any]  # scalar and string metadata (arrays are skipped)
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def array(self) -> list[Any]:
        """A flat array of scalars or strings."""
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type == _STRING:
            return [self.string() for _ in range(count)]
        if item_type == _ARRAY:
            raise ValueError("nested GGUF arrays are not read")
        fmt = _SCALARS[item_type]
        values = list(struct.unpack_from(f"<{count}{fmt[1:]}", self.buf, self.pos))
        self.pos += count * struct.calcsize(fmt)
        return values

    def skip_array(self) -> None:
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type == _STRING:
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif item_type == _ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            self.pos += count * struct.calcsize(_SCALARS[item_type])


def read_gguf_index(path: str, arrays: tuple[str, ...] = ()) -> GGUFIndex:
    """The metadata and tensors of the GGUF file at `path`; ValueError if it is not one. Array
    fields are skipped, but for the keys in `arrays` (read whole into `fields`)."""
    # Imported here: the gguf package is needed for GGUF files only (an HF folder runs without).
    from gguf.constants import GGMLQuantizationType

    mapped = np.memmap(path, mode="r")
    cur = _Cursor(mapped.data)
    if bytes(mapped[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key, kind = cur.string(), cur.unpack("<I")
        if kind == _STRING:
            fields[key] = cur.string()
        elif kind == _ARRAY and key in arrays:
            fields[key] = cur.array()
        elif kind == _ARRAY:
            cur.skip_array()
        else:
            fields[key] = cur.unpack(_SCALARS[kind])
    infos = []
    for _ in range(num_tensors):
        name, num_dims = cur.string(), cur.unpack("<I")
        dims = tuple(cur.unpack("<Q") for _ in range(num_dims))
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    return GGUFIndex(fields, [_tensor(mapped, start, *info) for info in infos])


# llama.cpp's token types (tokenizer.ggml.token_type): a user-defined token is matched whole in
# the text before the model's own tokenization, as an added token.
USER_DEFINED_TOKEN = 4


def gguf_user_defined_tokens(gguf_path: str) -> list[str]:
    """The texts of the file's user-defined tokens (tokenizer.ggml.token_type 4)."""
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    fields = read_gguf_index(gguf_path, arrays=keys).fields
    tokens, types = fields.get(keys[0]) or [], fields.get(keys[1]) or []
    return [t for t, kind in zip(tokens, types) if kind == USER_DEFINED_TOKEN]


def gguf_string_field(gguf_path: str, key: str) -> str | None:
    """A string metadata field of a GGUF file (e.g. tokenizer.chat_template); None if absent."""
    value = read_gguf_index(gguf_path).fields.get(key)
    return value if isinstance(value, str) else None


def _tensor(
    mapped: np.ndarray,
    start: int,
    name: str,
    dims: tuple[int, ...],
    ggml_type: GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quant_shape_to_byte_shape

    n_elems = int(np.prod(dims))
    np_dims = tuple(reversed(dims))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_bytes = n_elems * type_size // block_size
    begin = start + offset
    item = _ITEM_DTYPES.get(ggml_type.name)
    if item is None:
        data = mapped[begin : begin + n_bytes].reshape(
            quant_shape_to_byte_shape(np_dims, ggml_type)
        )
    else:
        data = mapped[begin : begin + n_bytes].view(item).reshape(np_dims)
    return GGUFTensor(name, ggml_type, dims, data)
