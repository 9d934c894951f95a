"""Box geometry: intersections and the decomposition of flat ranges into boxes.

A box is an ``(offset, shape)`` pair of equal-length integer tuples, in element coordinates.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Box(NamedTuple):
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def describe(self) -> str:
        """Human-readable region, e.g. ``[0:4, 8:16]``."""
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.shape)) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or ``None`` if it holds no element."""
    offset = []
    shape = []
    for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape):
        lo = max(ao, bo)
        hi = min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offset), tuple(shape))


def relative(inner: Box, outer_offset: tuple[int, ...]) -> Box:
    """``inner`` expressed relative to a box starting at ``outer_offset``."""
    return Box(tuple(i - o for i, o in zip(inner.offset, outer_offset)), inner.shape)


class FlatPiece(NamedTuple):
    """A box inside a shape whose elements are ``flat_start : flat_start + volume`` of the
    row-major flattening of that shape, in the same order."""

    box: Box
    flat_start: int


def flat_range_to_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[FlatPiece]:
    """Decompose the flat range ``[start, stop)`` of a row-major ``shape`` into boxes.

    At most ``2 * ndim - 1`` boxes come back, in increasing flat order; each is contiguous in
    the flattening, so it is a plain slice of the flat data.
    """
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside shape {shape}")
    pieces: list[FlatPiece] = []
    _decompose(tuple(shape), start, stop, (), pieces, start)
    return pieces


def _decompose(
    shape: tuple[int, ...],
    start: int,
    stop: int,
    prefix: tuple[int, ...],
    out: list[FlatPiece],
    flat_base: int,
) -> None:
    # Invariant: [start, stop) is relative to the sub-array addressed by ``prefix``;
    # ``flat_base`` is the position of ``start`` in the caller's flat data.
    if start >= stop:
        return
    if not shape:
        out.append(FlatPiece(Box(prefix, (1,) * len(prefix)), flat_base))
        return
    inner = math.prod(shape[1:])
    rest = len(shape) - 1

    def whole_rows(first: int, last: int, base: int) -> None:
        out.append(
            FlatPiece(
                Box(prefix + (first,) + (0,) * rest, (1,) * len(prefix) + (last - first,) + shape[1:]),
                base,
            )
        )

    first_row, first_in = divmod(start, inner)
    last_row, last_in = divmod(stop, inner)
    if first_row == last_row:
        _decompose(shape[1:], first_in, last_in, prefix + (first_row,), out, flat_base)
        return
    base = flat_base
    if first_in:
        _decompose(shape[1:], first_in, inner, prefix + (first_row,), out, base)
        base += inner - first_in
        first_row += 1
    if last_row > first_row:
        whole_rows(first_row, last_row, base)
        base += (last_row - first_row) * inner
    if last_in:
        _decompose(shape[1:], 0, last_in, prefix + (last_row,), out, base)


def is_contiguous_region(region: Box, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` (relative to an array of ``shape``) is one contiguous run of the
    row-major layout: leading axes of length 1, then one partial axis, then full axes."""
    if region.volume == 0:
        return True
    ndim = len(shape)
    k = 0
    while k < ndim and region.shape[k] == 1:
        k += 1
    return all(region.shape[j] == shape[j] for j in range(k + 1, ndim))
