"""The shard descriptions of all ranks, transposed into columns.

Validation and the save plan look at every shard of every rank: millions of small objects at
thousands of ranks. Visiting them one by one in Python, and in an order other than the one
they lie in memory (one rank's shards after the other's, as they were gathered), costs a cache
and TLB miss per object. Here each rank's list is read once, with C-level operations (``map``,
``chain``, ``array``), into flat integer arrays; per tensor key, the values of all ranks are
then strided slices of those arrays.

This applies when ranks describe whole boxes (no flat ranges) and agree on each key's global
shape and dtype; :func:`shard_columns` returns ``None`` otherwise and callers take their
general path. Ranks listing the same keys in the same order (e.g. all ranks of a pipeline
stage) form a group and share one layout of the arrays.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter, itemgetter, mul

from .shards import TensorShard

_KEY = attrgetter("key")
_BOX = attrgetter("box")
_FLAT = attrgetter("flat")
_MAIN = attrgetter("main")
_GLOBAL_SHAPE = attrgetter("global_shape")
_DTYPE = attrgetter("dtype")
_ITEMSIZE = attrgetter("itemsize")
_OFFSET = itemgetter(0)
_SHAPE = itemgetter(1)


@dataclass
class RankGroup:
    """Ranks listing the same keys in the same order, and their shards as flat arrays."""

    keys: tuple[str, ...]
    first: Sequence[TensorShard]  # shards of the group's first rank
    globals_: list[tuple]  # (global_shape, dtype, itemsize) of each position
    ndims: list[int]
    positions: list[int]  # start of each position's axes in a rank's flattened offsets
    width: int  # flattened offsets per rank
    global_shapes: list[tuple[int, ...]]
    dtypes: list[str]
    itemsizes: list[int]
    ranks: list[int] = field(default_factory=list)
    offsets: array = field(default_factory=lambda: array("q"))  # rank after rank
    shapes: array = field(default_factory=lambda: array("q"))
    mains: array = field(default_factory=lambda: array("b"))
    hashes: array = field(default_factory=lambda: array("q"))
    nbytes: array = field(default_factory=lambda: array("q"))

    @property
    def count(self) -> int:
        return len(self.keys)

    def axis_column(self, source: array, position: int, axis: int) -> array:
        """Values of ``position``'s ``axis`` over the group's ranks."""
        return source[self.positions[position] + axis :: self.width]

    def column(self, source: array, position: int) -> array:
        """Per-shard values (mains, hashes, nbytes) of ``position`` over the group's ranks."""
        return source[position :: self.count]

    def rank_slice(self, source: array, member: int) -> array:
        """Per-shard values of the group's ``member``-th rank."""
        return source[member * self.count : (member + 1) * self.count]


@dataclass
class ShardColumns:
    groups: list[RankGroup]
    group_of: list[tuple[int, int]]  # rank -> (group number, member number)
    slots: dict[str, list[tuple[int, int]]]  # key -> [(group number, position)], ranks in order

    def key_columns(self, key: str) -> tuple[tuple, list[array], list[array], array, list[int]]:
        """For ``key``: (global_shape, dtype, itemsize) of its first holder, then per axis the
        offsets and extents of every rank's box, the main flags and the holding ranks."""
        slots = self.slots[key]
        g, position = slots[0]
        info = self.groups[g].globals_[position]
        ndim = len(info[0])
        starts = [array("q") for _ in range(ndim)]
        sizes = [array("q") for _ in range(ndim)]
        mains = array("b")
        ranks: list[int] = []
        for g, position in slots:
            group = self.groups[g]
            for axis in range(ndim):
                starts[axis].extend(group.axis_column(group.offsets, position, axis))
                sizes[axis].extend(group.axis_column(group.shapes, position, axis))
            mains.extend(group.column(group.mains, position))
            ranks.extend(group.ranks)
        return info, starts, sizes, mains, ranks

    def consistent(self, key: str) -> bool:
        """Whether all holders of ``key`` agree on its global shape and dtype."""
        infos = {self.groups[g].globals_[p][:2] for g, p in self.slots[key]}
        return len(infos) == 1


