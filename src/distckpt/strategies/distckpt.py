"""The default sharded strategy: distckpt format (safetensors data files + JSON index)."""

from __future__ import annotations

from typing import Any

import torch

from .. import checksum
from ..dict_utils import dict_list_map_outplace, nested_values
from ..engine.checkpoint import CheckpointReader
from ..engine.collective import Coordinator
from ..engine.load import load_objects, load_tensors
from ..engine.parallel_load import load_fully_parallel
from ..engine.save import new_save_id
from ..format.dtypes import dtype_from_name
from ..format.index import DEFAULT_BLOCK_BYTES, CheckpointIndex
from ..format.metadata import METADATA_FILE, FileRef
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from .base import LoadCommonStrategy, LoadShardedStrategy, SaveShardedStrategy
from .torch_common import TorchLoadCommonStrategy


def _reader(checkpoint_dir: Any) -> CheckpointReader:
    return checkpoint_dir if isinstance(checkpoint_dir, CheckpointReader) else CheckpointReader(checkpoint_dir)


class DistCkptSaveShardedStrategy(SaveShardedStrategy):
    """Each rank writes its share of the unique shards to ``thread_count`` safetensors files."""

    backend = "distckpt"
    version = 1

    def __init__(self, thread_count: int = 1, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        super().__init__(thread_count)
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.block_bytes = block_bytes


class DistCkptLoadShardedStrategy(LoadShardedStrategy):
    """Reads only the byte ranges this rank needs, ``thread_count`` reads at a time.

    With ``fully_parallel=True`` (and more than one rank), bytes needed by several ranks (e.g.
    data-parallel replicas) are read from storage once, by one of them, and sent to the others
    over the process group; the load is then collective (``serialization.load`` handles it).
    """

    backend = "distckpt"
    version = 1

    def __init__(self, thread_count: int = 1, fully_parallel: bool = False) -> None:
        super().__init__(thread_count)
        self.fully_parallel = fully_parallel
        self.last_bytes: dict[str, int] = {}

    @property
    def collective(self) -> bool:
        """Whether :meth:`load` must be called on every rank with a coordinator."""
        return self.fully_parallel

    def load(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Any,
        common_strategy: LoadCommonStrategy | None = None,
        coordinator: Coordinator | None = None,
    ) -> StateDict:
        reader = _reader(checkpoint_dir)
        leaves = list(nested_values(sharded_state_dict)) if sharded_state_dict else []
        tensors = [x for x in leaves if isinstance(x, ShardedTensor)]
        objects = [x for x in leaves if isinstance(x, ShardedObject)]
        deserialize = (common_strategy or TorchLoadCommonStrategy()).deserialize
        if self.fully_parallel and coordinator is not None and coordinator.world_size > 1:
            loaded, self.last_bytes = load_fully_parallel(
                coordinator, reader, tensors, objects, deserialize, self.thread_count
            )
        else:
            stats = load_tensors(reader, tensors, self.thread_count)
            loaded = load_objects(reader, objects, deserialize)
            self.last_bytes = {"read": stats.bytes_read, "received": 0}
        payloads = {id(o): p for o, p in zip(objects, loaded)}

        def value(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return x.data
            if isinstance(x, ShardedObject):
                return payloads[id(x)]
            return x

        return dict_list_map_outplace(value, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        index = _reader(checkpoint_dir).index
        return {
            key: ShardedTensor.from_rank_offsets(
                key, torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
            )
            for key, entry in index.tensors.items()
        }

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        reader = _reader(checkpoint_dir)
        metadata = self.load_tensors_metadata(reader)
        for unique_key in reader.index.objects:
            metadata[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
        return metadata

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> None:
        """Drop tensors whose key starts with ``key_prefix`` from the index (one process).

        The new index is committed like a save (new file, then an atomic ``metadata.json``
        replacement); the dropped chunks' bytes stay in the data files until the next overwrite.
        """
        reader = _reader(checkpoint_dir)
        old = reader.index
        kept = {k: v for k, v in old.tensors.items() if not k.startswith(key_prefix)}
        if len(kept) == len(old.tensors):
            return
        index = CheckpointIndex(tensors=kept, objects=old.objects, block_bytes=old.block_bytes)
        raw = index.to_json()
        name = f"index-{reader.metadata.save_id}-{new_save_id()}.json"
        storage = reader.storage
        storage.write_atomic(name, raw)
        metadata = reader.metadata
        old_index_file = metadata.index.file
        metadata.index = FileRef(name, len(raw), checksum.crc32c(raw))
        storage.write_atomic(METADATA_FILE, metadata.to_json())
        storage.delete(old_index_file)
