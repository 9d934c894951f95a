"""Storage backends behind one small contract (:class:`Storage`)."""

from __future__ import annotations

import os

from .base import Storage, Writer
from .local import LocalStorage
from .memory import MemoryStorage
from .object_store import CachedStorage, ObjectStoreOptions, is_url


def open_storage(location: "str | os.PathLike | Storage", options: ObjectStoreOptions | None = None) -> Storage:
    """The storage for a checkpoint location: a directory path, a ``file://`` URL, an object
    store URL (``s3://bucket/prefix``, ``gs://``, ``az://``), or an existing Storage.

    ``options`` configures object stores (default: the ``AWS_*`` environment variables).
    """
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if is_url(text):
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise ImportError(
                f"{text}: object stores need the obstore client: pip install 'distckpt[s3]'"
            ) from None
        from .object_store import ObjectStoreStorage

        return ObjectStoreStorage(text, options)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise NotImplementedError(
            f"{text}: no storage backend for {scheme!r} URLs; use a directory, file://, s3://, "
            "gs:// or az://"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStorage(text)


def storage_for(
    location: "str | os.PathLike | Storage",
    *,
    throttle_uploads: bool = False,
    pre_download: bool = False,
    work_dir: "str | os.PathLike | None" = None,
) -> Storage:
    """``location`` with OLMo-core's options applied: ``throttle_uploads`` for object-store
    URLs, and ``pre_download`` (a local cache of the files read, under ``work_dir``) for any
    remote location. Local directories are returned as they are."""
    if isinstance(location, Storage):
        storage = location
    elif is_url(os.fspath(location)):
        storage = open_storage(location, ObjectStoreOptions(throttle_uploads=throttle_uploads))
    else:
        return open_storage(location)
    if pre_download and not isinstance(storage, (LocalStorage, CachedStorage)):
        import tempfile

        storage = CachedStorage(storage, work_dir or tempfile.gettempdir())
    return storage


__all__ = [
    "CachedStorage", "LocalStorage", "MemoryStorage", "ObjectStoreOptions", "Storage", "Writer",
    "open_storage", "storage_for",
]
