"""``metadata.json``: the commit marker. It is written last, atomically, by one coordinator
after every rank succeeded; a directory without it holds no complete checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .. import checksum
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .index import is_safe_file_name

METADATA_FILE = "metadata.json"
FORMAT_NAME = "distckpt"
FORMAT_VERSION = 1


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
    content_metadata: Optional[dict] = None
    world_size: int = 1
    created: str = ""
    writer: str = ""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["checksum"] = _self_checksum(doc)
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

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
        if doc.get("version") != FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{path}: format version {doc.get('version')!r:.20} is not supported by this "
                f"release (reads version {FORMAT_VERSION}); upgrade distckpt"
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
        if not isinstance(meta.save_id, str) or not isinstance(meta.world_size, int):
            raise CorruptCheckpointError(f"{path}: save_id/world_size have the wrong type")
        if meta.content_metadata is not None and not isinstance(meta.content_metadata, dict):
            raise CorruptCheckpointError(f"{path}: content_metadata must be an object or null")
        return meta


def _file_ref(value: Any, path: str, name: str) -> FileRef:
    if (
        not isinstance(value, dict)
        or not is_safe_file_name(value.get("file"))
        or not all(
            isinstance(value.get(k), int) and not isinstance(value.get(k), bool) and value[k] >= 0
            for k in ("nbytes", "crc32c")
        )
    ):
        raise CorruptCheckpointError(
            f"{path}: field {name!r} must be {{file: plain name, nbytes: int, crc32c: int}}"
        )
    return FileRef(value["file"], value["nbytes"], value["crc32c"])


def _self_checksum(doc: dict) -> int:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return checksum.crc32c(canonical)
