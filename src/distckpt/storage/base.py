"""The storage contract: a flat namespace of named byte blobs under one checkpoint root.

Kept small on purpose (zarr's ``Store``, obstore's capability protocols): every operation the
engine needs, nothing it doesn't. A backend translates names to its own addressing.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator


class Writer(ABC):
    """Sequential writer of one blob; the blob is durable only after :meth:`close`."""

    @abstractmethod
    def write(self, data: memoryview) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Flush and make the blob durable (fsync / complete the upload)."""

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written; never raises."""


class Storage(ABC):
    """A checkpoint root. Names are plain file names (no separators)."""

    root: str
    #: Requests smaller than this are latency-bound (object stores): the reader coalesces
    #: neighbouring chunks into one request even where each could be read in place.
    min_request_bytes: int = 0
    #: Reads in flight per rank at least (object stores hide request latency with more).
    read_concurrency: int = 1

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def list(self) -> list[str]:
        """Names of the blobs under the root (empty if the root does not exist)."""

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def read(self, name: str) -> bytes: ...

    @abstractmethod
    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes at ``offset``; raise if the blob is shorter."""

    @abstractmethod
    def open_writer(self, name: str) -> Writer: ...

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` durably; readers see the old or the new blob."""

    def create_atomic(self, name: str, data: bytes) -> None:
        """Like :meth:`write_atomic`, but raise FileExistsError if ``name`` exists, atomically
        with respect to other writers (backends override this default, which is not)."""
        if self.exists(name):
            raise FileExistsError(self.describe(name))
        self.write_atomic(name, data)

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` if present."""

    @abstractmethod
    def prepare_root(self) -> None:
        """Create the root if needed (called by the coordinator before a save)."""

    @contextlib.contextmanager
    def upload_slot(self) -> Iterator[None]:
        """Held by a rank while it writes its data files (object stores may throttle uploads)."""
        yield

    def describe(self, name: str = "") -> str:
        """A user-facing location for error messages."""
        return f"{self.root.rstrip('/')}/{name}" if name else self.root
