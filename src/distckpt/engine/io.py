"""Executes plans against storage: writes a rank's data files, fills tensors from chunks.

Bytes go straight from tensor memory to the storage writer and from storage into the
destination tensor when a chunk lines up with it; other reads land in one scratch buffer per
chunk and are copied out. Checksums are computed and verified on the same memory.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from .. import checksum
from ..errors import ChecksumError, CorruptCheckpointError, StorageError, TruncatedFileError
from ..format.dtypes import safetensors_code
from ..format.index import ChunkEntry, ObjectEntry
from ..format.safetensors import Entry, build_header
from ..planning.load_plan import ChunkRead, Copy
from ..planning.save_plan import ChunkWrite
from ..planning.shards import ObjectShard
from ..storage import Storage

if sys.byteorder != "little":  # pragma: no cover - no big-endian machine runs torch today
    raise ImportError("the distckpt format stores little-endian bytes; this machine is big-endian")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order, without a copy when it is contiguous."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # a single element may carry any stride; view(uint8) needs 1
        flat = flat.as_strided((1,), (1,))
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def chunk_name(key: str, box_offset: tuple[int, ...]) -> str:
    """Name of a chunk inside a safetensors data file (unique per file)."""
    return f"{key}@{','.join(map(str, box_offset))}"


def object_name(unique_key: str) -> str:
    return f"__object__/{unique_key}"


@dataclass
class _Blob:
    entry: Entry
    data: memoryview
    kind: str  # "chunk" or "object"
    ref: object  # ChunkWrite or ObjectShard


def write_rank_files(
    storage: Storage,
    file_stem: str,
    chunks: Sequence[ChunkWrite],
    shard_data: Sequence[torch.Tensor],
    objects: Sequence[tuple[ObjectShard, bytes]],
    block_bytes: int,
    file_count: int = 1,
) -> tuple[list[tuple[str, ChunkEntry]], list[tuple[str, ObjectEntry]]]:
    """Write this rank's chunks and serialized objects into ``file_count`` safetensors files.

    ``shard_data[i]`` is the CPU data of local shard ``i``; a :class:`ChunkWrite` takes a
    contiguous slice of its flattening. Files are filled in parallel, one thread each, and
    fsync'd. Returns the index records of what was written.
    """
    blobs: list[_Blob] = []
    flat_cache: dict[int, torch.Tensor] = {}
    for write in chunks:
        data = shard_data[write.shard_index]
        flat = flat_cache.get(write.shard_index)
        if flat is None:
            flat = flat_cache[write.shard_index] = (
                data.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
            )
        piece = flat[write.data_start : write.data_start + write.box.volume]
        view = tensor_bytes(piece)
        entry = Entry(chunk_name(write.key, write.box.offset), safetensors_code(data.dtype),
                      write.box.shape, len(view))
        blobs.append(_Blob(entry, view, "chunk", write))
    for shard, raw in objects:
        entry = Entry(object_name(shard.unique_key), "U8", (len(raw),), len(raw))
        blobs.append(_Blob(entry, memoryview(raw), "object", shard))
    if not blobs:
        return [], []

    # Spread blobs over the files by bytes (largest first to the emptiest file).
    file_count = max(1, min(file_count, len(blobs)))
    groups: list[list[_Blob]] = [[] for _ in range(file_count)]
    loads = [0] * file_count
    for blob in sorted(blobs, key=lambda b: -b.entry.nbytes):
        target = loads.index(min(loads))
        groups[target].append(blob)
        loads[target] += blob.entry.nbytes
    groups = [g for g in groups if g]
    for group in groups:
        group.sort(key=lambda b: (b.kind, b.entry.name))
    names = [f"{file_stem}-{i}.safetensors" for i in range(len(groups))]

    def write_file(name: str, group: list[_Blob]):
        header, offsets = build_header([b.entry for b in group], {"format": "distckpt"})
        writer = storage.open_writer(name)
        records = []
        try:
            writer.write(memoryview(header))
            for blob, offset in zip(group, offsets):
                crcs = tuple(checksum.block_crcs(blob.data, block_bytes))
                writer.write(blob.data)
                records.append((blob, offset, crcs))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return [(name, blob, offset, crcs) for blob, offset, crcs in records]

    if len(groups) == 1:
        results = [write_file(names[0], groups[0])]
    else:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="distckpt-write") as pool:
            results = list(pool.map(write_file, names, groups))

    tensor_records: list[tuple[str, ChunkEntry]] = []
    object_records: list[tuple[str, ObjectEntry]] = []
    for name, blob, offset, crcs in (r for result in results for r in result):
        if blob.kind == "chunk":
            chunk: ChunkWrite = blob.ref  # type: ignore[assignment]
            tensor_records.append(
                (chunk.key, ChunkEntry(chunk.box.offset, chunk.box.shape, name, offset,
                                       blob.entry.nbytes, crcs))
            )
        else:
            obj: ObjectShard = blob.ref  # type: ignore[assignment]
            object_records.append(
                (obj.unique_key, ObjectEntry(obj.key, obj.global_shape, obj.global_offset,
                                             name, offset, blob.entry.nbytes, crcs))
            )
    return tensor_records, object_records


# Adjacent byte ranges are merged into one read up to this size.
MAX_COALESCED_BYTES = 8 << 20  # bounds the scratch memory of a load


@dataclass
class ReadStats:
    bytes_read: int = 0
    chunks_read: int = 0
    requests: int = 0
    direct_reads: int = 0
    coalesced_reads: int = 0


class ChunkFiller:
    """Fills destination tensors from chunk bytes: reads them (directly into a destination
    where a chunk lines up with it), verifies their checksums and copies them out."""

    def __init__(
        self,
        storage: Storage,
        destinations: Sequence[torch.Tensor],
        dtypes: Sequence[torch.dtype],
        block_bytes: int,
    ) -> None:
        self.storage = storage
        self.flats = [d.reshape(-1) for d in destinations]
        self.dtypes = dtypes
        self.block_bytes = block_bytes

    def dst_region(self, copy: Copy) -> torch.Tensor:
        view_numel = math.prod(copy.dst_view_shape)
        view = self.flats[copy.request][copy.dst_flat_start : copy.dst_flat_start + view_numel]
        view = view.view(copy.dst_view_shape)
        return view[tuple(slice(o, o + s) for o, s in zip(copy.dst_offset, copy.shape))]

    def direct_region(self, read: ChunkRead) -> torch.Tensor | None:
        """The destination memory the whole chunk can be read into, if there is one."""
        if not read.whole_chunk_to_contiguous_dst:
            return None
        region = self.dst_region(read.copies[0])
        return region if region.is_contiguous() else None

    def verify(self, read: ChunkRead, data: memoryview, first_block: int) -> None:
        chunk = read.chunk
        block_bytes = self.block_bytes
        bad = checksum.first_mismatch(data, block_bytes, chunk.crc32c[first_block:])
        if bad is not None:
            block = first_block + bad
            raise ChecksumError(
                f"{self.storage.describe(chunk.file)}: checksum mismatch in tensor {read.key!r}, chunk "
                f"at offset {list(chunk.offset)} (bytes {chunk.data_offset + block * block_bytes}"
                f"..{chunk.data_offset + min(chunk.nbytes, (block + 1) * block_bytes)} of the "
                "file): the file is corrupt; restore it from a copy or load another checkpoint"
            )

    def read_span(self, read: ChunkRead) -> torch.Tensor:
        """Bytes [read_start, read_stop) of the chunk, verified."""
        buffer = torch.empty(read.read_stop - read.read_start, dtype=torch.uint8)
        if buffer.numel():
            view = memoryview(buffer.numpy())  # type: ignore[arg-type]
            _read_into(self.storage, read.key, read.chunk, read.chunk.data_offset + read.read_start, view)
            self.verify(read, view, read.read_start // self.block_bytes)
        return buffer

    def scatter(self, read: ChunkRead, buffer: torch.Tensor, verified: bool = False) -> None:
        """Copy ``buffer`` (bytes [read_start, read_stop) of the chunk) to the destinations."""
        chunk = read.chunk
        dtype = self.dtypes[read.copies[0].request]
        if not verified and buffer.numel():
            self.verify(read, memoryview(buffer.numpy()), read.read_start // self.block_bytes)  # type: ignore[arg-type]
        first, last = read.rows
        if chunk.shape:
            row_bytes = math.prod(chunk.shape[1:]) * read.itemsize
            base = first * row_bytes - read.read_start
            src = _as_dtype(buffer[base : base + (last - first) * row_bytes], dtype)
            src = src.view((last - first,) + chunk.shape[1:])
        else:
            src = _as_dtype(buffer, dtype).view(())
            first = 0
        for copy in read.copies:
            if not chunk.shape:
                self.dst_region(copy).copy_(src)
                continue
            index: tuple[slice, ...] = (slice(copy.src_offset[0] - first, copy.src_offset[0] - first + copy.shape[0]),)
            index += tuple(slice(o, o + s) for o, s in zip(copy.src_offset[1:], copy.shape[1:]))
            self.dst_region(copy).copy_(src[index])

    def run_direct(self, read: ChunkRead, region: torch.Tensor) -> int:
        view = tensor_bytes(region)
        _read_into(self.storage, read.key, read.chunk, read.chunk.data_offset, view)
        self.verify(read, view, 0)
        return len(view)

    def run_group(self, group: list[ChunkRead]) -> int:
        """One ranged read for chunks stored back to back, then scatter to each of them."""
        start = group[0].chunk.data_offset + group[0].read_start
        end = group[-1].chunk.data_offset + group[-1].read_stop
        buffer = torch.empty(end - start, dtype=torch.uint8)
        if end > start:
            view = memoryview(buffer.numpy())  # type: ignore[arg-type]
            _read_into(self.storage, _keys(group), group[0].chunk, start, view)
        for read in group:
            offset = read.chunk.data_offset + read.read_start - start
            self.scatter(read, buffer[offset : offset + read.read_stop - read.read_start])
        return end - start

    def run(self, reads: Sequence[ChunkRead], thread_count: int = 1) -> ReadStats:
        """Perform ``reads``: direct reads where a chunk lines up with its destination (and is
        not smaller than the storage's ``min_request_bytes``), the others coalesced into one
        request per run of adjacent byte ranges of a file."""
        stats = ReadStats()
        tasks: list[Callable[[], int]] = []
        group: list[ChunkRead] = []
        group_bytes = 0

        def flush() -> None:
            nonlocal group, group_bytes
            if group:
                tasks.append(partial(self.run_group, group))
                stats.coalesced_reads += len(group) - 1
            group, group_bytes = [], 0

        small = self.storage.min_request_bytes
        for read in reads:
            region = self.direct_region(read)
            if region is not None and read.read_stop - read.read_start >= small:
                tasks.append(partial(self.run_direct, read, region))
                stats.direct_reads += 1
                continue
            size = read.read_stop - read.read_start
            if group and (
                read.chunk.file != group[-1].chunk.file
                or read.chunk.data_offset + read.read_start != group[-1].chunk.data_offset + group[-1].read_stop
                or group_bytes + size > MAX_COALESCED_BYTES
            ):
                flush()
            group.append(read)
            group_bytes += size
        flush()
        sizes = run_tasks(tasks, max(thread_count, self.storage.read_concurrency), "distckpt-read")
        stats.bytes_read = sum(sizes)
        stats.chunks_read = len(reads)
        stats.requests = len(tasks)
        return stats


def run_tasks(tasks: Sequence[Callable[[], int]], thread_count: int, name: str) -> list[int]:
    if thread_count <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(thread_count, thread_name_prefix=name) as pool:
        return list(pool.map(lambda task: task(), tasks))


def execute_reads(
    storage: Storage,
    reads: Sequence[ChunkRead],
    destinations: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    block_bytes: int,
    thread_count: int = 1,
) -> ReadStats:
    """Perform ``reads``, filling ``destinations[request]`` (contiguous CPU tensors).

    Raises :class:`ChecksumError` naming the file, tensor and chunk when bytes do not match
    their recorded crc32c.
    """
    return ChunkFiller(storage, destinations, dtypes, block_bytes).run(reads, thread_count)


def _as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as ``dtype``; chunks packed after odd-sized ones may be misaligned in a
    coalesced buffer, and are then copied to an aligned one."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def _keys(group: list[ChunkRead]) -> str:
    more = f" (and {len(group) - 1} more chunks)" if len(group) > 1 else ""
    return f"{group[0].key}{more}"


def _read_into(storage: Storage, key: str, chunk: ChunkEntry, offset: int, view: memoryview) -> None:
    if not len(view):
        return
    try:
        storage.read_into(chunk.file, offset, view)
    except FileNotFoundError:
        raise StorageError(
            f"{storage.describe(chunk.file)}: data file is missing (holds tensor {key!r}); the "
            "checkpoint is incomplete or was damaged"
        ) from None
    except TruncatedFileError as exc:
        raise TruncatedFileError(
            f"{exc} while reading tensor {key!r}, chunk at offset {list(chunk.offset)}; the file "
            "was cut short: restore it or load another checkpoint"
        ) from None
    except (StorageError, CorruptCheckpointError):
        raise
    except OSError as exc:
        raise StorageError(f"{storage.describe(chunk.file)}: read failed: {exc}") from exc
