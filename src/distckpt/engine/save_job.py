"""One save, from preparation to commit, shared by the sync and async paths.

1. :func:`prepare_save` (blocking, collective): describe local shards, check the destination,
   validate and plan. An unchanged layout reuses the cached plan: the ranks then exchange only a
   few bytes each instead of every shard description.
2. :meth:`SaveJob.write` (local): write this rank's data files, from the live tensors (sync) or
   from staged copies (async, in a background thread).
3. :meth:`SaveJob.finalize` (collective): agree on the outcome of every rank's writes; the
   coordinator writes the index, the common state and, last, ``metadata.json``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..mapping import ShardedObject, ShardedTensor
from ..planning.save_plan import RankWritePlan, plan_save
from ..planning.shards import ObjectShard, TensorShard
from ..storage import Storage
from ..validation import common_digests, validate_common_consistency, validate_sharding_integrity
from .collective import Coordinator
from .io import write_rank_files
from .save import (
    LocalShards,
    build_index,
    check_destination,
    commit,
    describe_local,
    discard_save,
    new_save_id,
)
from .staging import POOL, StagedChunks, stage


@dataclass
class _CachedPlan:
    plan_id: str
    validated: bool
    plans: list[RankWritePlan]
    all_tensors: list[list[TensorShard]]


# Plans of recent layouts, per process: the second save of the same layout skips planning.
_PLAN_CACHE: "OrderedDict[tuple, _CachedPlan]" = OrderedDict()
_PLAN_CACHE_SIZE = 4
_PLAN_CACHE_LOCK = threading.Lock()


def _layout_key(shards: LocalShards, world_size: int, rank: int) -> tuple:
    objects = tuple((o.unique_key, o.main) for o in shards.objects)
    return (world_size, rank, tuple(shards.tensors), objects)


@dataclass
class SaveOptions:
    validate_access_integrity: bool = True
    preprocess_common: Callable[[Any], Any] | None = None
    content_metadata: dict | None = None
    overwrite: bool = False
    block_bytes: int = 1 << 20
    thread_count: int = 1
    sharded_backend: tuple[str, int] = ("distckpt", 1)
    common_backend: tuple[str, int] = ("torch", 1)


@dataclass
class SaveJob:
    storage: Storage
    coordinator: Coordinator
    options: SaveOptions
    save_id: str
    shards: LocalShards
    plan: RankWritePlan
    all_tensors: list[list[TensorShard]]
    common_bytes: bytes
    plan_cached: bool = False
    staged: StagedChunks | None = field(default=None, repr=False)

    def stage(self) -> None:
        """Copy what this rank writes into reusable host buffers (the async blocking part)."""
        self.staged = stage(self.plan.chunks, self.shards.tensor_data)

    def write(self) -> tuple:
        """Write this rank's data files; returns the index records."""
        rank = self.coordinator.rank
        if self.staged is None and any(t.device.type != "cpu" for t in self.shards.tensor_data):
            self.stage()  # device tensors: copy the chunks to (pinned) host memory first
        if self.staged is not None:
            chunks, data = self.staged.chunks, self.staged.tensors
        else:
            chunks, data = self.plan.chunks, self.shards.tensor_data
        objects = [(self.shards.objects[i], self.shards.object_bytes[i]) for i in self.plan.objects]
        try:
            with self.storage.upload_slot():
                return write_rank_files(
                    self.storage, f"data-{self.save_id}-r{rank:05d}", chunks, data, objects,
                    self.options.block_bytes, self.options.thread_count,
                )
        finally:
            if self.staged is not None:
                POOL.release(self.staged.buffer)
                self.staged = None

    def finalize(self, outcome: Callable[[], tuple]) -> None:
        """Collective: gather every rank's write outcome (``outcome()`` returns the records or
        raises the write's error), then commit; on any failure remove this save's files."""
        coordinator = self.coordinator
        try:
            written = coordinator.exchange("writing data", outcome, to_coordinator=True)

            def commit_here() -> None:
                if coordinator.is_coordinator:
                    commit(
                        self.storage,
                        self.save_id,
                        build_index(self.all_tensors, written, self.options.block_bytes),
                        self.common_bytes,
                        content_metadata=self.options.content_metadata,
                        world_size=coordinator.world_size,
                        sharded_backend=self.options.sharded_backend,
                        common_backend=self.options.common_backend,
                        overwrite=self.options.overwrite,
                    )

            coordinator.exchange("commit", commit_here)
        except Exception:
            discard_save(self.storage, self.save_id, coordinator.rank, coordinator.is_coordinator)
            raise


def prepare_save(
    storage: Storage,
    coordinator: Coordinator,
    collect: Callable[[], tuple[list[ShardedTensor], list[ShardedObject], Any]],
    serialize: Callable[[Any], bytes],
    options: SaveOptions,
) -> SaveJob:
    """Collective: everything before the first byte of data is written.

    ``collect()`` returns this rank's ShardedTensors, ShardedObjects and common state; it runs
    inside the first exchange, so its errors are raised on every rank.
    """
    local: dict[str, Any] = {}

    def describe() -> tuple:
        sharded_tensors, sharded_objects, common = collect()
        shards = describe_local(sharded_tensors, sharded_objects, serialize)
        local["shards"] = shards
        local["common_bytes"] = serialize(common) if coordinator.is_coordinator else b""
        digests = None
        if options.validate_access_integrity:
            checked = common if options.preprocess_common is None else options.preprocess_common(common)
            digests = common_digests(checked)
        key = _layout_key(shards, coordinator.world_size, coordinator.rank)
        local["layout_key"] = key
        with _PLAN_CACHE_LOCK:
            cached = _PLAN_CACHE.get(key)
        local["cached"] = cached
        save_id = None
        if coordinator.is_coordinator:
            check_destination(storage, options.overwrite)
            save_id = new_save_id()
        usable = cached is not None and (cached.validated or not options.validate_access_integrity)
        return (cached.plan_id if usable and cached is not None else None), digests, save_id

    first = coordinator.exchange("save preparation", describe)
    save_id = first[0][2]
    if options.validate_access_integrity:
        validate_common_consistency([g[1] for g in first])
    shards: LocalShards = local["shards"]
    plan_ids = {g[0] for g in first}
    cached: _CachedPlan | None = local["cached"]
    if cached is not None and len(plan_ids) == 1 and None not in plan_ids:  # every rank hit
        plans, all_tensors, plan_cached = cached.plans, cached.all_tensors, True
    else:
        gathered: list[Any] = coordinator.exchange(
            "save planning", lambda: (shards.tensors, shards.objects)
        )
        all_tensors = [g[0] for g in gathered]
        all_objects: list[list[ObjectShard]] = [g[1] for g in gathered]
        if options.validate_access_integrity:
            validate_sharding_integrity(all_tensors, all_objects)
        plans = plan_save(all_tensors, all_objects)
        plan_cached = False
        with _PLAN_CACHE_LOCK:
            _PLAN_CACHE[local["layout_key"]] = _CachedPlan(
                save_id, options.validate_access_integrity, plans, all_tensors
            )
            while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
                _PLAN_CACHE.popitem(last=False)
    return SaveJob(
        storage, coordinator, options, save_id, shards, plans[coordinator.rank], all_tensors,
        local["common_bytes"], plan_cached,
    )
