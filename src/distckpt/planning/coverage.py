"""Exact-cover check: do the main-replica boxes of a global tensor cover each element once?"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress
from operator import add, le

from .boxes import Box, intersect

# Above this many cells the hole finder gives up naming the region (the error still says how
# many elements are missing).
_MAX_GRID_CELLS = 1_000_000


def non_empty(boxes: Sequence[Box]) -> list[Box]:
    """The boxes holding at least one element, in order."""
    if not boxes:
        return []
    shapes = [b[1] for b in boxes]
    if not any(0 in axis for axis in zip(*shapes)):
        return list(boxes)
    return [b for b in boxes if 0 not in b[1]]


def regular_grid(live: Sequence[Box]) -> list[list[int]] | None:
    """The cut points of the grid of which ``live`` are pairwise distinct cells, or ``None``.

    ``live`` must hold non-empty boxes of equal rank. The grid is the one formed by all box
    starts and ends along each axis; each box must span exactly one cell of it, and no cell may
    be taken twice. Distinct cells of a grid are disjoint, so a result proves that no two boxes
    overlap, in about ``n`` steps of C code per axis (no pairwise comparison). Layouts that are
    not such grids (flat ranges, overlaps) return ``None``; callers then take a general path.
    """
    columns = _columns([b[0] for b in live], [b[1] for b in live])
    return None if columns is None else grid_cuts(*columns)


Column = Sequence[int]


def _columns(offsets: Sequence[tuple[int, ...]], shapes: Sequence[tuple[int, ...]]
             ) -> tuple[list[Column], list[Column]] | None:
    """Offsets and shapes of boxes as per-axis columns (None if their ranks differ)."""
    if not offsets:
        return None
    ndim = len(offsets[0])
    if set(map(len, offsets)) != {ndim} or set(map(len, shapes)) != {ndim}:
        return None
    if ndim == 0:
        return [], []
    return list(zip(*offsets)), list(zip(*shapes))  # type: ignore[arg-type]


def grid_cuts(starts: Sequence[Column], sizes: Sequence[Column]) -> list[list[int]] | None:
    """:func:`regular_grid` of the non-empty boxes given as columns: ``starts[a][i]`` and
    ``sizes[a][i]`` are the offset and extent of box ``i`` along axis ``a``."""
    if not starts:
        return None  # 0-dimensional: the caller decides
    n = len(starts[0])
    if n == 0:
        return None
    cuts: list[list[int]] = []
    varying: list[list[int]] = []
    for column, widths in zip(starts, sizes):
        first_start, first_size = column[0], widths[0]
        if column.count(first_start) == n and widths.count(first_size) == n:
            cuts.append([first_start, first_start + first_size])  # one cell along this axis
            continue
        ends = list(map(add, column, widths))
        points = sorted(set(column).union(ends))
        position = {p: i for i, p in enumerate(points)}
        cell = list(map(position.__getitem__, column))
        # Every box ends at the cut point right after its start: it is exactly one cell wide.
        if list(map(points.__getitem__, map((1).__add__, cell))) != ends:
            return None
        cuts.append(points)
        varying.append(cell)
    if not varying:
        return cuts if n == 1 else None
    distinct = len(set(varying[0])) if len(varying) == 1 else len(set(zip(*varying)))
    return cuts if distinct == n else None


def _one_axis(starts: Sequence[Column], sizes: Sequence[Column]) -> tuple[int, list[int], list[int]] | None:
    """If the boxes differ along one axis only: that axis and their intervals along it
    (starts, ends), sorted by start; else None. Boxes that are identical along every other axis
    overlap exactly when these intervals do."""
    found = None
    for axis, (column, widths) in enumerate(zip(starts, sizes)):
        n = len(column)
        if column.count(column[0]) == n and widths.count(widths[0]) == n:
            continue
        if found is not None:
            return None
        found = axis, column, widths
    if found is None or min(found[2]) < 0:
        return None
    axis, column, widths = found
    ends = list(map(add, column, widths))
    begins = list(column)
    if begins != sorted(begins):
        order = sorted(range(len(begins)), key=begins.__getitem__)
        begins = [begins[i] for i in order]
        ends = [ends[i] for i in order]
    return axis, begins, ends


def covers_exactly(global_shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Fast sufficient test of exact cover: ``True`` if the non-empty ``boxes`` are all the
    cells of one grid spanning ``global_shape``, each once (rows or columns split over ranks,
    N-D grids). ``False`` means "not proven": call :func:`check_exact_cover` for the verdict
    and the message."""
    columns = _columns([b[0] for b in boxes], [b[1] for b in boxes])
    if columns is None or len(columns[0]) != len(global_shape):
        return False
    if not global_shape:
        return len(boxes) == 1
    return covers_exactly_columns(global_shape, *columns)


