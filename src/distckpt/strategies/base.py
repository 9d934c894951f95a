"""Strategy interfaces and the registry of default strategies keyed by (backend, version).

A strategy decides *how* one part of a checkpoint is stored; :mod:`distckpt.serialization`
runs the steps and the commit protocol around it. Register a strategy with
:func:`register_default_strategy` to make ``(backend, version)`` tuples resolve to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

from ..errors import CheckpointingException, UnsupportedFormatError
from ..mapping import CommonStateDict, ShardedStateDict, StateDict


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


_DEFAULT_STRATEGIES: dict[StrategyAction, dict[tuple[str, int], Any]] = {a: {} for a in StrategyAction}


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: Any) -> None:
    """Make ``(backend, version)`` resolve to ``strategy`` (an instance) for ``action``."""
    _DEFAULT_STRATEGIES[action][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    try:
        return _DEFAULT_STRATEGIES[action][(backend, version)]
    except KeyError:
        known = sorted(_DEFAULT_STRATEGIES[action])
        error = UnsupportedFormatError if action.value.startswith("load") else CheckpointingException
        hint = "; a newer distckpt may read it" if action.value.startswith("load") else ""
        raise error(
            f"no {action.value} strategy for backend {backend!r} version {version}; available: "
            f"{known}{hint}"
        ) from None


class _Strategy(ABC):  # noqa: B024 - subclasses declare the abstract methods
    backend: str = ""
    version: int = 0

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != self.backend:
            raise UnsupportedFormatError(
                f"{type(self).__name__} reads backend {self.backend!r}, the checkpoint was written "
                f"with {loaded_backend!r}; pass sharded_strategy=None to pick the right one"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > self.version:
            raise UnsupportedFormatError(
                f"{type(self).__name__} reads {self.backend!r} up to version {self.version}, the "
                f"checkpoint has version {loaded_version}; upgrade distckpt"
            )


class SaveCommonStrategy(_Strategy):
    """Serializes the common state dict and ShardedObject payloads."""

    @abstractmethod
    def serialize(self, obj: Any) -> bytes: ...


class LoadCommonStrategy(_Strategy):
    """Reads what :class:`SaveCommonStrategy` wrote."""

    @abstractmethod
    def deserialize(self, raw: bytes, where: str) -> Any: ...

    @abstractmethod
    def load_common(self, checkpoint_dir: Any) -> CommonStateDict: ...


class SaveShardedStrategy(_Strategy):
    """Writes ShardedTensors and ShardedObjects. ``thread_count`` is the number of data files
    (each written by its own thread) per rank."""

    can_handle_sharded_objects = True

    def __init__(self, thread_count: int = 1) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.thread_count = thread_count

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any, **kwargs: Any) -> None:
        """Save with this strategy (same as ``distckpt.save(..., sharded_strategy=self)``)."""
        from ..serialization import save

        save(sharded_state_dict, checkpoint_dir, sharded_strategy=self, **kwargs)


class LoadShardedStrategy(_Strategy):
    """Reads ShardedTensors and ShardedObjects; ``thread_count`` parallel reads per rank."""

    can_handle_sharded_objects = True

    def __init__(self, thread_count: int = 1) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.thread_count = thread_count

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any,
             common_strategy: LoadCommonStrategy | None = None) -> StateDict: ...

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Any) -> ShardedStateDict: ...

    @abstractmethod
    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict: ...

    @abstractmethod
    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> None: ...
