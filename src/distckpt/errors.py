"""The one error hierarchy of distckpt.

Every error the library raises on purpose derives from :class:`CheckpointingException`, an
ordinary ``Exception`` (torch DCP's ``CheckpointException`` is a ``BaseException``, which slips
past ``except Exception`` handlers). Where a builtin describes the failure too, it is a second
parent, so ``except FileNotFoundError`` keeps working for callers who know nothing of distckpt.
"""

from __future__ import annotations


class CheckpointingException(Exception):
    """Base class of every error raised by distckpt (name kept from Megatron-Core)."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """The path holds no checkpoint at all."""


class IncompleteCheckpointError(CheckpointingException, FileNotFoundError):
    """The path holds pieces of a checkpoint but no commit marker (``metadata.json``), or the
    marker references a file that is missing: the save that produced it did not finish."""


class CheckpointExistsError(CheckpointingException, FileExistsError):
    """A save would replace an existing checkpoint and the caller did not allow overwriting."""


class CorruptCheckpointError(CheckpointingException, ValueError):
    """A file of the checkpoint cannot be parsed or contradicts the format specification."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read back do not match the crc32c recorded when they were written."""


class TruncatedFileError(CorruptCheckpointError):
    """A file of the checkpoint is shorter than the index says."""


class UnsupportedFormatError(CheckpointingException, ValueError):
    """The checkpoint was written in a format or version this release cannot read."""


class MismatchError(CheckpointingException, ValueError):
    """The requested state dict disagrees with the checkpoint (dtype, shape, layout)."""


class MissingKeyError(CheckpointingException, LookupError):
    """A requested key is not in the checkpoint."""


class ShardingValidationError(CheckpointingException, ValueError):
    """The shards of all ranks do not describe each global tensor exactly once, or the common
    state differs across ranks."""


class UnsafeCheckpointError(CheckpointingException):
    """Loading would need full pickle (arbitrary code execution) and the caller did not opt in."""


class ConcurrentModificationError(CheckpointingException):
    """The checkpoint changed (was overwritten) while it was being read."""


class StorageError(CheckpointingException, OSError):
    """The storage backend failed to read or write bytes."""


class RemoteRankError(CheckpointingException):
    """Another rank failed during a collective save or load; raised on the ranks that did not
    fail themselves so that no rank is left waiting."""


class CollectiveError(CheckpointingException, RuntimeError):
    """A collective of a save or load failed: a rank died, or did not take part within the
    process group's timeout."""


__all__ = [
    "CheckpointingException",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "ChecksumError",
    "TruncatedFileError",
    "UnsupportedFormatError",
    "MismatchError",
    "MissingKeyError",
    "ShardingValidationError",
    "UnsafeCheckpointError",
    "ConcurrentModificationError",
    "StorageError",
    "RemoteRankError",
    "CollectiveError",
]
