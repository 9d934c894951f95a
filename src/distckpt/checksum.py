"""crc32c (Castagnoli), hardware-accelerated by the ``crc32c`` package, which releases the GIL
on large buffers so checksums run in parallel with I/O threads."""

from __future__ import annotations

from collections.abc import Iterable

import crc32c as _crc32c


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def block_crcs(data: memoryview, block_bytes: int) -> list[int]:
    """crc32c of each ``block_bytes`` block of ``data`` (the last one may be shorter)."""
    return [crc32c(data[i : i + block_bytes]) for i in range(0, len(data), block_bytes)]


def first_mismatch(data: memoryview, block_bytes: int, expected: Iterable[int]) -> int | None:
    """Index of the first block of ``data`` whose crc differs from ``expected``, if any."""
    for n, (i, want) in enumerate(zip(range(0, len(data), block_bytes), expected)):
        if crc32c(data[i : i + block_bytes]) != want:
            return n
    return None