def covers_exactly_columns(global_shape: Sequence[int], starts: Sequence[Column],
                           sizes: Sequence[Column]) -> bool:
    """:func:`covers_exactly` of boxes given as per-axis columns (at least one axis, as many
    as ``global_shape``)."""
    ndim = len(global_shape)
    n = len(starts[0])
    if n == 0:
        return False
    # The common case first: boxes spanning the tensor along all axes but one, cut along it
    # (rows or columns split over ranks; empty trailing shards are empty intervals).
    along = _one_axis(starts, sizes)
    if along is not None:
        axis, begins, ends = along
        if (begins[0] == 0 and ends[-1] == global_shape[axis] and ends[:-1] == begins[1:]
                and all(starts[a][0] == 0 and sizes[a][0] == global_shape[a]
                        for a in range(ndim) if a != axis)):
            return True
    if any(0 in column for column in sizes):
        keep = [all(widths) for widths in zip(*sizes)]
        starts = [list(compress(column, keep)) for column in starts]
        sizes = [list(compress(column, keep)) for column in sizes]
    cuts = grid_cuts(starts, sizes)
    if cuts is None:
        return False
    if any(c[0] != 0 or c[-1] != g for c, g in zip(cuts, global_shape)):
        return False
    return math.prod(len(c) - 1 for c in cuts) == len(starts[0])


def find_overlap(boxes: Sequence[Box]) -> tuple[int, int, Box] | None:
    """Return ``(i, j, common_region)`` for the first pair of overlapping boxes, if any.

    Boxes cut along one axis or forming a regular grid (see :func:`regular_grid`) are
    recognised in linear time; otherwise a sweep along the axis with the most distinct starts
    finds the pair, so row- or column-sharded layouts cost about ``n log n`` rather than
    ``n**2``.
    """
    if len(boxes) < 2:
        return find_overlap_sweep(boxes)
    columns = _columns([b[0] for b in boxes], [b[1] for b in boxes])
    if columns is not None and columns[0]:
        along = _one_axis(*columns)
        if along is not None and all(map(le, along[2][:-1], along[1][1:])):
            return None
    if regular_grid(non_empty(boxes)) is not None:
        return None
    return find_overlap_sweep(boxes)


def find_overlap_sweep(boxes: Sequence[Box]) -> tuple[int, int, Box] | None:
    """The general path of :func:`find_overlap` (also its reference in tests)."""
    live = [(i, b) for i, b in enumerate(boxes) if b.volume > 0]
    if len(live) < 2:
        return None
    ndim = len(live[0][1].offset)
    if ndim == 0:
        return live[0][0], live[1][0], live[0][1]
    axis = max(range(ndim), key=lambda a: len({b.offset[a] for _, b in live}))
    live.sort(key=lambda ib: ib[1].offset[axis])
    active: list[tuple[int, Box]] = []
    for i, box in live:
        start = box.offset[axis]
        active = [(j, other) for j, other in active if other.offset[axis] + other.shape[axis] > start]
        for j, other in active:
            common = intersect(box, other)
            if common is not None:
                return min(i, j), max(i, j), common
        active.append((i, box))
    return None


def find_hole(global_shape: tuple[int, ...], boxes: Sequence[Box]) -> Box | None:
    """Return a region of the global tensor that no box covers, assuming no overlaps.

    The region is one cell of the grid formed by all box boundaries; ``None`` if everything is
    covered or the grid is too large to search.
    """
    ndim = len(global_shape)
    cuts = []
    for axis in range(ndim):
        points = {0, global_shape[axis]}
        for b in boxes:
            points.add(min(b.offset[axis], global_shape[axis]))
            points.add(min(b.offset[axis] + b.shape[axis], global_shape[axis]))
        cuts.append(sorted(points))
    if math.prod(len(c) - 1 for c in cuts) > _MAX_GRID_CELLS:
        return None
    positions = [{p: i for i, p in enumerate(c)} for c in cuts]
    covered: set[tuple[int, ...]] = set()
    for b in boxes:
        if b.volume == 0:
            continue
        ranges = [
            range(positions[a][min(b.offset[a], global_shape[a])],
                  positions[a][min(b.offset[a] + b.shape[a], global_shape[a])])
            for a in range(ndim)
        ]
        covered.update(_product(ranges))
    for cell in _product([range(len(c) - 1) for c in cuts]):
        if cell not in covered:
            offset = tuple(cuts[a][cell[a]] for a in range(ndim))
            shape = tuple(cuts[a][cell[a] + 1] - cuts[a][cell[a]] for a in range(ndim))
            if math.prod(shape) > 0:
                return Box(offset, shape)
    return None


def _product(ranges: list[range]):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head,) + tail


def check_exact_cover(key: str, global_shape: tuple[int, ...], boxes: Sequence[Box],
                      owners: Sequence[int]) -> str | None:
    """Return ``None`` if ``boxes`` cover ``global_shape`` exactly once, else a message naming
    the key, the region and the ranks involved. ``owners[i]`` is the rank holding ``boxes[i]``."""
    if covers_exactly(global_shape, boxes):
        return None
    numel = math.prod(global_shape)
    overlap = find_overlap_sweep(boxes)
    if overlap is not None:
        i, j, common = overlap
        return (
            f"tensor {key!r}: region {common.describe()} is covered by more than one main "
            f"replica (rank {owners[i]} box {boxes[i].describe()} and rank {owners[j]} box "
            f"{boxes[j].describe()}); give all but one of them a non-zero replica_id"
        )
    covered = sum(b.volume for b in boxes)
    if covered != numel:
        hole = find_hole(global_shape, boxes)
        where = f"region {hole.describe()}" if hole is not None else "some region"
        return (
            f"tensor {key!r} of global shape {tuple(global_shape)}: {numel - covered} elements are "
            f"not covered by any main replica ({where} is missing); check the global offsets, "
            "or mark one holder of each shard with replica_id 0"
        )
    return None
