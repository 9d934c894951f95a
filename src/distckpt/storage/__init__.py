"""Storage backends behind one small contract (:class:`Storage`)."""

from __future__ import annotations

import os

from .base import Storage, Writer
from .local import LocalStorage
from .memory import MemoryStorage


def open_storage(location: "str | os.PathLike | Storage") -> Storage:
    """The storage for a checkpoint location: a directory path (or an existing Storage)."""
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise NotImplementedError(
            f"{text}: the {scheme!r} storage backend is not available in this release; "
            "use a local or mounted directory"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStorage(text)


__all__ = ["Storage", "Writer", "LocalStorage", "MemoryStorage", "open_storage"]
