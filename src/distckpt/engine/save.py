"""The save protocol's building blocks: describe local shards, write them, commit.

Commit protocol (see docs/format.md): every rank writes and fsyncs its data files, named with
a fresh save id; the coordinator then writes the index and the common state, and finally
replaces ``metadata.json`` atomically. Until that rename the directory still shows the previous
checkpoint (or none), never a mix; afterwards the previous checkpoint's files are removed.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import checksum
from ..errors import CheckpointExistsError, CheckpointingException
from ..format.dtypes import dtype_name, itemsize
from ..format.index import DEFAULT_BLOCK_BYTES, CheckpointIndex, ChunkEntry, ObjectEntry, TensorEntry
from ..format.metadata import METADATA_FILE, CheckpointMetadata, FileRef
from ..mapping import ShardedObject, ShardedTensor, is_main_replica
from ..planning.boxes import Box
from ..planning.gcpause import paused_gc
from ..planning.shards import ObjectShard, TensorShard
from ..storage import Storage
from .checkpoint import read_metadata

logger = logging.getLogger(__name__)


@dataclass
class LocalShards:
    """What this rank saves: plain descriptions plus the data they describe."""

    tensors: list[TensorShard] = field(default_factory=list)
    tensor_data: list[torch.Tensor] = field(default_factory=list)
    objects: list[ObjectShard] = field(default_factory=list)
    object_bytes: list[bytes] = field(default_factory=list)


def describe_local(
    sharded_tensors: Sequence[ShardedTensor],
    sharded_objects: Sequence[ShardedObject],
    serialize: Callable[[Any], bytes],
) -> LocalShards:
    """Describe this rank's shards (no data is copied here)."""
    local = LocalShards()
    for st in sharded_tensors:
        if st.data is None or st.data.device.type == "meta":
            raise CheckpointingException(
                f"ShardedTensor {st.key!r} has no data to save (data is "
                f"{'None' if st.data is None else 'on the meta device'})"
            )
        # Stays on its device: only the chunks this rank writes are copied to host, later.
        data = st.data.detach().resolve_conj().resolve_neg()
        local.tensors.append(
            TensorShard(
                st.key,
                dtype_name(st.dtype),
                itemsize(st.dtype),
                st.global_shape,
                Box(st.global_offset, st.box_shape),
                None if st.flattened_range is None else (st.flattened_range.start, st.flattened_range.stop),
                is_main_replica(st.replica_id),
            )
        )
        local.tensor_data.append(data)
    for obj in sharded_objects:
        try:
            raw = serialize(obj.data)
        except CheckpointingException as exc:
            raise CheckpointingException(f"ShardedObject {obj.unique_key!r}: {exc}") from exc
        local.objects.append(
            ObjectShard(obj.unique_key, obj.key, obj.global_shape, obj.global_offset, len(raw),
                        is_main_replica(obj.replica_id))
        )
        local.object_bytes.append(raw)
    return local


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def check_destination(storage: Storage, overwrite: bool) -> None:
    """Coordinator-side check before anything is written."""
    if storage.exists(METADATA_FILE) and not overwrite:
        raise CheckpointExistsError(
            f"{storage.root} already holds a checkpoint; pass overwrite=True to replace it, or "
            "save to another directory"
        )
    storage.prepare_root()


