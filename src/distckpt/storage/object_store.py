"""Object stores (S3 and S3-compatible servers; GCS and Azure through the same client) via
``obstore``.

How the contract maps to an object store:

- ``read_into``: one ranged GET per call (the engine already coalesces adjacent ranges and
  reads only what a rank needs); a short answer is a truncated object.
- ``open_writer``: a multipart upload fed from tensor memory, ``part_size`` bytes per part and
  at most ``max_concurrency`` parts in flight (memory per writer: about
  ``part_size * (max_concurrency + 1)``); ``close`` completes it. Nothing is visible under the
  name before that, so an interrupted upload never looks like a complete object.
- ``write_atomic``: a single PUT (readers see the old or the new object), used for the index,
  the common state and, last, the commit marker ``metadata.json``.
- Transient failures (5xx, dropped connections, timeouts) are retried by the client with
  exponential backoff and jitter (``max_retries``, ``retry_timeout``); what remains becomes a
  :class:`~distckpt.errors.StorageError` naming the URL of the object.
- ``throttle_uploads``: ranks on the same host upload one at a time (a host-local file lock
  around each rank's write phase), as OLMo-core's option of that name.

Credentials and endpoint come from the standard ``AWS_*`` environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``), and from an explicit :class:`ObjectStoreOptions`,
whose fields win.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import StorageError, TruncatedFileError
from .base import Storage, Writer

SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss")
T = TypeVar("T")


@dataclass
class ObjectStoreOptions:
    """Connection settings; ``None`` fields fall back to the environment (``AWS_*`` for S3).

    Attributes:
        endpoint: e.g. ``http://127.0.0.1:8333`` for an S3-compatible server.
        access_key_id, secret_access_key, session_token, region: S3 credentials and region.
        allow_http: allow a plain-http endpoint (default: True when ``endpoint`` is http).
        max_retries: retries of a failed request (5xx, connection errors, timeouts).
        retry_timeout: seconds after which a request is not retried any more.
        connect_timeout, timeout: seconds to connect, and for a whole request.
        part_size: bytes per part of a multipart upload.
        max_concurrency: parts of one upload in flight at once.
        throttle_uploads: ranks on one host upload one at a time.
        config: further client settings (obstore's ``S3Config``/``GCSConfig``/``AzureConfig``).
    """

    endpoint: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    region: str | None = None
    allow_http: bool | None = None
    max_retries: int = 6
    retry_timeout: float = 60.0
    connect_timeout: float = 10.0
    timeout: float = 300.0
    part_size: int = 16 * 1024 * 1024
    max_concurrency: int = 4
    throttle_uploads: bool = False
    config: dict[str, Any] = field(default_factory=dict)


def is_url(location: str) -> bool:
    return location.split("://", 1)[0].lower() in SCHEMES if "://" in location else False


class _ObjectWriter(Writer):
    def __init__(self, storage: "ObjectStoreStorage", name: str) -> None:
        import obstore

        self.storage, self.name = storage, name
        options = storage.options
        self.file = storage._call(
            name, lambda: obstore.open_writer(
                storage.store, name, buffer_size=options.part_size, max_concurrency=options.max_concurrency
            )
        )

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(view):
            self.storage._call(self.name, lambda: self.file.write(view))

    def close(self) -> None:
        self.storage._call(self.name, self.file.close)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            # Leaving the context with an exception aborts the multipart upload.
            self.file.__exit__(RuntimeError, RuntimeError("aborted"), None)
        with contextlib.suppress(Exception):
            self.storage.delete(self.name)


class ObjectStoreStorage(Storage):
    """A checkpoint under ``scheme://bucket/prefix`` in an object store."""

    min_request_bytes = 4 << 20
    read_concurrency = 8

    def __init__(self, url: str, options: ObjectStoreOptions | None = None) -> None:
        scheme = url.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise ValueError(f"{url}: not an object store URL (expected one of {', '.join(s + '://' for s in SCHEMES)})")
        bucket_and_prefix = url.split("://", 1)[1].strip("/")
        if not bucket_and_prefix:
            raise ValueError(f"{url}: the URL names no bucket")
        self.root = f"{scheme}://{bucket_and_prefix}"
        self.scheme = scheme
        self.options = options or ObjectStoreOptions()
        self.store = self._open_store()
        self.bytes_read = 0  # statistics: bytes fetched by read/read_into

    def _open_store(self) -> Any:
        from obstore.store import S3Store, from_url

        o = self.options
        retry: Any = {
            "max_retries": o.max_retries,
            "retry_timeout": datetime.timedelta(seconds=o.retry_timeout),
            "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                        "max_backoff": datetime.timedelta(seconds=5), "base": 2},
        }
        client: Any = {
            "connect_timeout": datetime.timedelta(seconds=o.connect_timeout),
            "timeout": datetime.timedelta(seconds=o.timeout),
        }
        try:
            if self.scheme == "s3":
                config: Any = {k: v for k, v in {
                    "endpoint": o.endpoint, "access_key_id": o.access_key_id,
                    "secret_access_key": o.secret_access_key, "session_token": o.session_token,
                    "region": o.region,
                }.items() if v is not None}
                config.update(o.config)
                allow_http = o.allow_http
                if allow_http is None:
                    endpoint = o.endpoint or os.environ.get("AWS_ENDPOINT_URL", "") or os.environ.get("AWS_ENDPOINT", "")
                    env_allow = os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
                    allow_http = env_allow or endpoint.startswith("http://")
                client["allow_http"] = allow_http
                return S3Store.from_url(self.root, config=config or None, client_options=client, retry_config=retry)
            return from_url(self.root, config=o.config or None, client_options=client, retry_config=retry)  # type: ignore[call-overload,arg-type]
        except Exception as exc:  # noqa: BLE001 - configuration errors of any kind
            raise StorageError(f"{self.root}: cannot configure the object store client: {exc}") from exc

    # -- error translation ------------------------------------------------------------------

    def _call(self, name: str, fn: Callable[[], T]) -> T:
        """Run one client operation; failures become distckpt errors naming the object URL."""
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        try:
            return fn()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self.describe(name)}: no such object") from exc
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise StorageError(
                f"{self.describe(name)}: access denied ({_first_line(exc)}); check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ObjectStoreOptions) and the bucket"
            ) from exc
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - obstore raises its own hierarchy and OSErrors
            raise StorageError(
                f"{self.describe(name)}: request failed after retries (max_retries="
                f"{self.options.max_retries}, retry_timeout={self.options.retry_timeout:g} s): "
                f"{_first_line(exc)}"
            ) from exc

    # -- the contract -----------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        import obstore

        try:
            self._call(name, lambda: obstore.head(self.store, name))
        except FileNotFoundError:
            return False
        return True

    def list(self) -> list[str]:
        import obstore

        def names() -> list[str]:
            found: list[str] = []
            for batch in obstore.list(self.store):
                found.extend(meta["path"] for meta in batch)
            return found

        return sorted(n for n in self._call("", names) if "/" not in n)

    def size(self, name: str) -> int:
        import obstore

        return int(self._call(name, lambda: obstore.head(self.store, name))["size"])

    def read(self, name: str) -> bytes:
        import obstore

        data = self._call(name, lambda: obstore.get(self.store, name).bytes())
        self.bytes_read += len(data)
        return bytes(data)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        import obstore

        view = memoryview(buffer).cast("B")
        if not len(view):
            return
        data = self._call(name, lambda: obstore.get_range(self.store, name, start=offset, length=len(view)))
        got = memoryview(data)
        self.bytes_read += len(got)
        if len(got) != len(view):
            raise TruncatedFileError(
                f"{self.describe(name)}: object ends before byte {offset + len(view)} (truncated data file)"
            )
        view[:] = got

    def open_writer(self, name: str) -> Writer:
        return _ObjectWriter(self, name)

    def write_atomic(self, name: str, data: bytes) -> None:
        import obstore

        self._call(name, lambda: obstore.put(self.store, name, data))

    def create_atomic(self, name: str, data: bytes) -> None:
        """A conditional PUT (``If-None-Match: *``): one creator wins."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            self._call(name, lambda: obstore.put(self.store, name, data, mode="create"))
        except StorageError as exc:
            if isinstance(exc.__cause__, (AlreadyExistsError, PreconditionError)):
                raise FileExistsError(f"{self.describe(name)} exists") from exc
            raise

    def delete(self, name: str) -> None:
        import obstore

        with contextlib.suppress(FileNotFoundError):
            self._call(name, lambda: obstore.delete(self.store, name))

    def prepare_root(self) -> None:
        """Nothing to create; a listing surfaces a missing bucket or bad credentials early."""
        self.list()

    @contextlib.contextmanager
    def upload_slot(self) -> Iterator[None]:
        if not self.options.throttle_uploads:
            yield
            return
        with host_lock(f"upload-{self.root.split('://', 1)[1].split('/', 1)[0]}"):
            yield


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """An exclusive lock shared by the processes of this host (``fcntl.flock``)."""
    digest = hashlib.sha1(name.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"distckpt-{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CachedStorage(Storage):
    """``pre_download``: whole files a rank reads are first fetched into a local cache
    (``work_dir``), then read from there; later loads of the same checkpoint reuse them.

    Only immutable files are cached: data files, the index and the common state carry the save
    id in their names, so an overwritten checkpoint never hits stale copies, while
    ``metadata.json`` is always read from the store. A cached copy is used only if its size
    matches the object's; every chunk read from it is still checked against its crc32c.
    Ranks of one host sharing ``work_dir`` download each file once (a host-local lock).
    """

    CACHEABLE = ("data-", "index-", "common-")

    def __init__(self, remote: Storage, work_dir: str | os.PathLike[str]) -> None:
        self.remote = remote
        self.root = remote.root
        digest = hashlib.sha1(remote.root.encode()).hexdigest()[:16]
        self.directory = os.path.join(os.fspath(work_dir), f"distckpt-cache-{digest}")
        self.downloaded = 0  # statistics: bytes fetched into the cache by this process
        self._ready: set[str] = set()  # names whose cached copy was checked in this process

    def _local(self, name: str) -> str | None:
        if not name.startswith(self.CACHEABLE):
            return None
        path = os.path.join(self.directory, name)
        if name in self._ready:
            return path
        size = self.remote.size(name)  # one HEAD per file and load, not per read
        if os.path.exists(path) and os.path.getsize(path) == size:
            self._ready.add(name)
            return path
        os.makedirs(self.directory, exist_ok=True)
        with host_lock(f"cache-{path}"):
            if os.path.exists(path) and os.path.getsize(path) == size:
                return path  # another rank of this host fetched it meanwhile
            partial = f"{path}.{os.getpid()}.partial"
            try:
                with open(partial, "wb") as f:
                    self._download(name, f, size)
                if os.path.getsize(partial) != size:
                    raise TruncatedFileError(
                        f"{self.remote.describe(name)}: downloaded {os.path.getsize(partial)} of {size} bytes"
                    )
                os.replace(partial, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
        self.downloaded += size
        self._ready.add(name)
        return path

    def _download(self, name: str, f: Any, size: int) -> None:
        step = 16 * 1024 * 1024
        buffer = bytearray(min(step, size))
        for start in range(0, size, step):
            view = memoryview(buffer)[: min(step, size - start)]
            self.remote.read_into(name, start, view)
            f.write(view)

    def exists(self, name: str) -> bool:
        return self.remote.exists(name)

    def list(self) -> list[str]:
        return self.remote.list()

    def size(self, name: str) -> int:
        return self.remote.size(name)

    def read(self, name: str) -> bytes:
        path = self._local(name)
        if path is None:
            return self.remote.read(name)
        with open(path, "rb") as f:
            return f.read()

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        path = self._local(name)
        if path is None:
            self.remote.read_into(name, offset, buffer)
            return
        view = memoryview(buffer).cast("B")
        with open(path, "rb") as f:
            f.seek(offset)
            while view:
                n = f.readinto(view)
                if not n:
                    raise TruncatedFileError(f"{path}: cached copy ends before byte {offset + len(buffer)}")
                view = view[n:]

    def open_writer(self, name: str) -> Writer:
        return self.remote.open_writer(name)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.remote.write_atomic(name, data)

    def create_atomic(self, name: str, data: bytes) -> None:
        self.remote.create_atomic(name, data)

    def delete(self, name: str) -> None:
        self.remote.delete(name)

    def prepare_root(self) -> None:
        self.remote.prepare_root()

    def describe(self, name: str = "") -> str:
        return self.remote.describe(name)
