"""Fully parallel load: storage is read once per group of ranks that need the same bytes.

When data-parallel replicas request the same shards, every one of them would read the same
bytes. Here the ranks first exchange what they need (byte spans of chunks); each span needed by
several ranks is read by one of them (bytes balanced across the ranks needing spans), verified,
and sent to the others over the process group. Each step that can fail runs inside an
exchange, so a failure on any rank is raised on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..mapping import ShardedObject, ShardedTensor
from ..planning.load_plan import ChunkRead
from .checkpoint import CheckpointReader
from .collective import Coordinator
from .io import run_tasks
from .load import TensorLoad, load_objects, plan_tensor_load

Span = tuple[str, int, int]  # file, first byte, length


def _span(read: ChunkRead) -> Span:
    return (read.chunk.file, read.chunk.data_offset + read.read_start, read.read_stop - read.read_start)


def assign_readers(needs: Sequence[Sequence[Span]]) -> dict[Span, int]:
    """The rank that reads each span: among the ranks needing it, the one with the fewest bytes
    assigned so far (largest spans first, ties to the lower rank). Pure and deterministic."""
    holders: dict[Span, list[int]] = defaultdict(list)
    for rank, spans in enumerate(needs):
        for span in dict.fromkeys(spans):
            holders[span].append(rank)
    load = [0] * len(needs)
    owner = {}
    for span in sorted(holders, key=lambda s: (-s[2], s)):
        rank = min(holders[span], key=lambda r: (load[r], r))
        owner[span] = rank
        load[rank] += span[2]
    return owner


def load_fully_parallel(
    coordinator: Coordinator,
    reader: CheckpointReader,
    sharded_tensors: Sequence[ShardedTensor],
    sharded_objects: Sequence[ShardedObject],
    deserialize: Callable[[bytes, str], object],
    thread_count: int = 1,
) -> tuple[list[object], dict[str, int]]:
    """Collective: fill the ShardedTensors in place and return the objects' payloads and byte
    counts (``read`` from storage, ``received`` from other ranks)."""
    local: dict[str, Any] = {}

    def plan() -> list[Span]:
        planned = plan_tensor_load(reader, sharded_tensors)
        local["planned"] = planned
        return [_span(r) for r in planned.reads]

    needs = coordinator.exchange("load planning", plan)
    owner = assign_readers(needs)
    planned: TensorLoad = local["planned"]
    rank = coordinator.rank
    mine = {_span(r): r for r in planned.reads if owner[_span(r)] == rank}
    # Spans this rank reads for others but does not need itself, described by another rank.
    for other, spans in enumerate(needs):
        if other == rank:
            continue
        for span in spans:
            if owner[span] == rank and span not in mine:
                mine[span] = None  # type: ignore[assignment]

    def read_mine() -> None:
        spans = list(mine)

        def read_one(span: Span) -> int:
            read = mine[span]
            if read is None:  # not needed here: raw bytes, verified by the rank that needs them
                buffer = torch.empty(span[2], dtype=torch.uint8)
                if span[2]:
                    reader.storage.read_into(span[0], span[1], memoryview(buffer.numpy()))  # type: ignore[arg-type]
                local.setdefault("buffers", {})[span] = (buffer, False)
            else:
                local.setdefault("buffers", {})[span] = (planned.filler.read_span(read), True)
            return span[2]

        local["buffers"] = {}
        tasks = [partial(read_one, span) for span in spans]
        local["bytes_read"] = sum(run_tasks(tasks, thread_count, "distckpt-read"))
        local["objects"] = load_objects(reader, sharded_objects, deserialize)

    coordinator.exchange("reading", read_mine)
    buffers: dict[Span, tuple[torch.Tensor, bool]] = local["buffers"]
    received = _exchange_spans(coordinator, needs, owner, buffers)

    def scatter() -> None:
        for read in planned.reads:
            buffer, verified = buffers[_span(read)]
            planned.filler.scatter(read, buffer, verified=verified)
        planned.finish()

    coordinator.exchange("loading", scatter)
    return local["objects"], {"read": local["bytes_read"], "received": received}


def _exchange_spans(
    coordinator: Coordinator,
    needs: Sequence[Sequence[Span]],
    owner: dict[Span, int],
    buffers: dict[Span, tuple[torch.Tensor, bool]],
) -> int:
    """Send each span from its reader to the other ranks needing it (point to point)."""
    if coordinator.world_size == 1:
        return 0
    rank = coordinator.rank
    tags = {span: tag for tag, span in enumerate(sorted(owner))}
    group = coordinator.group
    requests = []
    received = 0
    for span in dict.fromkeys(needs[rank]):
        source = owner[span]
        if source != rank and span[2]:
            buffer = torch.empty(span[2], dtype=torch.uint8)
            buffers[span] = (buffer, False)  # verified again here: the bytes crossed a network
            requests.append(dist.irecv(buffer, src=_global(group, source), group=group, tag=tags[span]))
            received += span[2]
        elif source != rank:
            buffers[span] = (torch.empty(0, dtype=torch.uint8), True)
    for other, spans in enumerate(needs):
        if other == rank:
            continue
        for span in dict.fromkeys(spans):
            if owner[span] == rank and span[2]:
                requests.append(
                    dist.isend(buffers[span][0], dst=_global(group, other), group=group, tag=tags[span])
                )
    for request in requests:
        if request is not None:
            request.wait()
    return received


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
