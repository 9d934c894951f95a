"""The checkpoint index (``index-<save_id>.json``): where every chunk of every tensor lives.

Parsing is strict: anything that contradicts the specification in ``docs/format.md`` raises
:class:`~distckpt.errors.CorruptCheckpointError` naming the file and the field, so a forged or
damaged index can neither crash the reader nor make it allocate or read outside the checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..planning.boxes import Box
from ..planning.coverage import find_overlap
from .dtypes import dtype_from_name, itemsize

INDEX_FORMAT = "distckpt-index"
INDEX_VERSION = 1
DEFAULT_BLOCK_BYTES = 1 << 20
MAX_NDIM = 64
MAX_NUMEL = 1 << 62

# File names are plain names inside the checkpoint directory: no separators, no "..".
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


def is_safe_file_name(name: object) -> bool:
    return isinstance(name, str) and bool(_SAFE_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True)
class ChunkEntry:
    """A box of a tensor stored contiguously (row-major) at ``data_offset`` of ``file``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    data_offset: int
    nbytes: int
    crc32c: tuple[int, ...]  # one per ``block_bytes`` block of the chunk's bytes


@dataclass
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkEntry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_from_name(self.dtype))


@dataclass(frozen=True)
class ObjectEntry:
    """A :class:`~distckpt.mapping.ShardedObject` stored as ``torch.save`` bytes."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    file: str
    data_offset: int
    nbytes: int
    crc32c: tuple[int, ...]


@dataclass
class CheckpointIndex:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    block_bytes: int = DEFAULT_BLOCK_BYTES

    @property
    def files(self) -> list[str]:
        names = {c.file for t in self.tensors.values() for c in t.chunks}
        names.update(o.file for o in self.objects.values())
        return sorted(names)

    def to_json(self) -> bytes:
        files = self.files
        file_ids = {name: i for i, name in enumerate(files)}
        doc: dict[str, Any] = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "checksum": {"algorithm": "crc32c", "block_bytes": self.block_bytes},
            "files": files,
            "tensors": {
                key: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": [
                        {
                            "offset": list(c.offset),
                            "shape": list(c.shape),
                            "file": file_ids[c.file],
                            "data_offset": c.data_offset,
                            "nbytes": c.nbytes,
                            "crc32c": list(c.crc32c),
                        }
                        for c in t.chunks
                    ],
                }
                for key, t in self.tensors.items()
            },
            "objects": {
                key: {
                    "key": o.key,
                    "global_shape": list(o.global_shape),
                    "global_offset": list(o.global_offset),
                    "file": file_ids[o.file],
                    "data_offset": o.data_offset,
                    "nbytes": o.nbytes,
                    "crc32c": list(o.crc32c),
                }
                for key, o in self.objects.items()
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> "CheckpointIndex":
        return _IndexParser(path).parse(raw)


def num_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


class _IndexParser:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {where}: {what}")

    def obj(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, "expected a JSON object")
        return value

    def get(self, d: dict, name: str, where: str) -> Any:
        if name not in d:
            raise self.fail(where, f"missing field {name!r}")
        return d[name]

    def int_(self, value: Any, where: str, lo: int = 0, hi: int = MAX_NUMEL) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(where, f"expected an integer in [{lo}, {hi}], got {value!r:.60}")
        return value

    def ints(self, value: Any, where: str, hi: int = MAX_NUMEL, max_len: int = MAX_NDIM) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > max_len:
            raise self.fail(where, f"expected a list of at most {max_len} integers")
        return tuple(self.int_(v, where, 0, hi) for v in value)

    def parse(self, raw: bytes) -> CheckpointIndex:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise self.fail("index", f"not valid JSON ({exc})") from None
        doc = self.obj(doc, "index")
        if doc.get("format") != INDEX_FORMAT:
            raise self.fail("format", f"expected {INDEX_FORMAT!r}, got {doc.get('format')!r:.60}")
        version = doc.get("version")
        if type(version) is not int or version != INDEX_VERSION:
            raise UnsupportedFormatError(
                f"{self.path}: index version {version!r:.20} is not supported by this release "
                f"(reads version {INDEX_VERSION}); upgrade distckpt"
            )
        checksum = self.obj(self.get(doc, "checksum", "index"), "checksum")
        if checksum.get("algorithm") != "crc32c":
            raise self.fail("checksum.algorithm", "only 'crc32c' is defined")
        block_bytes = self.int_(self.get(checksum, "block_bytes", "checksum"), "checksum.block_bytes", 1)
        files = self.get(doc, "files", "index")
        if not isinstance(files, list) or not all(is_safe_file_name(f) for f in files):
            raise self.fail(
                "files", "expected a list of plain file names inside the checkpoint directory"
            )
        index = CheckpointIndex(block_bytes=block_bytes)
        tensors = self.obj(self.get(doc, "tensors", "index"), "tensors")
        for key, t in tensors.items():
            index.tensors[key] = self.tensor(key, self.obj(t, f"tensor {key!r}"), files, block_bytes)
        objects = self.obj(self.get(doc, "objects", "index"), "objects")
        for key, o in objects.items():
            index.objects[key] = self.object(key, self.obj(o, f"object {key!r}"), files, block_bytes)
        return index

    def file_ref(self, value: Any, files: list, where: str) -> str:
        return files[self.int_(value, where, 0, len(files) - 1)]

    def crcs(self, value: Any, nbytes: int, block_bytes: int, where: str) -> tuple[int, ...]:
        expected = num_blocks(nbytes, block_bytes)
        if not isinstance(value, list) or len(value) != expected:
            raise self.fail(where, f"expected {expected} crc32c values for {nbytes} bytes")
        return tuple(self.int_(v, where, 0, 0xFFFFFFFF) for v in value)

    def tensor(self, key: str, t: dict, files: list, block_bytes: int) -> TensorEntry:
        where = f"tensor {key!r}"
        dtype = self.get(t, "dtype", where)
        size = itemsize(dtype_from_name(dtype)) if isinstance(dtype, str) else None
        if size is None:
            raise self.fail(where, f"dtype must be a string, got {dtype!r:.40}")
        shape = self.ints(self.get(t, "shape", where), where + " shape")
        if math.prod(shape) > MAX_NUMEL:
            raise self.fail(where, f"shape {shape} is too large")
        chunks_raw = self.get(t, "chunks", where)
        if not isinstance(chunks_raw, list):
            raise self.fail(where, "chunks must be a list")
        entry = TensorEntry(dtype, shape)
        for n, c in enumerate(chunks_raw):
            cw = f"{where} chunk {n}"
            c = self.obj(c, cw)
            offset = self.ints(self.get(c, "offset", cw), cw + " offset")
            cshape = self.ints(self.get(c, "shape", cw), cw + " shape")
            if len(offset) != len(shape) or len(cshape) != len(shape):
                raise self.fail(cw, f"offset/shape must have {len(shape)} axes like the tensor")
            if any(o + s > g for o, s, g in zip(offset, cshape, shape)):
                raise self.fail(cw, f"box {offset}+{cshape} lies outside the tensor shape {shape}")
            nbytes = self.int_(self.get(c, "nbytes", cw), cw + " nbytes")
            if nbytes != math.prod(cshape) * size:
                raise self.fail(cw, f"nbytes {nbytes} != {math.prod(cshape)} elements x {size} bytes")
            entry.chunks.append(
                ChunkEntry(
                    offset,
                    cshape,
                    self.file_ref(self.get(c, "file", cw), files, cw + " file"),
                    self.int_(self.get(c, "data_offset", cw), cw + " data_offset"),
                    nbytes,
                    self.crcs(self.get(c, "crc32c", cw), nbytes, block_bytes, cw + " crc32c"),
                )
            )
        overlap = find_overlap([Box(c.offset, c.shape) for c in entry.chunks])
        if overlap is not None:
            raise self.fail(where, f"chunks {overlap[0]} and {overlap[1]} overlap in region "
                                   f"{overlap[2].describe()}")
        return entry

    def object(self, unique_key: str, o: dict, files: list, block_bytes: int) -> ObjectEntry:
        where = f"object {unique_key!r}"
        key = self.get(o, "key", where)
        if not isinstance(key, str):
            raise self.fail(where, "key must be a string")
        nbytes = self.int_(self.get(o, "nbytes", where), where + " nbytes")
        global_shape = self.ints(self.get(o, "global_shape", where), where + " global_shape")
        global_offset = self.ints(self.get(o, "global_offset", where), where + " global_offset")
        if len(global_shape) != len(global_offset) or any(
            o >= n for o, n in zip(global_offset, global_shape)
        ):
            raise self.fail(where, "global_offset must lie inside global_shape (same length)")
        expected_key = (
            f"{key}/shard_{'.'.join(map(str, global_offset))}_{'.'.join(map(str, global_shape))}"
        )
        if unique_key != expected_key:
            raise self.fail(where, f"entry describes {expected_key!r}, not {unique_key!r}")
        return ObjectEntry(
            key,
            global_shape,
            global_offset,
            self.file_ref(self.get(o, "file", where), files, where + " file"),
            self.int_(self.get(o, "data_offset", where), where + " data_offset"),
            nbytes,
            self.crcs(self.get(o, "crc32c", where), nbytes, block_bytes, where + " crc32c"),
        )
