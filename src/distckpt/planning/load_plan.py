"""What a rank reads: for each requested shard, the saved chunks it overlaps and the byte
ranges to fetch. Pure: works on the index and plain shard descriptions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CorruptCheckpointError
from ..format.index import ChunkEntry, TensorEntry
from .boxes import Box, intersect, is_contiguous_region, relative
from .gcpause import paused_gc
from .shards import TensorShard


@dataclass(frozen=True)
class Copy:
    """Copy ``shape`` elements from ``src_offset`` (relative to the chunk) to ``dst_offset``
    relative to the destination view: request ``request`` viewed as ``dst_view_shape`` starting
    at element ``dst_flat_start`` of its flattened data."""

    request: int
    dst_flat_start: int
    dst_view_shape: tuple[int, ...]
    dst_offset: tuple[int, ...]
    src_offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def dst_contiguous(self) -> bool:
        return is_contiguous_region(Box(self.dst_offset, self.shape), self.dst_view_shape)


@dataclass
class ChunkRead:
    """Read ``[read_start, read_stop)`` (bytes relative to the chunk start, aligned to checksum
    blocks) of ``chunk`` and perform ``copies`` from it; ``rows`` is the range along the chunk's
    first axis those bytes fully contain."""

    key: str
    chunk: ChunkEntry
    itemsize: int
    copies: list[Copy] = field(default_factory=list)
    read_start: int = 0
    read_stop: int = 0
    rows: tuple[int, int] = (0, 0)

    @property
    def whole_chunk_to_contiguous_dst(self) -> bool:
        """One copy takes the whole chunk into a contiguous region: read straight into it."""
        if len(self.copies) != 1:
            return False
        copy = self.copies[0]
        return copy.shape == self.chunk.shape and copy.dst_contiguous


def plan_reads(
    requests: Sequence[TensorShard],
    tensors: dict[str, TensorEntry],
    block_bytes: int,
) -> list[ChunkRead]:
    """Plan the reads that fill every request from the saved chunks of ``tensors``.

    Requests must name keys present in ``tensors`` with matching dtypes (checked by the caller).
    Reads are ordered by file and offset so that the I/O is as sequential as possible. The
    chunks of each request are found by bisection (:meth:`TensorEntry.overlapping`), so the
    cost grows with what the rank reads, not with the number of chunks in the checkpoint.
    """
    with paused_gc():
        return _plan_reads(requests, tensors, block_bytes)


def _plan_reads(
    requests: Sequence[TensorShard],
    tensors: dict[str, TensorEntry],
    block_bytes: int,
) -> list[ChunkRead]:
    reads: dict[tuple[str, int], ChunkRead] = {}
    for request_id, request in enumerate(requests):
        entry = tensors[request.key]
        size = request.itemsize
        for piece in request.pieces():
            view_shape = piece.box.shape
            covered = 0
            for chunk in entry.overlapping(piece.box):
                common = intersect(piece.box, Box(chunk.offset, chunk.shape))
                if common is None:
                    continue
                covered += common.volume
                read = reads.get((chunk.file, chunk.data_offset))
                if read is None:
                    read = reads[(chunk.file, chunk.data_offset)] = ChunkRead(request.key, chunk, size)
                read.copies.append(
                    Copy(
                        request_id,
                        piece.flat_start,
                        view_shape,
                        relative(common, piece.box.offset).offset,
                        relative(common, chunk.offset).offset,
                        common.shape,
                    )
                )
            _check_covered(request.key, piece.box, entry.shape, covered)
    ordered = sorted(reads.values(), key=lambda r: (r.chunk.file, r.chunk.data_offset))
    for read in ordered:
        _set_byte_range(read, block_bytes)
    return ordered


def _check_covered(key: str, box: Box, saved_shape: tuple[int, ...], covered: int) -> None:
    # Chunks never overlap (the index parser checks), so counting elements finds holes. Only the
    # part of the request inside the saved extent can be covered (allow_shape_mismatch).
    inside = intersect(box, Box((0,) * len(saved_shape), saved_shape))
    expected = inside.volume if inside is not None else 0
    if covered != expected:
        raise CorruptCheckpointError(
            f"tensor {key!r}: the checkpoint has no data for {expected - covered} elements of the "
            f"requested region {box.describe()}; the checkpoint is incomplete (saved without "
            "validation from shards that left holes?) or its index was damaged"
        )


def _set_byte_range(read: ChunkRead, block_bytes: int) -> None:
    chunk = read.chunk
    if not chunk.shape:
        first, last = 0, 1
        row_bytes = chunk.nbytes
    else:
        first = min(c.src_offset[0] for c in read.copies)
        last = max(c.src_offset[0] + c.shape[0] for c in read.copies)
        row_bytes = math.prod(chunk.shape[1:]) * read.itemsize
    start, stop = first * row_bytes, last * row_bytes
    read.rows = (first, last)
    read.read_start = start - start % block_bytes
    read.read_stop = min(chunk.nbytes, -(-stop // block_bytes) * block_bytes)
