"""Re-read every byte of a checkpoint and check it against the recorded checksums."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from .. import checksum
from ..errors import CheckpointingException
from ..format.safetensors import MAX_HEADER_BYTES, parse_header
from ..storage import Storage
from .checkpoint import CheckpointReader


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(location: "str | os.PathLike | Storage") -> VerifyReport:
    """Check the commit marker, the index, the common state and every chunk and object.

    Problems are collected (one line each, naming the file and the tensor key) rather than
    raised, so one run reports everything that is wrong.
    """
    try:
        reader = CheckpointReader(location)
        index = reader.index
    except CheckpointingException as exc:
        path = location.root if isinstance(location, Storage) else os.fspath(location)
        return VerifyReport(path, [str(exc)])
    report = VerifyReport(reader.path)
    storage = reader.storage
    try:
        reader.read_whole(reader.metadata.common, what="common state")
        report.bytes_checked += reader.metadata.common.nbytes
    except CheckpointingException as exc:
        report.problems.append(str(exc))

    by_file: dict[str, list[tuple[str, int, int, tuple[int, ...]]]] = {}
    for key, entry in index.tensors.items():
        for chunk in entry.chunks:
            label = f"tensor {key!r} chunk at offset {list(chunk.offset)}"
            by_file.setdefault(chunk.file, []).append((label, chunk.data_offset, chunk.nbytes, chunk.crc32c))
    for unique_key, obj in index.objects.items():
        by_file.setdefault(obj.file, []).append(
            (f"object {unique_key!r}", obj.data_offset, obj.nbytes, obj.crc32c)
        )
    for name, items in sorted(by_file.items()):
        report.files += 1
        where = storage.describe(name)
        try:
            size = storage.size(name)
        except FileNotFoundError:
            keys = ", ".join(label for label, *_ in items[:3])
            report.problems.append(f"{where}: data file is missing (holds {keys}{', ...' if len(items) > 3 else ''})")
            continue
        try:
            _check_header(storage, name, size)
        except CheckpointingException as exc:
            report.problems.append(str(exc))
        for label, offset, nbytes, crcs in items:
            report.chunks += 1
            if offset + nbytes > size:
                report.problems.append(
                    f"{where}: {label} needs bytes {offset}..{offset + nbytes} but the file has "
                    f"{size} bytes (truncated)"
                )
                continue
            data = bytearray(nbytes)
            if nbytes:
                storage.read_into(name, offset, memoryview(data))
            bad = checksum.first_mismatch(memoryview(data), index.block_bytes, crcs)
            if bad is not None:
                report.problems.append(
                    f"{where}: checksum mismatch in {label} (block {bad}, file bytes "
                    f"{offset + bad * index.block_bytes}..)"
                )
            report.bytes_checked += nbytes
    return report


def _check_header(storage: Storage, name: str, size: int) -> None:
    """The data file must start with a parseable safetensors header."""
    where = storage.describe(name)
    if size < 8:
        raise CheckpointingException(f"{where}: {size} bytes is too short for a safetensors file")
    prefix = bytearray(8)
    storage.read_into(name, 0, memoryview(prefix))
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointingException(f"{where}: safetensors header length {length} is invalid")
    head = bytearray(8 + length)
    storage.read_into(name, 0, memoryview(head))
    parse_header(bytes(head), where)
