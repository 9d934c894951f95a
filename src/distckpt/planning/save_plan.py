"""Who writes what: deduplicate replicas and balance the bytes written across ranks.

Every rank runs :func:`plan_save` on the same gathered descriptions and gets the same answer,
so no plan has to be sent around.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, compress
from typing import Any, NamedTuple

from .boxes import Box
from .columns import ShardColumns, shard_columns
from .gcpause import paused_gc
from .shards import ObjectShard, TensorShard


class ChunkWrite(NamedTuple):
    """Write elements ``data_start : data_start + box.volume`` of the flattened local data of
    shard ``shard_index`` as the chunk ``box`` of tensor ``key``."""

    key: str
    shard_index: int
    box: Box
    data_start: int


class RankWritePlan:
    """What one rank writes: ``chunks`` (sorted by key and offset), ``objects`` (indices into
    the rank's object shards) and the total ``nbytes``.

    :func:`plan_save` plans every rank but each rank writes only its own plan, so the chunk
    list of a plan is built when it is first used.
    """

    __slots__ = ("_chunks", "_pending", "objects", "nbytes")

    def __init__(self, chunks: list[ChunkWrite] | None = None, objects: list[int] | None = None,
                 nbytes: int = 0) -> None:
        self._chunks: list[ChunkWrite] | None = [] if chunks is None else chunks
        self._pending: tuple | None = None
        self.objects: list[int] = [] if objects is None else objects
        self.nbytes = nbytes

    @property
    def chunks(self) -> list[ChunkWrite]:
        chunks = self._chunks
        if chunks is None:
            assert self._pending is not None
            chunks = self._chunks = _build_chunks(*self._pending)
            self._pending = None
        return chunks

    @chunks.setter
    def chunks(self, value: list[ChunkWrite]) -> None:
        self._chunks, self._pending = value, None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankWritePlan):
            return NotImplemented
        return (self.chunks, self.objects, self.nbytes) == (other.chunks, other.objects, other.nbytes)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankWritePlan(chunks={self.chunks!r}, objects={self.objects!r}, nbytes={self.nbytes})"


def plan_save(
    tensor_shards: Sequence[Sequence[TensorShard]],
    object_shards: Sequence[Sequence[ObjectShard]] = (),
) -> list[RankWritePlan]:
    """Assign each unique shard to exactly one of the ranks holding it.

    ``tensor_shards[r]`` (and ``object_shards[r]``) are rank ``r``'s descriptions. A shard is
    written if any holder has the main replica; among all holders (main or not), the one with
    the fewest bytes assigned so far writes it, larger shards first, ties to the lower rank.

    That greedy order is the specification; :func:`plan_save_reference` implements it
    literally. This function gets the same plans without sorting every shard: a shard held by
    a single rank can only go to that rank, so only shards with several holders are ordered,
    and the bytes their holders already got from earlier (larger) single-holder shards are
    found by bisection.
    """
    with paused_gc():
        return _plan_save(tensor_shards, list(object_shards))


# A holder is encoded as one int: rank << 33 | index << 1 | main.
_RANK_SHIFT = 33
_INDEX_MASK = (1 << 32) - 1


class _Own:
    """Each rank's main shards held by no other rank (positions in its list), and their bytes.

    ``sizes_of(rank)`` gives the bytes of every shard of the rank, by position."""

    def __init__(self, index: list[Sequence[int]], total: list[int],
                 sizes_of: Callable[[int], Sequence[int]]) -> None:
        self._index = index
        self.total = total
        self.sizes_of = sizes_of
        self._gone: dict[int, set[int]] = {}

    def index(self, rank: int) -> Sequence[int]:
        gone = self._gone.get(rank)
        if gone is None:
            return self._index[rank]
        return [i for i in self._index[rank] if i not in gone]

    def sizes(self, rank: int) -> list[int]:
        return list(map(self.sizes_of(rank).__getitem__, self.index(rank)))

    def demote(self, rank: int, gone: set[int]) -> None:
        """Shards ``gone`` (main ones of ``rank``) have other holders after all."""
        sizes = self.sizes_of(rank)
        self._gone.setdefault(rank, set()).update(gone)
        self.total[rank] -= sum(sizes[i] for i in gone)


def _plan_save(
    tensor_shards: Sequence[Sequence[TensorShard]], object_shards: list[Sequence[ObjectShard]]
) -> list[RankWritePlan]:
    world = len(tensor_shards)
    if not object_shards:
        object_shards = [[] for _ in range(world)]
    columns = shard_columns(tensor_shards, reuse=True)
    if columns is not None:
        own, keys, multi = _holders_from_columns(tensor_shards, columns)
    else:
        own, keys, multi = _holders_from_shards(tensor_shards)
    object_table: dict[str, int] = {}
    object_multi: dict[str, list[int]] = {}
    for rank, objects in enumerate(object_shards):
        base = rank << _RANK_SHIFT
        for index, obj in enumerate(objects):
            code = base | index << 1 | obj.main
            first = object_table.setdefault(obj.unique_key, code)
            if first != code:
                object_multi.setdefault(obj.unique_key, [first]).append(code)

    # Contested shards are not single-holder after all: drop them from their holders' lists.
    demoted: dict[int, set[int]] = {}
    for holders in multi.values():
        for code in holders:
            if code & 1:
                demoted.setdefault(code >> _RANK_SHIFT, set()).add(code >> 1 & _INDEX_MASK)
    for rank, gone in demoted.items():
        own.demote(rank, gone)

    plans = [RankWritePlan() for _ in range(world)]
    # Per rank: (index, order key) of the several-holder shards it writes.
    assigned: list[list[tuple[int, tuple]]] = [[] for _ in range(world)]

    # Several-holder groups, in the greedy order. Each entry: (order key, holders, is_object);
    # the order key is (-nbytes, identity, first holder), the last part standing for the order
    # of first appearance that breaks ties in the reference.
    contested: list[tuple[tuple, list[int], bool]] = []
    for holders in multi.values():
        if not any(h & 1 for h in holders):
            continue  # no main replica: not written
        first = holders[0]
        shard = tensor_shards[first >> _RANK_SHIFT][first >> 1 & _INDEX_MASK]
        contested.append((_order_key(shard, first), holders, False))
    object_forced: list[tuple[int, int, int]] = []  # (rank, index, nbytes)
    for unique_key, code in object_table.items():
        holders = object_multi.get(unique_key, [code])
        if not any(h & 1 for h in holders):
            continue
        obj = object_shards[code >> _RANK_SHIFT][code >> 1 & _INDEX_MASK]
        if len(holders) == 1:
            object_forced.append((code >> _RANK_SHIFT, code >> 1 & _INDEX_MASK, obj.nbytes))
        else:
            contested.append(((-obj.nbytes, ("o", unique_key, (), ()), code), holders, True))

    if contested:
        _assign_contested(tensor_shards, object_shards, contested, own, object_forced, plans, assigned)
    for rank, index, nbytes in object_forced:
        plans[rank].objects.append(index)
        plans[rank].nbytes += nbytes

    key_order = {key: i for i, key in enumerate(sorted(keys))}
    own.sizes_of = _no_sizes  # the plans keep ``own`` for their chunk lists: not the columns
    for rank, plan in enumerate(plans):
        plan.nbytes += own.total[rank]
        plan.objects.sort()
        plan._chunks = None
        plan._pending = (tuple(tensor_shards[rank]), rank, own, assigned[rank], key_order)
    return plans


def _holders_from_shards(tensor_shards: Sequence[Sequence[TensorShard]]
                         ) -> tuple[_Own, Iterable[str], dict[tuple, list[int]]]:
    """Single holders and replicas, for any descriptions (flat ranges included)."""
    prod = math.prod
    # Pass 1, over the shards in the order they lie in memory (rank after rank): per key, the
    # hash of every shard's identity and its holder code; per rank, its main shards (taken to
    # be single-holder until shown otherwise) and the bytes of every shard.
    fingerprints: dict[str, tuple[array, array]] = {}
    own_index: list[Sequence[int]] = []
    own_total: list[int] = []
    all_sizes: list[list[int]] = []
    for rank, shards in enumerate(tensor_shards):
        indices: list[int] = []
        sizes: list[int] = []
        total = 0
        base = rank << _RANK_SHIFT
        for index, shard in enumerate(shards):
            found = fingerprints.get(shard.key)
            if found is None:
                found = fingerprints[shard.key] = (array("q"), array("q"))
            flat = shard.flat
            box = shard.box
            found[0].append(hash(box) if flat is None else hash((box, flat)))
            main = shard.main
            found[1].append(base | index << 1 | main)
            size = (prod(box[1]) if flat is None else flat[1] - flat[0]) * shard.itemsize
            sizes.append(size)
            if main:
                indices.append(index)
                total += size
        own_index.append(indices)
        own_total.append(total)
        all_sizes.append(sizes)
    # Pass 2, per key: identities whose hash occurs more than once are compared exactly; those
    # held by several ranks (replicas) are "contested".
    multi: dict[tuple, list[int]] = {}
    for key, (hashes, codes) in fingerprints.items():
        _find_replicas(tensor_shards, key, hashes, codes.__getitem__, multi)
    return _Own(own_index, own_total, all_sizes.__getitem__), fingerprints, multi


def _holders_from_columns(tensor_shards: Sequence[Sequence[TensorShard]], columns: ShardColumns
                          ) -> tuple[_Own, Iterable[str], dict[tuple, list[int]]]:
    """:func:`_holders_from_shards` from the transposed descriptions (no flat ranges)."""
    own_index: list[Sequence[int]] = [()] * len(tensor_shards)
    own_total = [0] * len(tensor_shards)
    for group in columns.groups:
        count = group.count
        for member, rank in enumerate(group.ranks):
            mains = group.rank_slice(group.mains, member)
            sizes = group.rank_slice(group.nbytes, member)
            if mains.count(1) == count:
                own_index[rank] = range(count)
                own_total[rank] = sum(sizes)
            else:
                own_index[rank] = list(compress(range(count), mains))
                own_total[rank] = sum(compress(sizes, mains))

    def sizes_of(rank: int) -> Sequence[int]:
        number, member = columns.group_of[rank]
        group = columns.groups[number]
        return group.rank_slice(group.nbytes, member)

    multi: dict[tuple, list[int]] = {}
    for key, slots in columns.slots.items():
        hashes = array("q")
        for number, position in slots:
            group = columns.groups[number]
            hashes.extend(group.column(group.hashes, position))
        if len(set(hashes)) == len(hashes):
            continue
        # Some boxes repeat (or their hashes collide): compare the boxes themselves, from the
        # columns (no flat ranges here, so a shard's identity is its box).
        _, box_starts, box_sizes, box_mains, box_ranks = columns.key_columns(key)
        positions = [p for number, p in slots for _ in columns.groups[number].ranks]
        boxes = list(zip(*box_starts, *box_sizes)) if box_starts else [()] * len(box_mains)
        repeated = {box for box, count in Counter(boxes).items() if count > 1}
        holders_of: dict[tuple, list[int]] = {}
        for i, box in enumerate(boxes):
            if box in repeated:
                holders_of.setdefault(box, []).append(
                    box_ranks[i] << _RANK_SHIFT | positions[i] << 1 | box_mains[i])
        for box, holders in holders_of.items():
            multi[(key, box)] = sorted(holders)  # order of appearance: rank, then index
    return _Own(own_index, own_total, sizes_of), columns.slots, multi


def _find_replicas(tensor_shards: Sequence[Sequence[TensorShard]], key: str, hashes: array,
                   code: Callable[[int], int], multi: dict[tuple, list[int]]) -> None:
    """Add to ``multi`` the identities of ``key`` held more than once: ``hashes[i]`` is the
    hash of the identity of the shard of holder ``code(i)``."""
    repeated = {value for value, count in Counter(hashes).items() if count > 1}
    if not repeated:
        return
    by_hash: dict[int, list[int]] = {}
    for position, value in enumerate(hashes):
        if value in repeated:
            by_hash.setdefault(value, []).append(position)
    for positions in by_hash.values():
        exact: dict[Any, list[int]] = {}
        for position in positions:
            holder = code(position)
            shard = tensor_shards[holder >> _RANK_SHIFT][holder >> 1 & _INDEX_MASK]
            ident = shard.box if shard.flat is None else (shard.box, shard.flat, None)
            exact.setdefault(ident, []).append(holder)
        for ident, holders in exact.items():
            if len(holders) > 1:
                multi[(key, ident)] = sorted(holders)  # order of appearance: rank, then index


def _no_sizes(rank: int) -> Sequence[int]:
    raise AssertionError("sizes are needed only while planning")


def _build_chunks(shards: Sequence[TensorShard], rank: int, own: _Own,
                  assigned: list[tuple[int, tuple]], key_order: dict[str, int]) -> list[ChunkWrite]:
    """The chunks of one rank's plan, sorted by (key, offset)."""
    indices = [*own.index(rank), *(index for index, _ in assigned)]
    if len({shards[i].key for i in indices}) != len(indices):
        # A key written more than once by this rank: put the shards in the greedy order first,
        # so that the stable sort below keeps the reference's order of equal keys.
        order = dict(assigned)
        indices = sorted(indices, key=lambda i: order.get(i) or _order_key(
            shards[i], rank << _RANK_SHIFT | i << 1 | 1))
    new_write = tuple.__new__
    chunks: list[ChunkWrite] = []
    for index in indices:
        shard = shards[index]
        if shard.flat is None:
            chunks.append(new_write(ChunkWrite, (shard.key, index, shard.box, 0)))
        else:
            for piece in shard.pieces():
                chunks.append(ChunkWrite(shard.key, index, piece.box, piece.flat_start))
    return _sorted_chunks(chunks, key_order)


def _order_key(shard: TensorShard, first_holder: int) -> tuple:
    return (-shard.nbytes, ("t", shard.key, shard.box.offset, shard.flat or ()), first_holder)


def _sorted_chunks(chunks: list[ChunkWrite], key_order: dict[str, int]) -> list[ChunkWrite]:
    """``sorted(chunks, key=(key, box.offset))``, cheaply when each key occurs once."""
    order = [key_order[c[0]] for c in chunks]
    if len(set(order)) != len(order):
        return sorted(chunks, key=lambda c: (c.key, c.box.offset))
    if order == sorted(order):
        return chunks
    return [chunks[i] for i in sorted(range(len(order)), key=order.__getitem__)]


def _assign_contested(
    tensor_shards: Sequence[Sequence[TensorShard]],
    object_shards: Sequence[Sequence[ObjectShard]],
    contested: list[tuple[tuple, list[int], bool]],
    own: _Own,
    object_forced: list[tuple[int, int, int]],
    plans: list[RankWritePlan],
    assigned: list[list[tuple[int, tuple]]],
) -> None:
    """Run the greedy over the shards with several holders, in order. A holder's load at that
    point is what it got from earlier contested shards plus its single-holder shards that come
    earlier in the order: all larger ones, and equal-sized ones that sort before."""
    contested.sort(key=lambda c: c[0])
    # Per rank (lazily): single-holder sizes in decreasing order and their running sums.
    sizes_desc: dict[int, tuple[list[int], list[int]]] = {}
    extra = [0] * len(plans)  # bytes from contested shards assigned so far

    def solo_before(rank: int, order: tuple) -> int:
        nbytes = -order[0]
        found = sizes_desc.get(rank)
        if found is None:
            sizes = own.sizes(rank) + [n for r, _, n in object_forced if r == rank]
            negated = sorted(-n for n in sizes)
            found = sizes_desc[rank] = (negated, [0, *accumulate(-n for n in negated)])
        negated, sums = found
        larger = bisect_left(negated, -nbytes)
        total = sums[larger]
        if nbytes and bisect_left(negated, -nbytes + 1) > larger:
            total += nbytes * _equal_before(tensor_shards, object_shards, own.index(rank), object_forced,
                                            rank, order)
        return total

    # Shards of zero bytes come last in the order and change no load: each goes to the holder
    # with the least bytes in the end (ties to the lower rank), without looking at sizes.
    sized = [c for c in contested if c[0][0]]
    final = own.total[:]
    for rank, _, nbytes in object_forced:
        final[rank] += nbytes
    for order, holders, is_object in sized + [c for c in contested if not c[0][0]]:
        nbytes = -order[0]
        best = None
        for code in holders:
            rank = code >> _RANK_SHIFT
            if nbytes:
                load = (solo_before(rank, order) + extra[rank], rank)
            else:
                load = (final[rank] + extra[rank], rank)
            if best is None or load < best[0]:
                best = (load, code)
        assert best is not None
        code = best[1]
        rank, index = code >> _RANK_SHIFT, code >> 1 & _INDEX_MASK
        extra[rank] += nbytes
        plans[rank].nbytes += nbytes
        if is_object:
            plans[rank].objects.append(index)
        else:
            assigned[rank].append((index, order))


def _equal_before(
    tensor_shards: Sequence[Sequence[TensorShard]],
    object_shards: Sequence[Sequence[ObjectShard]],
    own_index: Sequence[int],
    object_forced: list[tuple[int, int, int]],
    rank: int,
    order: tuple,
) -> int:
    """How many single-holder shards of ``rank`` of the same size sort before ``order``."""
    count = 0
    base = rank << _RANK_SHIFT
    for index in own_index:
        shard = tensor_shards[rank][index]
        if -shard.nbytes == order[0]:
            count += _order_key(shard, base | index << 1 | 1) < order
    for r, index, size in object_forced:
        if r == rank and -size == order[0]:
            obj = object_shards[r][index]
            count += (-size, ("o", obj.unique_key, (), ()), base | index << 1 | obj.main) < order
    return count


def plan_save_reference(
    tensor_shards: Sequence[Sequence[TensorShard]],
    object_shards: Sequence[Sequence[ObjectShard]] = (),
) -> list[RankWritePlan]:
    """The greedy of :func:`plan_save`, literally (reference for tests)."""
    world = len(tensor_shards)
    object_shards = list(object_shards) or [[] for _ in range(world)]
    # identity -> (nbytes, holders [(rank, index)], any main)
    groups: dict[tuple, list] = {}
    for rank, shards in enumerate(tensor_shards):
        for index, shard in enumerate(shards):
            entry = groups.setdefault(("t",) + shard.identity, [shard.nbytes, [], False])
            entry[1].append((rank, index))
            entry[2] = entry[2] or shard.main
    for rank, objects in enumerate(object_shards):
        for index, obj in enumerate(objects):
            entry = groups.setdefault(("o", obj.unique_key), [obj.nbytes, [], False])
            entry[1].append((rank, index))
            entry[2] = entry[2] or obj.main

    plans = [RankWritePlan() for _ in range(world)]
    ordered = sorted(
        (item for item in groups.items() if item[1][2]),
        key=lambda item: (-item[1][0], _sort_key(item[0])),
    )
    for identity, (nbytes, holders, _) in ordered:
        rank, index = min(holders, key=lambda h: (plans[h[0]].nbytes, h[0]))
        plan = plans[rank]
        plan.nbytes += nbytes
        if identity[0] == "o":
            plan.objects.append(index)
        else:
            shard = tensor_shards[rank][index]
            for piece in shard.pieces():
                plan.chunks.append(ChunkWrite(shard.key, index, piece.box, piece.flat_start))
    for plan in plans:
        plan.chunks.sort(key=lambda c: (c.key, c.box.offset))
        plan.objects.sort()
    return plans


def _sort_key(identity: tuple) -> tuple:
    # Identities mix None and tuples (flat ranges); make them totally ordered.
    if identity[0] == "o":
        return ("o", identity[1], (), ())
    _, key, box, flat = identity
    return ("t", key, box.offset, flat or ())
