"""The safetensors container used for data files.

A data file is ``u64 little-endian header length | JSON header | byte buffer``; the header maps
tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the buffer,
which the entries cover without holes. We write the header ourselves (the chunks are written
straight from tensor memory afterwards) and parse it for ``verify`` and tests.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..errors import CheckpointingException, CorruptCheckpointError

# Headers larger than this are refused when parsing: a forged length must not allocate GBs.
MAX_HEADER_BYTES = 100_000_000  # the limit of the safetensors library itself


@dataclass(frozen=True)
class Entry:
    name: str
    code: str  # safetensors dtype code, e.g. "F32"
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: list[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Return the bytes preceding the buffer and the absolute file offset of each entry.

    The header is padded with spaces to a multiple of 8 bytes so the buffer starts aligned.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    position = 0
    relative = []
    for entry in entries:
        if entry.name in header:
            raise CheckpointingException(f"duplicate entry {entry.name!r} in one data file")
        header[entry.name] = {
            "dtype": entry.code,
            "shape": list(entry.shape),
            "data_offsets": [position, position + entry.nbytes],
        }
        relative.append(position)
        position += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise CheckpointingException(
            f"a data file header of {len(text)} bytes exceeds the safetensors limit "
            f"({MAX_HEADER_BYTES}); save with a larger thread_count to spread chunks over more files"
        )
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, [len(prefix) + r for r in relative]


def parse_header(head: bytes, path: str) -> tuple[int, dict]:
    """Parse the first bytes of a data file; return ``(buffer_start, header)``.

    ``head`` must hold at least the 8-byte length and the header.
    """
    if len(head) < 8:
        raise CorruptCheckpointError(f"{path}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(head):
        raise CorruptCheckpointError(f"{path}: safetensors header length {length} is invalid")
    try:
        header = json.loads(head[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object")
    return 8 + length, header
