"""Loading ShardedTensors and ShardedObjects of one rank from an opened checkpoint."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import checksum
from ..errors import ChecksumError, MismatchError, MissingKeyError, StorageError, TruncatedFileError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.index import CheckpointIndex
from ..mapping import ShardedObject, ShardedTensor
from ..planning.boxes import Box
from ..planning.load_plan import ChunkRead, plan_reads
from ..planning.shards import TensorShard
from .checkpoint import CheckpointReader
from .io import ChunkFiller, ReadStats


def check_request(reader: CheckpointReader, st: ShardedTensor) -> None:
    """Raise a clear error if ``st`` cannot be filled from the checkpoint."""
    entry = reader.index.tensors.get(st.key)
    if entry is None:
        raise MissingKeyError(missing_key_message(reader, "tensor", st.key))
    if dtype_from_name(entry.dtype) != st.dtype:
        raise MismatchError(
            f"{reader.path}: tensor {st.key!r} was saved as {entry.dtype} but is requested as "
            f"{str(st.dtype).replace('torch.', '')}; request the saved dtype and cast after loading"
        )
    if len(entry.shape) != len(st.global_shape):
        raise MismatchError(
            f"{reader.path}: tensor {st.key!r} was saved with {len(entry.shape)} dimensions "
            f"{entry.shape} but is requested with {len(st.global_shape)} {st.global_shape}; the "
            "number of dimensions must match (check prepend_axis_num and the model configuration)"
        )
    if entry.shape != st.global_shape:
        if not st.allow_shape_mismatch:
            raise MismatchError(
                f"{reader.path}: tensor {st.key!r} was saved with global shape {entry.shape} but "
                f"is requested with {st.global_shape}; fix the model configuration, or set "
                "allow_shape_mismatch=True on the ShardedTensor to load the overlapping region"
            )


def missing_key_message(reader: CheckpointReader, kind: str, key: str) -> str:
    known = sorted(reader.index.tensors if kind == "tensor" else reader.index.objects)
    close = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:3] or known[:3]
    return (
        f"{reader.path}: {kind} {key!r} is not in the checkpoint ({len(known)} {kind}s, e.g. "
        f"{close}); fix the key, or load with strict='log_unexpected' (or another non-raising "
        "StrictHandling mode) to skip keys the checkpoint lacks"
    )


@dataclass
class TensorLoad:
    """The planned load of this rank's ShardedTensors: reads, and where their bytes go."""

    reads: list[ChunkRead]
    filler: ChunkFiller
    write_back: list[tuple[torch.Tensor, torch.Tensor]]

    def finish(self) -> None:
        """Copy staged destinations back into tensors that could not be filled in place."""
        for original, staged in self.write_back:
            with torch.no_grad():
                original.copy_(staged)


def plan_tensor_load(reader: CheckpointReader, sharded_tensors: Sequence[ShardedTensor]) -> TensorLoad:
    """Check the requests, allocate missing data (on CPU) and plan the reads."""
    index = reader.index
    requests: list[TensorShard] = []
    destinations: list[torch.Tensor] = []
    dtypes: list[torch.dtype] = []
    write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for st in sharded_tensors:
        check_request(reader, st)
        if st.data is None or st.data.device.type == "meta":
            st.init_data("cpu", torch.zeros if st.allow_shape_mismatch else torch.empty)
        data = st.data
        assert data is not None
        if data.device.type == "cpu" and data.is_contiguous():
            destination = data.detach()  # same memory; in-place copies into Parameters are fine
        else:
            destination = data.detach().to("cpu", copy=True).contiguous()
            write_back.append((data, destination))
        requests.append(
            TensorShard(
                st.key,
                index.tensors[st.key].dtype,
                itemsize(st.dtype),
                st.global_shape,
                Box(st.global_offset, st.box_shape),
                None if st.flattened_range is None else (st.flattened_range.start, st.flattened_range.stop),
            )
        )
        destinations.append(destination)
        dtypes.append(st.dtype)
    filler = ChunkFiller(reader.storage, destinations, dtypes, index.block_bytes)
    return TensorLoad(_planned_reads(reader, requests), filler, write_back)


def load_tensors(
    reader: CheckpointReader, sharded_tensors: Sequence[ShardedTensor], thread_count: int = 1
) -> ReadStats:
    """Fill each ``ShardedTensor.data`` in place (allocating it on CPU if it is None or meta)."""
    planned = plan_tensor_load(reader, sharded_tensors)
    stats = planned.filler.run(planned.reads, thread_count)
    planned.finish()
    return stats


# Read plans of recent (checkpoint, request layout) pairs: repeated loads skip planning.
_READ_PLANS: "OrderedDict[tuple, list[ChunkRead]]" = OrderedDict()
_READ_PLANS_SIZE = 8
_READ_PLANS_LOCK = threading.Lock()


def _planned_reads(reader: CheckpointReader, requests: list[TensorShard]) -> list[ChunkRead]:
    meta = reader.metadata
    key = (reader.storage.root, meta.save_id, meta.index.crc32c, tuple(requests))
    with _READ_PLANS_LOCK:
        cached = _READ_PLANS.get(key)
    if cached is not None:
        return cached
    reads = plan_reads(requests, reader.index.tensors, reader.index.block_bytes)
    with _READ_PLANS_LOCK:
        _READ_PLANS[key] = reads
        while len(_READ_PLANS) > _READ_PLANS_SIZE:
            _READ_PLANS.popitem(last=False)
    return reads


def load_objects(
    reader: CheckpointReader,
    sharded_objects: Sequence[ShardedObject],
    deserialize: Callable[[bytes, str], object],
) -> list[object]:
    """Return the payload of each requested ShardedObject."""
    out = []
    for obj in sharded_objects:
        raw = read_object_bytes(reader, obj)
        out.append(deserialize(raw, f"{reader.storage.describe()} object {obj.unique_key!r}"))
    return out


def read_object_bytes(reader: CheckpointReader, obj: ShardedObject) -> bytes:
    index: CheckpointIndex = reader.index
    entry = index.objects.get(obj.unique_key)
    if entry is None:
        saved = sorted({o.global_shape for o in index.objects.values() if o.key == obj.key})
        if saved:
            raise MismatchError(
                f"{reader.path}: ShardedObject {obj.key!r} was saved as a grid of shape "
                f"{saved[0]} but is requested as shard {obj.global_offset} of a grid of shape "
                f"{obj.global_shape}; per-shard objects cannot be resharded: load with the saved "
                "layout, or leave this object out of the request"
            )
        raise MissingKeyError(missing_key_message(reader, "object", obj.unique_key))
    where = reader.storage.describe(entry.file)
    try:
        size = reader.storage.size(entry.file)
    except FileNotFoundError:
        raise StorageError(f"{where}: data file is missing (holds object {obj.unique_key!r})") from None
    if entry.data_offset + entry.nbytes > size:
        raise TruncatedFileError(
            f"{where}: object {obj.unique_key!r} needs bytes {entry.data_offset}.."
            f"{entry.data_offset + entry.nbytes} but the file has {size} (truncated)"
        )
    buffer = bytearray(entry.nbytes)
    if entry.nbytes:
        reader.storage.read_into(entry.file, entry.data_offset, memoryview(buffer))
    bad = checksum.first_mismatch(memoryview(buffer), index.block_bytes, entry.crc32c)
    if bad is not None:
        raise ChecksumError(
            f"{reader.storage.describe(entry.file)}: checksum mismatch in ShardedObject "
            f"{obj.unique_key!r}: the file is corrupt; restore it or load another checkpoint"
        )
    return bytes(buffer)
