"""Who writes what: deduplicate replicas and balance the bytes written across ranks.

Every rank runs :func:`plan_save` on the same gathered descriptions and gets the same answer,
so no plan has to be sent around.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .boxes import Box
from .shards import ObjectShard, TensorShard


@dataclass(frozen=True)
class ChunkWrite:
    """Write elements ``data_start : data_start + box.volume`` of the flattened local data of
    shard ``shard_index`` as the chunk ``box`` of tensor ``key``."""

    key: str
    shard_index: int
    box: Box
    data_start: int


@dataclass
class RankWritePlan:
    chunks: list[ChunkWrite] = field(default_factory=list)
    objects: list[int] = field(default_factory=list)  # indices into the rank's object shards
    nbytes: int = 0


def plan_save(
    tensor_shards: Sequence[Sequence[TensorShard]],
    object_shards: Sequence[Sequence[ObjectShard]] = (),
) -> list[RankWritePlan]:
    """Assign each unique shard to exactly one of the ranks holding it.

    ``tensor_shards[r]`` (and ``object_shards[r]``) are rank ``r``'s descriptions. A shard is
    written if any holder has the main replica; among all holders (main or not), the one with
    the fewest bytes assigned so far writes it, larger shards first, ties to the lower rank.
    """
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
