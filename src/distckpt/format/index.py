"""The checkpoint index (``index-<save_id>.json``): where every chunk of every tensor lives.

Version 2 (written) stores the chunks of a tensor that form a regular grid -- the usual case,
e.g. rows split over thousands of ranks -- as one compact table (cut points per axis, then per
cell a file, a data offset and checksums, as packed integer arrays); other chunks are listed one
by one as in version 1 (read). See ``docs/format.md`` section 4.

Parsing is strict: anything that contradicts the specification raises
:class:`~distckpt.errors.CorruptCheckpointError` naming the file and the field, so a forged or
damaged index can neither crash the reader nor make it allocate or read outside the checkpoint.
A grid is kept compact after parsing: its chunks are built on demand
(:meth:`TensorEntry.overlapping`), so a rank planning its reads touches only the chunks it needs.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import sys
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, product, repeat
from operator import attrgetter, lt, mul, sub
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..planning.boxes import Box
from ..planning.coverage import find_overlap
from ..planning.gcpause import paused_gc
from .dtypes import dtype_from_name, itemsize

INDEX_FORMAT = "distckpt-index"
INDEX_VERSION = 2
READABLE_INDEX_VERSIONS = (1, 2)
DEFAULT_BLOCK_BYTES = 1 << 18  # 256 KiB: bounds the over-read of a partial chunk read
MAX_NDIM = 64
MAX_NUMEL = 1 << 62

# File names are plain names inside the checkpoint directory: no separators, no "..".
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")

# The reference writer lists integer arrays of at most this many values as plain JSON arrays.
_PLAIN_MAX = 8
# Chunks of a tensor are written as a grid from this many cells on.
GRID_MIN_CELLS = 2
_ZLIB_LEVEL = 6


def is_safe_file_name(name: object) -> bool:
    return isinstance(name, str) and bool(_SAFE_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """A box of a tensor stored contiguously (row-major) at ``data_offset`` of ``file``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    data_offset: int
    nbytes: int
    crc32c: tuple[int, ...]  # one per ``block_bytes`` block of the chunk's bytes


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


_ITEMSIZES: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = itemsize(dtype_from_name(dtype))
    return size


class ChunkGrid:
    """The chunks of a tensor that are the cells of one regular grid (index version 2).

    ``cuts[a]`` are the cut points along axis ``a`` (strictly increasing, from 0 to the
    tensor's extent); cells are numbered in row-major order of their position in the grid.
    Cell ``k`` is stored in ``file_names[file_ids[k]]`` at ``data_offsets[k]``; its checksums
    are ``crcs[crc_starts[k]:crc_starts[k + 1]]`` (one per cell when ``crc_starts`` is None).
    """

    __slots__ = ("cuts", "file_names", "file_ids", "data_offsets", "crcs", "crc_starts", "itemsize",
                 "_counts", "_cache")

    def __init__(
        self,
        cuts: Sequence[Sequence[int]],
        file_names: Sequence[str],
        file_ids: Sequence[int],
        data_offsets: Sequence[int],
        crcs: Sequence[int],
        crc_starts: Sequence[int] | None,
        itemsize: int,
    ) -> None:
        self.cuts = cuts
        self.file_names = file_names
        self.file_ids = file_ids
        self.data_offsets = data_offsets
        self.crcs = crcs
        self.crc_starts = crc_starts
        self.itemsize = itemsize
        self._counts = [len(c) - 1 for c in cuts]
        self._cache: dict[int, ChunkEntry] = {}

    @property
    def num_cells(self) -> int:
        return math.prod(self._counts)

    def chunk(self, cell: int) -> ChunkEntry:
        """The chunk of cell number ``cell`` (built once, then cached)."""
        found = self._cache.get(cell)
        if found is not None:
            return found
        offset = []
        shape = []
        rest = cell
        for cuts, count in zip(reversed(self.cuts), reversed(self._counts)):
            rest, i = divmod(rest, count)
            offset.append(cuts[i])
            shape.append(cuts[i + 1] - cuts[i])
        offset.reverse()
        shape.reverse()
        if self.crc_starts is None:
            crcs: tuple[int, ...] = (self.crcs[cell],)
        else:
            crcs = tuple(self.crcs[self.crc_starts[cell] : self.crc_starts[cell + 1]])
        chunk = ChunkEntry(tuple(offset), tuple(shape), self.file_names[self.file_ids[cell]],
                           self.data_offsets[cell], math.prod(shape) * self.itemsize, crcs)
        self._cache[cell] = chunk
        return chunk

    def chunks(self) -> list[ChunkEntry]:
        """Every chunk, in row-major order of the cells (that is, sorted by offset)."""
        return [self.chunk(cell) for cell in range(self.num_cells)]

    def overlapping(self, box: Box) -> list[ChunkEntry]:
        """The chunks sharing at least one element with ``box``."""
        ranges = []
        for cuts, count, lo, size in zip(self.cuts, self._counts, box.offset, box.shape):
            hi = lo + size
            first = max(bisect_right(cuts, lo) - 1, 0)
            last = min(bisect_left(cuts, hi), count)
            if size <= 0 or first >= last:
                return []
            ranges.append(range(first, last))
        strides = list(accumulate(reversed(self._counts[1:]), mul, initial=1))[::-1]
        cells = [sum(i * s for i, s in zip(position, strides)) for position in product(*ranges)]
        return [self.chunk(cell) for cell in cells]

    def file_set(self) -> set[str]:
        return {self.file_names[i] for i in set(self.file_ids)}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkGrid):
            return NotImplemented
        return self.chunks() == other.chunks()

    __hash__ = None  # type: ignore[assignment]