# The last result, for the same descriptions: a save validates, then plans, the same shards.
_last_lock = threading.Lock()
_last: tuple[list[tuple[TensorShard, ...]], ShardColumns | None] | None = None


def shard_columns(tensor_shards: Sequence[Sequence[TensorShard]], *, keep: bool = False,
                  reuse: bool = False) -> ShardColumns | None:
    """Transpose every rank's shard descriptions; ``None`` if some shard holds a flat range or
    ranks of a group disagree on a global shape or dtype (callers then take their general
    path, which also names the problem).

    With ``keep`` the result is remembered (validation keeps it); with ``reuse`` a result kept
    for the very same shard objects is taken and forgotten (the save plan takes it), instead of
    being computed again. Shard descriptions are immutable, so the same objects (compared by
    identity) give the same columns.
    """
    global _last
    if reuse:
        with _last_lock:
            last, _last = _last, None
        if last is not None and len(last[0]) == len(tensor_shards) and list(map(tuple, tensor_shards)) == last[0]:
            return last[1]
    columns = _shard_columns(tensor_shards)
    if keep:
        with _last_lock:
            _last = (list(map(tuple, tensor_shards)), columns)
    return columns


def _shard_columns(tensor_shards: Sequence[Sequence[TensorShard]]) -> ShardColumns | None:
    groups: list[RankGroup] = []
    by_keys: dict[tuple[str, ...], int] = {}
    group_of: list[tuple[int, int]] = []
    prod = math.prod
    for rank, shards in enumerate(tensor_shards):
        keys = tuple(map(_KEY, shards))
        number = by_keys.get(keys)
        global_shapes = list(map(_GLOBAL_SHAPE, shards))
        dtypes = list(map(_DTYPE, shards))
        itemsizes = list(map(_ITEMSIZE, shards))
        if number is None:
            ndims = list(map(len, global_shapes))
            positions = [0]
            for n in ndims:
                positions.append(positions[-1] + n)
            number = by_keys[keys] = len(groups)
            groups.append(RankGroup(keys, shards, list(zip(global_shapes, dtypes, itemsizes)), ndims,
                                    positions[:-1], positions[-1], global_shapes, dtypes, itemsizes))
        group = groups[number]
        if (any(map(_FLAT, shards)) or global_shapes != group.global_shapes or dtypes != group.dtypes
                or itemsizes != group.itemsizes):
            return None
        boxes = list(map(_BOX, shards))
        if list(map(len, map(_OFFSET, boxes))) != group.ndims or list(map(len, map(_SHAPE, boxes))) != group.ndims:
            return None  # a box with another number of axes than its tensor
        offsets = chain.from_iterable(map(_OFFSET, boxes))
        shapes = chain.from_iterable(map(_SHAPE, boxes))
        group_of.append((number, len(group.ranks)))
        group.ranks.append(rank)
        group.offsets.extend(offsets)
        group.shapes.extend(shapes)
        group.mains.extend(map(_MAIN, shards))
        group.hashes.extend(map(hash, boxes))
        group.nbytes.extend(map(mul, map(prod, map(_SHAPE, boxes)), itemsizes))
    slots: dict[str, list[tuple[int, int]]] = {}
    for number, group in enumerate(groups):
        for position, key in enumerate(group.keys):
            slots.setdefault(key, []).append((number, position))
    return ShardColumns(groups, group_of, slots)


def main_positions(columns: ShardColumns, rank: int) -> list[int]:
    """Positions of ``rank``'s main shards."""
    group_number, member = columns.group_of[rank]
    group = columns.groups[group_number]
    mains = group.rank_slice(group.mains, member)
    if mains.count(1) == len(mains):
        return list(range(len(mains)))
    return list(compress(range(len(mains)), mains))
