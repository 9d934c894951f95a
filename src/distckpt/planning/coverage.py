"""Exact-cover check: do the main-replica boxes of a global tensor cover each element once?"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .boxes import Box, intersect

# Above this many cells the hole finder gives up naming the region (the error still says how
# many elements are missing).
_MAX_GRID_CELLS = 1_000_000


def find_overlap(boxes: Sequence[Box]) -> tuple[int, int, Box] | None:
    """Return ``(i, j, common_region)`` for the first pair of overlapping boxes, if any.

    Sweeps along the axis with the most distinct starts, so row- or column-sharded layouts cost
    about ``n log n`` rather than ``n**2``.
    """
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
    covered: set[tuple[int, ...]] = set()
    for b in boxes:
        if b.volume == 0:
            continue
        ranges = [
            range(cuts[a].index(b.offset[a]), cuts[a].index(b.offset[a] + b.shape[a]))
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
    numel = math.prod(global_shape)
    overlap = find_overlap(boxes)
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