class TensorEntry:
    """A global tensor of the checkpoint: dtype, global shape and the chunks holding it.

    ``chunks`` is a plain list (the writer appends to it). An entry parsed from an index of
    version 2 may instead hold its chunks as a :class:`ChunkGrid`; ``chunks`` then builds the
    whole list on first use, while :meth:`overlapping` looks up only the chunks it needs.
    """

    __slots__ = ("dtype", "shape", "_chunks", "_grid", "_lookup")

    def __init__(self, dtype: str, shape: tuple[int, ...], chunks: list[ChunkEntry] | None = None,
                 grid: ChunkGrid | None = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self._chunks: list[ChunkEntry] = [] if chunks is None else chunks
        self._grid = grid
        self._lookup: _ChunkLookup | None = None

    @property
    def chunks(self) -> list[ChunkEntry]:
        grid = self._grid
        if grid is not None:
            merged = self._chunks + grid.chunks()
            merged.sort(key=attrgetter("offset"))
            self._chunks = merged
            self._grid = None
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[ChunkEntry]) -> None:
        self._chunks = value
        self._grid = None

    @property
    def grid(self) -> ChunkGrid | None:
        """The compact chunk table, while ``chunks`` has not been built from it."""
        return self._grid

    @property
    def num_chunks(self) -> int:
        grid = self._grid
        return len(self._chunks) + (grid.num_cells if grid is not None else 0)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    def overlapping(self, box: Box) -> list[ChunkEntry]:
        """The chunks that may share elements with ``box`` (every one that does, and few
        others): found by bisection, not by scanning every chunk."""
        if not box.offset:
            return self.chunks
        found: list[ChunkEntry] = []
        grid = self._grid
        if grid is not None:
            found = grid.overlapping(box)
            if not self._chunks:
                return found
        lookup = self._lookup
        if lookup is None or not lookup.valid_for(self._chunks):
            lookup = self._lookup = _ChunkLookup(self._chunks)
        return found + lookup.overlapping(box) if found else lookup.overlapping(box)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.dtype, self.shape) == (other.dtype, other.shape) and (
            sorted(self.chunks, key=attrgetter("offset")) == sorted(other.chunks, key=attrgetter("offset"))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorEntry(dtype={self.dtype!r}, shape={self.shape!r}, chunks={self.num_chunks})"


class _ChunkLookup:
    """Chunks sorted by their start along one axis, for interval queries by bisection."""

    _LINEAR = 16  # below this many chunks a scan is as fast

    def __init__(self, chunks: list[ChunkEntry]) -> None:
        self.source = chunks
        self.length = len(chunks)
        live = [c for c in chunks if 0 not in c.shape]
        self.axis = 0
        if len(live) > self._LINEAR and live[0].offset:
            ndim = len(live[0].offset)
            self.axis = max(range(ndim), key=lambda a: len({c.offset[a] for c in live}))
        axis = self.axis
        live.sort(key=lambda c: c.offset[axis] if c.offset else 0)
        self.chunks = live
        self.starts = [c.offset[axis] for c in live] if live and live[0].offset else []
        self.longest = max((c.shape[axis] for c in live), default=0) if self.starts else 0

    def valid_for(self, chunks: list[ChunkEntry]) -> bool:
        return chunks is self.source and len(chunks) == self.length

    def overlapping(self, box: Box) -> list[ChunkEntry]:
        axis = self.axis
        lo, hi = box.offset[axis], box.offset[axis] + box.shape[axis]
        if len(self.chunks) <= self._LINEAR:
            candidates: Iterable[ChunkEntry] = self.chunks
        else:
            first = bisect_right(self.starts, lo - self.longest)
            candidates = self.chunks[first : bisect_left(self.starts, hi)]
        return [c for c in candidates if c.offset[axis] < hi and c.offset[axis] + c.shape[axis] > lo]


@dataclass
class CheckpointIndex:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    block_bytes: int = DEFAULT_BLOCK_BYTES

    @property
    def files(self) -> list[str]:
        names: set[str] = set()
        for t in self.tensors.values():
            names.update(map(_FILE, t._chunks))
            if t._grid is not None:
                names.update(t._grid.file_set())
        names.update(o.file for o in self.objects.values())
        return sorted(names)

    def to_json(self) -> bytes:
        """The index document, version 2 (``docs/format.md`` section 4)."""
        with paused_gc():
            return _IndexWriter(self).document()

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> "CheckpointIndex":
        """Parse an index of version 1 or 2; raise CorruptCheckpointError naming ``path``."""
        with paused_gc():
            return _IndexParser(path).parse(raw)


def num_blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def cell_nbytes(cuts: Sequence[Sequence[int]], itemsize: int) -> list[int]:
    """Byte size of every cell of a grid, in row-major order."""
    sizes = [itemsize]
    for axis in cuts:
        widths = list(map(sub, axis[1:], axis[:-1]))
        if len(sizes) == 1:
            sizes = list(map(mul, widths, repeat(sizes[0], len(widths))))
        elif len(widths) == 1:
            sizes = list(map(mul, sizes, repeat(widths[0], len(sizes))))
        else:
            sizes = [s * w for s in sizes for w in widths]
    return sizes


def _largest_cell(cuts: Sequence[Sequence[int]], itemsize: int) -> int:
    return math.prod(max(map(sub, axis[1:], axis[:-1])) for axis in cuts) * itemsize


# ---------------------------------------------------------------------------------------------
# Packed integer arrays (section 4.8 of docs/format.md)

_PACKED_TYPES = {  # name -> (width, signed)
    "uint8": (1, False), "uint16": (2, False), "uint32": (4, False), "uint64": (8, False),
    "int8": (1, True), "int16": (2, True), "int32": (4, True), "int64": (8, True),
}


def _typecode(width: int, signed: bool) -> str:
    for code in ("bhilq" if signed else "BHILQ"):
        if array(code).itemsize == width:
            return code
    raise RuntimeError(f"no array type of {width} bytes")  # pragma: no cover


_TYPECODES = {name: _typecode(width, signed) for name, (width, signed) in _PACKED_TYPES.items()}
_BIG_ENDIAN = sys.byteorder == "big"


def _smallest_type(lo: int, hi: int) -> str:
    for name, (width, signed) in _PACKED_TYPES.items():
        bits = 8 * width
        if signed and -(1 << (bits - 1)) <= lo and hi < 1 << (bits - 1):
            return name
        if not signed and lo >= 0 and hi < 1 << bits:
            return name
    raise ValueError(f"values in [{lo}, {hi}] do not fit 64 bits")


def pack_ints(values: Sequence[int], *, delta: bool = False, compress: bool = False,
              plain_max: int = _PLAIN_MAX) -> list[int] | dict[str, Any]:
    """Encode integers as an IntArray: a plain JSON array when short, else a packed object."""
    if len(values) <= plain_max:
        return list(values)
    stored: Sequence[int] = values
    if delta:
        stored = [values[0], *map(sub, values[1:], values[:-1])]
    name = _smallest_type(min(stored), max(stored))
    code = _TYPECODES[name]
    packed = stored if isinstance(stored, array) and stored.typecode == code else array(code, stored)
    if _BIG_ENDIAN:  # pragma: no cover
        packed = array(code, packed)
        packed.byteswap()
    raw = packed.tobytes()
    doc: dict[str, Any] = {"dtype": name, "count": len(values)}
    if delta:
        doc["delta"] = True
    if compress:
        raw = zlib.compress(raw, _ZLIB_LEVEL)
        doc["zlib"] = True
    doc["data"] = base64.b64encode(raw).decode("ascii")
    return doc


# ---------------------------------------------------------------------------------------------
# Writer


class _IndexWriter:
    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self.batches = _ChunkColumns.read(index)
        names: set[str] = set()
        for batch in self.batches:
            names.update(batch.files)
        batched = {key for batch in self.batches for key in batch.keys}
        for key, t in index.tensors.items():
            if key not in batched:  # (a batch has the files of all its chunks)
                names.update(map(_FILE, t._chunks))
            if t._grid is not None:
                names.update(t._grid.file_set())
        names.update(o.file for o in index.objects.values())
        self.files = sorted(names)
        self.file_ids = {name: i for i, name in enumerate(self.files)}
        self.columns: dict[str, tuple[_ChunkColumns, int]] = {
            key: (batch, j) for batch in self.batches for j, key in enumerate(batch.keys)
        }

    def document(self) -> bytes:
        index = self.index
        doc: dict[str, Any] = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "checksum": {"algorithm": "crc32c", "block_bytes": index.block_bytes},
            "files": self.files,
            "tensors": {key: self.tensor(key, t) for key, t in index.tensors.items()},
            "objects": {
                key: {
                    "key": o.key,
                    "global_shape": list(o.global_shape),
                    "global_offset": list(o.global_offset),
                    "file": self.file_ids[o.file],
                    "data_offset": o.data_offset,
                    "nbytes": o.nbytes,
                    "crc32c": list(o.crc32c),
                }
                for key, o in index.objects.items()
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def chunk(self, c: ChunkEntry) -> dict[str, Any]:
        return {
            "offset": list(c.offset),
            "shape": list(c.shape),
            "file": self.file_ids[c.file],
            "data_offset": c.data_offset,
            "nbytes": c.nbytes,
            "crc32c": list(c.crc32c),
        }

    def tensor(self, key: str, t: TensorEntry) -> dict[str, Any]:
        doc: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
        grid = t.grid
        explicit = t._chunks
        if grid is None:
            found = None
            if key in self.columns:
                batch, j = self.columns[key]
                found = self.grid_from_columns(t, batch, j)
            if found is None:
                found = self.find_grid(t)
            if found is not None:
                grid, explicit = found
        doc["chunks"] = [self.chunk(c) for c in explicit]
        if grid is not None:
            doc["grid"] = self.grid(grid)
        return doc

    def grid_from_columns(self, t: TensorEntry, batch: _ChunkColumns, j: int
                          ) -> tuple[ChunkGrid, list[ChunkEntry]] | None:
        """:meth:`find_grid` from columns read position-major (same result, or None to let
        find_grid decide)."""
        ndim = batch.ndim
        starts = [batch.axis(batch.offsets, j, a) for a in range(ndim)]
        sizes = [batch.axis(batch.shapes, j, a) for a in range(ndim)]
        nbytes = batch.column(batch.nbytes, j)
        data_offsets = batch.column(batch.data_offsets, j)
        file_names = batch.files[j :: len(batch.keys)]
        crc_counts = batch.column(batch.crc_counts, j)
        empty: list[ChunkEntry] = []
        if 0 in nbytes:
            keep = [bool(n) for n in nbytes]
            empty = list(compress(t._chunks, [not k for k in keep]))
            starts = [array("q", compress(c, keep)) for c in starts]
            sizes = [array("q", compress(c, keep)) for c in sizes]
            nbytes, data_offsets, crc_counts = (array("q", compress(c, keep))
                                                for c in (nbytes, data_offsets, crc_counts))
            file_names = list(compress(file_names, keep))
        count = len(nbytes)
        if count < GRID_MIN_CELLS:
            return None
        points = [sorted(set(column)) for column in starts]
        if math.prod(map(len, points)) != count:
            return None
        if any(p[0] != 0 or p[-1] >= n for p, n in zip(points, t.shape)):
            return None
        cuts = [p + [n] for p, n in zip(points, t.shape)]
        widths = [list(map(sub, axis[1:], axis[:-1])) for axis in cuts]
        for axis in range(ndim):  # row-major order of the cells, compared column by column
            inner = math.prod(len(p) for p in points[axis + 1 :])
            outer = count // (inner * len(points[axis]))
            for actual, values in ((starts[axis], points[axis]), (sizes[axis], widths[axis])):
                if inner == 1:
                    expected = array("q", values)
                else:
                    expected = array("q", chain.from_iterable(map(repeat, values, repeat(inner))))
                if actual != expected * outer:
                    return None
        size = _itemsize(t.dtype)
        block = self.index.block_bytes
        if nbytes != array("q", cell_nbytes(cuts, size)):
            return None
        crc_starts = None
        if _largest_cell(cuts, size) <= block:
            if crc_counts.count(1) != count:
                return None
        else:
            counts = [-(-n // block) for n in nbytes]
            if list(crc_counts) != counts:
                return None
            crc_starts = list(accumulate(counts, initial=0))
        if batch.crcs is not None:
            crcs: Sequence[int] = batch.crcs[j :: len(batch.keys)]
            if empty:
                crcs = array(batch.crcs.typecode, compress(crcs, keep))
        else:
            crcs = list(chain.from_iterable(c.crc32c for c in t._chunks if c.nbytes))
        grid = ChunkGrid(cuts, self.files, array("q", map(self.file_ids.__getitem__, file_names)),
                         data_offsets, crcs, crc_starts, size)
        return grid, empty

    def grid(self, grid: ChunkGrid) -> dict[str, Any]:
        file_ids: Sequence[int] = grid.file_ids
        if grid.file_names is not self.files:  # a grid read from another index: renumber
            remap = {i: self.file_ids[grid.file_names[i]] for i in set(file_ids)}
            file_ids = list(map(remap.__getitem__, file_ids))
        return {
            "cuts": [pack_ints(axis, delta=True, compress=True) for axis in grid.cuts],
            "file": pack_ints(file_ids, delta=True, compress=True),
            "data_offset": pack_ints(grid.data_offsets, delta=True, compress=True),
            "crc32c": pack_ints(grid.crcs),
        }

    def find_grid(self, t: TensorEntry) -> tuple[ChunkGrid, list[ChunkEntry]] | None:
        """The grid formed by the chunks with elements, if they form one covering the tensor
        (and the chunks without elements, listed apart)."""
        chunks = t._chunks
        shape = t.shape
        if len(chunks) < GRID_MIN_CELLS or not shape:
            return None
        # One pass over the chunk objects (at scale they are scattered in memory: touch each
        # once), then work on the columns.
        offsets, shapes, nbytes, files, data_offsets, crc_lists = map(list, zip(*map(_CHUNK_FIELDS, chunks)))
        empty: list[ChunkEntry] = []
        if 0 in nbytes:
            empty = [c for c, n in zip(chunks, nbytes) if not n]
            keep = [bool(n) for n in nbytes]
            offsets, shapes, nbytes, files, data_offsets, crc_lists = (
                [v for v, k in zip(column, keep) if k]
                for column in (offsets, shapes, nbytes, files, data_offsets, crc_lists)
            )
        count = len(offsets)
        if count < GRID_MIN_CELLS or set(map(len, offsets)) != {len(shape)}:
            return None
        starts = [sorted(set(axis)) for axis in zip(*offsets)]
        if math.prod(map(len, starts)) != count:
            return None
        if any(s[0] != 0 or s[-1] >= n for s, n in zip(starts, shape)):
            return None
        cell_offsets = list(product(*starts))
        if offsets != cell_offsets:  # not in row-major order: sort the columns by offset
            order = sorted(range(count), key=offsets.__getitem__)
            offsets, shapes, nbytes, files, data_offsets, crc_lists = (
                [column[i] for i in order]
                for column in (offsets, shapes, nbytes, files, data_offsets, crc_lists)
            )
            if offsets != cell_offsets:
                return None
        cuts = [s + [n] for s, n in zip(starts, shape)]
        if shapes != list(product(*[list(map(sub, axis[1:], axis[:-1])) for axis in cuts])):
            return None
        size = _itemsize(t.dtype)
        block = self.index.block_bytes
        if nbytes != cell_nbytes(cuts, size):
            return None
        crc_starts = None
        if _largest_cell(cuts, size) <= block:
            if list(map(len, crc_lists)) != [1] * count:
                return None
        else:
            counts = [-(-n // block) for n in nbytes]
            if list(map(len, crc_lists)) != counts:
                return None
            crc_starts = list(accumulate(counts, initial=0))
        grid = ChunkGrid(
            cuts,
            self.files,
            list(map(self.file_ids.__getitem__, files)),
            data_offsets,
            list(chain.from_iterable(crc_lists)),
            crc_starts,
            size,
        )
        return grid, empty


_CHUNK_FIELDS = attrgetter("offset", "shape", "nbytes", "file", "data_offset", "crc32c")
_OFFSET = attrgetter("offset")
_SHAPE = attrgetter("shape")
_NBYTES = attrgetter("nbytes")
_FILE = attrgetter("file")
_DATA_OFFSET = attrgetter("data_offset")
_CRC32C = attrgetter("crc32c")
_CRC_TYPECODE = _typecode(4, False)


class _ChunkColumns:
    """The chunks of tensors with equally many chunks and axes, read position by position.

    At scale the chunks of one tensor come from thousands of ranks and lie far apart in memory,
    while the chunks at the same position of different tensors were typically written by the
    same rank and lie together. Reading them position by position, with C-level operations,
    into flat arrays touches each chunk once, in memory order; a tensor's values are then
    strided slices (tensor ``j`` of ``m``: ``values[j::m]``).
    """

    def __init__(self, keys: list[str], ndim: int) -> None:
        self.keys = keys
        self.ndim = ndim
        self.offsets = array("q")
        self.shapes = array("q")
        self.nbytes = array("q")
        self.data_offsets = array("q")
        self.crc_counts = array("q")
        self.crcs: array | None = array(_CRC_TYPECODE)
        self.files: list[str] = []

    @classmethod
    def read(cls, index: CheckpointIndex) -> list[_ChunkColumns]:
        groups: dict[tuple[int, int], list[str]] = {}
        for key, t in index.tensors.items():
            if t._grid is None and len(t._chunks) >= GRID_MIN_CELLS and t.shape:
                groups.setdefault((len(t._chunks), len(t.shape)), []).append(key)
        batches = []
        for (_, ndim), keys in groups.items():
            batch = cls(keys, ndim)
            try:
                batch.fill([index.tensors[key]._chunks for key in keys])
            except (TypeError, OverflowError):  # not integers of 64 bits: leave it to find_grid
                continue
            batches.append(batch)
        return batches

    def fill(self, lists: list[list[ChunkEntry]]) -> None:
        ndim = self.ndim
        for row in zip(*lists):
            offsets = list(chain.from_iterable(map(_OFFSET, row)))
            shapes = list(chain.from_iterable(map(_SHAPE, row)))
            if len(offsets) != ndim * len(row) or len(shapes) != ndim * len(row):
                raise TypeError("chunk with another number of axes")
            self.offsets.extend(offsets)
            self.shapes.extend(shapes)
            self.nbytes.extend(map(_NBYTES, row))
            self.data_offsets.extend(map(_DATA_OFFSET, row))
            self.files.extend(map(_FILE, row))
            crcs = list(map(_CRC32C, row))
            counts = list(map(len, crcs))
            self.crc_counts.extend(counts)
            if self.crcs is not None:
                if counts.count(1) == len(counts):
                    self.crcs.extend(chain.from_iterable(crcs))
                elif max(counts) <= 1:  # one value per chunk (a placeholder for empty chunks)
                    self.crcs.extend([c[0] if c else 0 for c in crcs])
                else:
                    self.crcs = None  # taken from the chunks instead
        if list(map(len, (self.offsets, self.shapes))) != [ndim * len(self.nbytes)] * 2:
            raise TypeError("inconsistent chunk axes")

    def axis(self, source: array, j: int, axis: int) -> array:
        return source[j * self.ndim + axis :: len(self.keys) * self.ndim]

    def column(self, source: array, j: int) -> array:
        return source[j :: len(self.keys)]


# ---------------------------------------------------------------------------------------------
# Reader


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
        if type(version) is not int or version not in READABLE_INDEX_VERSIONS:
            raise UnsupportedFormatError(
                f"{self.path}: index version {version!r:.20} is not supported by this release "
                f"(reads versions {', '.join(map(str, READABLE_INDEX_VERSIONS))}); upgrade distckpt"
            )
        self.version = version
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
        size = _itemsize(dtype) if isinstance(dtype, str) else None
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
            entry._chunks.append(
                ChunkEntry(
                    offset,
                    cshape,
                    self.file_ref(self.get(c, "file", cw), files, cw + " file"),
                    self.int_(self.get(c, "data_offset", cw), cw + " data_offset"),
                    nbytes,
                    self.crcs(self.get(c, "crc32c", cw), nbytes, block_bytes, cw + " crc32c"),
                )
            )
        if self.version >= 2 and "grid" in t:
            entry._grid = self.grid(where + " grid", self.obj(t["grid"], where + " grid"), shape, size,
                                    files, block_bytes)
            if any(c.nbytes for c in entry._chunks):
                raise self.fail(where, "a tensor with a grid may list only chunks without elements")
            return entry
        overlap = find_overlap([Box(c.offset, c.shape) for c in entry._chunks])
        if overlap is not None:
            raise self.fail(where, f"chunks {overlap[0]} and {overlap[1]} overlap in region "
                                   f"{overlap[2].describe()}")
        return entry

    def grid(self, where: str, g: dict, shape: tuple[int, ...], size: int, files: list,
             block_bytes: int) -> ChunkGrid:
        if not shape:
            raise self.fail(where, "a 0-dimensional tensor cannot have a grid")
        # The checksums come first: there is at least one per cell and they are stored without
        # compression, so their number bounds the size of everything else.
        crcs = self.int_array(self.get(g, "crc32c", where), where + " crc32c", None, 0, 0xFFFFFFFF,
                              packed_types=("uint32",), allow_zlib=False)
        bound = len(crcs)
        cuts_raw = self.get(g, "cuts", where)
        if not isinstance(cuts_raw, list) or len(cuts_raw) != len(shape):
            raise self.fail(where + " cuts", f"expected {len(shape)} arrays of cut points, one per axis")
        cuts = []
        for axis, (value, extent) in enumerate(zip(cuts_raw, shape)):
            aw = f"{where} cuts[{axis}]"
            points = self.int_array(value, aw, None, 0, extent, max_count=bound + 1)
            if len(points) < 2 or points[0] != 0 or points[-1] != extent or not all(
                map(lt, points[:-1], points[1:])
            ):
                raise self.fail(aw, f"cut points must increase strictly from 0 to {extent}")
            cuts.append(points)
        cells = math.prod(len(c) - 1 for c in cuts)
        if cells > bound:
            raise self.fail(where, f"{cells} cells but only {bound} crc32c values (at least one per cell)")
        if _largest_cell(cuts, size) > MAX_NUMEL:
            raise self.fail(where, "a cell holds more than 2**62 bytes")
        file_ids = self.int_array(self.get(g, "file", where), where + " file", cells, 0, len(files) - 1)
        data_offsets = self.int_array(self.get(g, "data_offset", where), where + " data_offset", cells, 0,
                                      MAX_NUMEL)
        crc_starts = None
        if _largest_cell(cuts, size) <= block_bytes:
            expected = cells
        else:
            crc_starts = list(accumulate((-(-n // block_bytes) for n in cell_nbytes(cuts, size)), initial=0))
            expected = crc_starts[-1]
        if len(crcs) != expected:
            raise self.fail(where + " crc32c", f"expected {expected} crc32c values for the cells, got "
                                               f"{len(crcs)}")
        return ChunkGrid(cuts, files, file_ids, data_offsets, crcs, crc_starts, size)

    def int_array(
        self,
        value: Any,
        where: str,
        count: int | None,
        lo: int,
        hi: int,
        *,
        max_count: int | None = None,
        packed_types: Sequence[str] = tuple(_PACKED_TYPES),
        allow_zlib: bool = True,
    ) -> Sequence[int]:
        """Decode an IntArray of ``count`` values (any number up to ``max_count`` if None),
        each in [lo, hi]."""
        if isinstance(value, list):
            if count is not None and len(value) != count:
                raise self.fail(where, f"expected {count} values, got {len(value)}")
            if max_count is not None and len(value) > max_count:
                raise self.fail(where, f"expected at most {max_count} values")
            for v in value:
                if type(v) is not int or not lo <= v <= hi:
                    raise self.fail(where, f"expected integers in [{lo}, {hi}], got {v!r:.60}")
            return value
        if not isinstance(value, dict):
            raise self.fail(where, "expected an array of integers or a packed array object")
        name = value.get("dtype")
        if not isinstance(name, str) or name not in packed_types:
            raise self.fail(where, f"dtype must be one of {list(packed_types)}, got {name!r:.40}")
        width = _PACKED_TYPES[name][0]
        n = self.int_(self.get(value, "count", where), where + " count")
        if count is not None and n != count:
            raise self.fail(where, f"expected {count} values, got count {n}")
        if max_count is not None and n > max_count:
            raise self.fail(where, f"expected at most {max_count} values, got count {n}")
        delta = value.get("delta", False)
        compressed = value.get("zlib", False)
        if type(delta) is not bool or type(compressed) is not bool:
            raise self.fail(where, "delta and zlib must be true or false")
        if compressed and not allow_zlib:
            raise self.fail(where, "this array must not be compressed")
        if delta and not allow_zlib:
            raise self.fail(where, "this array must not be delta-coded")
        data = self.get(value, "data", where)
        if not isinstance(data, str):
            raise self.fail(where, "data must be a base64 string")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise self.fail(where, "data is not valid base64") from None
        size = n * width
        if compressed:
            inflater = zlib.decompressobj()
            try:
                raw = inflater.decompress(raw, size + 1)
            except zlib.error as exc:
                raise self.fail(where, f"data is not a valid zlib stream ({exc})") from None
            if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
                raise self.fail(where, f"zlib stream does not hold exactly {size} bytes")
        if len(raw) != size:
            raise self.fail(where, f"expected {size} bytes of data for {n} values, got {len(raw)}")
        values = array(_TYPECODES[name])
        values.frombytes(raw)
        if _BIG_ENDIAN:  # pragma: no cover
            values.byteswap()
        result: Sequence[int] = values
        if delta:
            result = array("q")
            try:
                result.extend(accumulate(values))
            except OverflowError:
                raise self.fail(where, f"values must lie in [{lo}, {hi}]") from None
        if n and (min(result) < lo or max(result) > hi):
            raise self.fail(where, f"values must lie in [{lo}, {hi}]")
        return result

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
