"""Common state and ShardedObject payloads as ``torch.save`` bytes, read with
``torch.load(weights_only=True)`` unless the caller opts into full pickle."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import CheckpointingException, CorruptCheckpointError, UnsafeCheckpointError
from ..mapping import CommonStateDict
from .base import LoadCommonStrategy, SaveCommonStrategy


class TorchSaveCommonStrategy(SaveCommonStrategy):
    backend = "torch"
    version = 1

    def serialize(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        try:
            torch.save(obj, buffer)
        except Exception as exc:  # noqa: BLE001 - pickling can fail with any error type
            raise CheckpointingException(
                f"cannot serialize {_culprit(obj)} with torch.save: {type(exc).__name__}: {exc}; "
                "keep only picklable values (tensors, numbers, strings, containers) in the state, "
                "or wrap live objects in LocalNonPersistentObject"
            ) from exc
        return buffer.getvalue()


def _culprit(obj: Any, path: str = "") -> str:
    """Name the first leaf that does not pickle (the error path only)."""
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in children:
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001
            return _culprit(value, f"{path}[{key!r}]")
    return f"the value at {path}" if path else "the value"


class TorchLoadCommonStrategy(LoadCommonStrategy):
    """``allow_pickle=True`` lets ``torch.load`` run full pickle: only for trusted checkpoints."""

    backend = "torch"
    version = 1

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    def deserialize(self, raw: bytes, where: str) -> Any:
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            if not self.allow_pickle and "weights_only" in str(exc).lower().replace(" ", "_"):
                reason = next((line for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
                raise UnsafeCheckpointError(
                    f"{where} holds Python objects that only full pickle can rebuild, which can run "
                    f"arbitrary code ({reason.strip() or 'non-tensor globals'}). If you trust this "
                    "checkpoint, pass allow_pickle=True (or allow the classes with "
                    "torch.serialization.add_safe_globals)"
                ) from None
            raise CorruptCheckpointError(f"{where}: cannot unpickle: {exc}") from None
        except (RuntimeError, EOFError, ValueError, OSError) as exc:
            raise CorruptCheckpointError(f"{where}: cannot be read by torch.load: {exc}") from None

    def load_common(self, checkpoint_dir: Any) -> CommonStateDict:
        from ..engine.checkpoint import CheckpointReader

        reader = checkpoint_dir if isinstance(checkpoint_dir, CheckpointReader) else CheckpointReader(checkpoint_dir)
        ref = reader.metadata.common
        raw = reader.read_whole(ref, what="common state")
        return self.deserialize(raw, reader.storage.describe(ref.file))
