"""The public names are a contract: this test changes only with a deliberate API change."""

import distckpt
import distckpt.mapping
import distckpt.serialization
import distckpt.strategies
import distckpt.validation


def test_top_level_names():
    assert sorted(distckpt.__all__) == sorted([
        "__version__", "save", "load", "load_common_state_dict", "load_tensors_metadata",
        "load_sharded_metadata", "load_plain_tensors", "load_content_metadata",
        "remove_sharded_tensors", "get_default_save_sharded_strategy",
        "get_default_save_common_strategy", "get_default_load_sharded_strategy", "ShardedTensor",
        "ShardedObject", "ShardedTensorFactory", "LocalNonPersistentObject", "StrictHandling",
        "CheckpointingException", "CheckpointNotFoundError", "IncompleteCheckpointError",
        "CheckpointExistsError", "CorruptCheckpointError", "ChecksumError", "TruncatedFileError", "UnsupportedFormatError",
        "MismatchError", "MissingKeyError", "ShardingValidationError", "UnsafeCheckpointError",
        "StorageError", "RemoteRankError", "ConcurrentModificationError", "CollectiveError",
    ])
    for name in distckpt.__all__:
        assert hasattr(distckpt, name), name


def test_megatron_module_layout():
    for name in ["save", "load", "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata",
                 "load_plain_tensors", "load_content_metadata", "remove_sharded_tensors",
                 "get_default_save_sharded_strategy", "get_default_save_common_strategy",
                 "get_default_load_sharded_strategy"]:
        assert getattr(distckpt.serialization, name) is getattr(distckpt, name)
    for name in ["ShardedTensor", "ShardedObject", "ShardedTensorFactory", "LocalNonPersistentObject",
                 "apply_factories", "apply_factory_merges"]:
        assert hasattr(distckpt.mapping, name)
    for name in ["StrictHandling", "parse_strict_flag", "validate_sharding_integrity"]:
        assert hasattr(distckpt.validation, name)
    for name in ["SaveShardedStrategy", "LoadShardedStrategy", "SaveCommonStrategy", "LoadCommonStrategy",
                 "register_default_strategy", "StrategyAction"]:
        assert hasattr(distckpt.strategies, name)
