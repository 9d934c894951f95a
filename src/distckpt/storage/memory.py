"""In-memory storage: for tests and for planning experiments without a disk."""

from __future__ import annotations

import threading

from ..errors import TruncatedFileError
from .base import Storage, Writer


class _MemoryWriter(Writer):
    def __init__(self, storage: "MemoryStorage", name: str) -> None:
        self.storage, self.name, self.parts = storage, name, []  # type: ignore[var-annotated]

    def write(self, data: memoryview) -> None:
        self.parts.append(bytes(data))

    def close(self) -> None:
        with self.storage.lock:
            self.storage.blobs[self.name] = b"".join(self.parts)

    def abort(self) -> None:
        self.parts = []


class MemoryStorage(Storage):
    """A dict of blobs; ``MemoryStorage("mem://x")`` instances with the same root do not share."""

    def __init__(self, root: str = "memory://") -> None:
        self.root = root
        self.blobs: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def exists(self, name: str) -> bool:
        return name in self.blobs

    def list(self) -> list[str]:
        return sorted(self.blobs)

    def size(self, name: str) -> int:
        return len(self._get(name))

    def _get(self, name: str) -> bytes:
        try:
            return self.blobs[name]
        except KeyError:
            raise FileNotFoundError(f"{self.describe(name)}: no such blob") from None

    def read(self, name: str) -> bytes:
        return self._get(name)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        blob = self._get(name)
        view = memoryview(buffer).cast("B")
        if offset + len(view) > len(blob):
            raise TruncatedFileError(f"{self.describe(name)}: blob ends before byte {offset + len(view)}")
        view[:] = blob[offset : offset + len(view)]

    def open_writer(self, name: str) -> Writer:
        return _MemoryWriter(self, name)

    def write_atomic(self, name: str, data: bytes) -> None:
        with self.lock:
            self.blobs[name] = bytes(data)

    def create_atomic(self, name: str, data: bytes) -> None:
        with self.lock:
            if name in self.blobs:
                raise FileExistsError(self.describe(name))
            self.blobs[name] = bytes(data)

    def delete(self, name: str) -> None:
        self.blobs.pop(name, None)

    def prepare_root(self) -> None:
        pass
