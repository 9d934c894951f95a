"""distckpt: distributed, topology-independent checkpointing for PyTorch.

Save a sharded state dict from N ranks laid out one way, load it on M ranks laid out another
way, or on one process. The API follows Megatron-Core's ``dist_checkpointing``.
"""

__version__ = "0.1.0"

from .errors import (
    CheckpointExistsError,
    CheckpointingException,
    CheckpointNotFoundError,
    ChecksumError,
    CollectiveError,
    ConcurrentModificationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchError,
    MissingKeyError,
    RemoteRankError,
    ShardingValidationError,
    StorageError,
    TruncatedFileError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from .mapping import (
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from .serialization import (
    get_default_load_sharded_strategy,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .validation import StrictHandling

__all__ = [
    "__version__",
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonPersistentObject",
    "StrictHandling",
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
    "StorageError",
    "RemoteRankError",
    "CollectiveError",
    "ConcurrentModificationError",
]
