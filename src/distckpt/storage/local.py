"""Local (or network-mounted POSIX) filesystem storage."""

from __future__ import annotations

import os
import uuid

from ..errors import StorageError, TruncatedFileError
from .base import Storage, Writer


class _LocalWriter(Writer):
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        try:
            if self.fd >= 0:
                os.close(self.fd)
            os.unlink(self.path)
        except OSError:
            pass


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StorageError(f"{self.root} is a file, not a checkpoint directory") from None

    def size(self, name: str) -> int:
        return os.stat(self._path(name)).st_size

    def read(self, name: str) -> bytes:
        with open(self._path(name), "rb") as f:
            return f.read()

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        fd = os.open(self._path(name), os.O_RDONLY)
        try:
            while view:
                n = os.preadv(fd, [view], offset)
                if n == 0:
                    raise TruncatedFileError(
                        f"{self._path(name)}: file ends before byte {offset + len(view)} "
                        "(truncated data file)"
                    )
                view = view[n:]
                offset += n
        finally:
            os.close(fd)

    def open_writer(self, name: str) -> Writer:
        return _LocalWriter(self._path(name))

    def write_atomic(self, name: str, data: bytes) -> None:
        self._publish(name, data, os.replace)

    def create_atomic(self, name: str, data: bytes) -> None:
        self._publish(name, data, os.link)  # link() fails if the name exists: one creator wins

    def _publish(self, name: str, data: bytes, place) -> None:
        """Write ``data`` to a unique temporary file, fsync it, ``place(tmp, final)`` it, and
        make the directory entry durable."""
        tmp = self._path(f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            place(tmp, self._path(name))
        finally:
            try:
                os.unlink(tmp)  # (after os.replace it is gone already)
            except OSError:
                pass
        self._sync_root()

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def prepare_root(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StorageError(f"{self.root} exists and is not a directory")
        os.makedirs(self.root, exist_ok=True)

    def _sync_root(self) -> None:
        # Make the rename itself durable.
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
