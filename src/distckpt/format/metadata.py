"""``metadata.json``: the commit marker. It is written last, atomically, by one coordinator
after every rank succeeded; a directory without it holds no complete checkpoint."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import checksum
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .index import is_safe_file_name

METADATA_FILE = "metadata.json"
FORMAT_NAME = "distckpt"
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # version 2 changed only the index (docs/format.md section 9)


@dataclass(frozen=True)
class FileRef:
    """A file of the checkpoint with its size and crc32c of its whole content."""

    file: str
    nbytes: int
    crc32c: int


@dataclass
class CheckpointMetadata:
    save_id: str
    index: FileRef
    common: FileRef
    sharded_backend: str = "distckpt"
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1
    content_metadata: dict | None = None
    world_size: int = 1
    created: str = ""
    writer: str = ""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["checksum"] = _self_checksum(doc)
        return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, path: str) -> "CheckpointMetadata":
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{path}: expected a JSON object")
        if doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(
                f"{path}: format is {doc.get('format')!r:.60}, expected {FORMAT_NAME!r}"
            )
        if type(doc.get("version")) is not int or doc.get("version") not in READABLE_FORMAT_VERSIONS:
            raise UnsupportedFormatError(
                f"{path}: format version {doc.get('version')!r:.20} is not supported by this "
                f"release (reads versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))}); "
                "upgrade distckpt"
            )
        stored = doc.pop("checksum", None)
        if stored != _self_checksum(doc):
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch (stored {stored!r:.20}); the commit marker is damaged"
            )
        try:
            meta = cls(
                **{k: v for k, v in doc.items() if k not in ("index", "common")},
                index=_file_ref(doc["index"], path, "index"),
                common=_file_ref(doc["common"], path, "common"),
            )
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{path}: missing or unexpected field ({exc})") from None
        _check_fields(meta, path)
        if meta.content_metadata is not None and not isinstance(meta.content_metadata, dict):
            raise CorruptCheckpointError(f"{path}: content_metadata must be an object or null")
        return meta


_SAVE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_fields(meta: CheckpointMetadata, path: str) -> None:
    problems = []
    if not isinstance(meta.save_id, str) or not _SAVE_ID.fullmatch(meta.save_id):
        problems.append("save_id must be 1-64 characters of [A-Za-z0-9_-]")
    if not _is_int(meta.world_size) or meta.world_size < 1:
        problems.append("world_size must be a positive integer")
    for name in ("sharded_backend", "common_backend", "created", "writer"):
        if not isinstance(getattr(meta, name), str):
            problems.append(f"{name} must be a string")
    for name in ("sharded_backend_version", "common_backend_version"):
        if not _is_int(getattr(meta, name)) or getattr(meta, name) < 1:
            problems.append(f"{name} must be a positive integer")
    if not isinstance(meta.extra, dict):
        problems.append("extra must be an object")
    if problems:
        raise CorruptCheckpointError(f"{path}: {'; '.join(problems)}")


def _file_ref(value: Any, path: str, name: str) -> FileRef:
    if (
        not isinstance(value, dict)
        or set(value) != {"file", "nbytes", "crc32c"}
        or not is_safe_file_name(value.get("file"))
        or not all(_is_int(value[k]) and value[k] >= 0 for k in ("nbytes", "crc32c"))
        or value["crc32c"] > 0xFFFFFFFF
    ):
        raise CorruptCheckpointError(
            f"{path}: field {name!r} must be {{file: plain name, nbytes: int, crc32c: int}}"
        )
    return FileRef(value["file"], value["nbytes"], value["crc32c"])


def _self_checksum(doc: dict) -> int:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return checksum.crc32c(canonical)