def build_index(
    all_tensors: Sequence[Sequence[TensorShard]],
    written: Sequence[tuple[list[tuple[str, ChunkEntry]], list[tuple[str, ObjectEntry]]]],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> CheckpointIndex:
    """Assemble the index from every rank's descriptions and write records."""
    with paused_gc():  # millions of acyclic objects at scale; a full collection costs seconds
        return _build_index(all_tensors, written, block_bytes)


def _build_index(
    all_tensors: Sequence[Sequence[TensorShard]],
    written: Sequence[tuple[list[tuple[str, ChunkEntry]], list[tuple[str, ObjectEntry]]]],
    block_bytes: int,
) -> CheckpointIndex:
    index = CheckpointIndex(block_bytes=block_bytes)
    tensors = index.tensors
    for shards in all_tensors:
        for shard in shards:
            if shard.key not in tensors:  # setdefault would build an entry per shard
                tensors[shard.key] = TensorEntry(shard.dtype, shard.global_shape)
    for tensor_records, object_records in written:
        for key, chunk in tensor_records:
            index.tensors[key].chunks.append(chunk)
        for unique_key, entry in object_records:
            index.objects[unique_key] = entry
    for tensor in index.tensors.values():
        tensor.chunks.sort(key=lambda c: c.offset)
    index.tensors = dict(sorted(index.tensors.items()))
    index.objects = dict(sorted(index.objects.items()))
    return index


def _write_ref(storage: Storage, name: str, raw: bytes) -> FileRef:
    storage.write_atomic(name, raw)
    return FileRef(name, len(raw), checksum.crc32c(raw))


def commit(
    storage: Storage,
    save_id: str,
    index: CheckpointIndex,
    common_bytes: bytes,
    *,
    content_metadata: dict | None,
    world_size: int,
    sharded_backend: tuple[str, int],
    common_backend: tuple[str, int],
    overwrite: bool = True,
) -> CheckpointMetadata:
    """Coordinator only: write index and common state, then the commit marker; then remove the
    files of the checkpoint this one replaces."""
    from .. import __version__

    previous = _previous_files(storage)
    index_ref = _write_ref(storage, f"index-{save_id}.json", index.to_json())
    common_ref = _write_ref(storage, f"common-{save_id}.pt", common_bytes)
    metadata = CheckpointMetadata(
        save_id=save_id,
        index=index_ref,
        common=common_ref,
        sharded_backend=sharded_backend[0],
        sharded_backend_version=sharded_backend[1],
        common_backend=common_backend[0],
        common_backend_version=common_backend[1],
        content_metadata=content_metadata,
        world_size=world_size,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        writer=f"distckpt {__version__}",
    )
    if overwrite:
        storage.write_atomic(METADATA_FILE, metadata.to_json())
    else:
        try:  # create-only: of two jobs saving here at once, exactly one commits
            storage.create_atomic(METADATA_FILE, metadata.to_json())
        except FileExistsError:
            raise CheckpointExistsError(
                f"{storage.root}: another save committed a checkpoint here while this one was writing; "
                "this save was discarded (pass overwrite=True to replace, or use another directory)"
            ) from None
    keep = set(index.files) | {index_ref.file, common_ref.file, METADATA_FILE}
    for name in previous - keep:
        try:
            storage.delete(name)
        except OSError as exc:  # the new checkpoint is committed; leftovers only cost space
            logger.warning("could not remove %s of the replaced checkpoint: %s", name, exc)
    return metadata


def discard_save(storage: Storage, save_id: str | None, rank: int, is_coordinator: bool) -> None:
    """Best-effort removal of the files a failed save wrote (never of a committed checkpoint):
    each rank removes its data files, the coordinator the index and common state."""
    if save_id is None:
        return
    try:
        if storage.exists(METADATA_FILE) and read_metadata(storage).save_id == save_id:
            return  # the commit marker was written: this save is the checkpoint now
    except (CheckpointingException, OSError):
        pass
    prefixes = [f"data-{save_id}-r{rank:05d}-"]
    if is_coordinator:
        prefixes += [f"index-{save_id}", f"common-{save_id}"]
    try:
        for name in storage.list():
            if name.startswith(tuple(prefixes)):
                storage.delete(name)
    except OSError as exc:
        logger.warning("could not remove the files of the failed save %s: %s", save_id, exc)


def _previous_files(storage: Storage) -> set[str]:
    """Files of the committed checkpoint about to be replaced: every file carrying its save id
    (data files dropped from its index by ``remove_sharded_tensors`` included)."""
    if not storage.exists(METADATA_FILE):
        return set()
    try:
        old = read_metadata(storage)
    except (CheckpointingException, OSError) as exc:
        logger.warning("not removing files of the replaced checkpoint in %s: %s", storage.root, exc)
        return set()
    prefixes = tuple(f"{kind}-{old.save_id}" for kind in ("data", "index", "common"))
    return {name for name in storage.list() if name.startswith(prefixes)} | {old.index.file, old.common.file}
