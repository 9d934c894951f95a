"""Opening a committed checkpoint: the commit marker, the index (cached) and whole files."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from .. import checksum
from ..errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from ..format.index import CheckpointIndex
from ..format.metadata import METADATA_FILE, CheckpointMetadata, FileRef
from ..storage import Storage, open_storage

# Parsed indexes by (root, save_id, index crc): repeated loads of one checkpoint parse once.
_INDEX_CACHE: "OrderedDict[tuple, CheckpointIndex]" = OrderedDict()
_INDEX_CACHE_SIZE = 8
_INDEX_CACHE_LOCK = threading.Lock()


class CheckpointReader:
    """A committed checkpoint: its ``metadata.json`` and, on demand, its index and files."""

    def __init__(self, location: "str | os.PathLike | Storage") -> None:
        self.storage = open_storage(location)
        self.metadata = read_metadata(self.storage)
        self._index: CheckpointIndex | None = None

    @property
    def path(self) -> str:
        return self.storage.root

    @property
    def index(self) -> CheckpointIndex:
        if self._index is None:
            ref = self.metadata.index
            cache_key = (self.storage.root, self.metadata.save_id, ref.crc32c)
            with _INDEX_CACHE_LOCK:
                cached = _INDEX_CACHE.get(cache_key)
            if cached is None:
                raw = self.read_whole(ref, what="index")
                cached = CheckpointIndex.from_json(raw, self.storage.describe(ref.file))
                with _INDEX_CACHE_LOCK:
                    _INDEX_CACHE[cache_key] = cached
                    while len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
                        _INDEX_CACHE.popitem(last=False)
            self._index = cached
        return self._index

    def read_whole(self, ref: FileRef, what: str) -> bytes:
        """Read a file referenced by the metadata and check its size and crc32c."""
        where = self.storage.describe(ref.file)
        try:
            raw = self.storage.read(ref.file)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{where}: the {what} file named by metadata.json is missing; the checkpoint "
                "was damaged after it was written"
            ) from None
        except OSError as exc:
            raise StorageError(f"{where}: cannot read the {what} file: {exc}") from exc
        if len(raw) != ref.nbytes:
            raise CorruptCheckpointError(
                f"{where}: the {what} file has {len(raw)} bytes, metadata.json says {ref.nbytes} "
                "(truncated or replaced)"
            )
        if checksum.crc32c(raw) != ref.crc32c:
            raise ChecksumError(f"{where}: checksum mismatch in the {what} file: it is corrupt")
        return raw


def read_metadata(storage: Storage) -> CheckpointMetadata:
    """Read and check the commit marker; name what is wrong if there is none."""
    where = storage.describe(METADATA_FILE)
    try:
        raw = storage.read(METADATA_FILE)
    except FileNotFoundError:
        present = [n for n in storage.list() if not n.startswith(".")]
        if not present:
            raise CheckpointNotFoundError(
                f"{storage.root}: no checkpoint here (the directory is missing or empty); check "
                "the path"
            ) from None
        raise IncompleteCheckpointError(
            f"{storage.root}: incomplete checkpoint: metadata.json (the commit marker written "
            f"last) is missing but {len(present)} other files are present, e.g. {present[:3]}; "
            "the save did not finish: load an earlier checkpoint or save again here"
        ) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{where} is a directory") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{storage.root} is a file, not a checkpoint directory") from None
    except OSError as exc:
        raise StorageError(f"{where}: cannot read: {exc}") from exc
    return CheckpointMetadata.from_json(raw, where)
