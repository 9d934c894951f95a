"""Entry points for saving and loading sharded checkpoints (Megatron-Core's API).

``save`` and ``load`` are collective: call them on every rank of the default process group (or
in a single process without ``torch.distributed``). A failure on any rank raises on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, Union

from .dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from .engine.checkpoint import CheckpointReader, read_metadata
from .engine.collective import Coordinator
from .engine.save_job import SaveOptions, prepare_save
from .errors import CheckpointingException, ConcurrentModificationError, StorageError
from .format.dtypes import dtype_name, itemsize
from .format.index import DEFAULT_BLOCK_BYTES
from .format.metadata import CheckpointMetadata
from .mapping import (
    CommonStateDict,
    LocalNonPersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .planning.boxes import Box
from .planning.shards import ObjectShard, TensorShard
from .storage import Storage, open_storage
from .strategies import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    TorchLoadCommonStrategy,
    get_default_strategy,
)
from .strategies.async_utils import AsyncRequest
from .validation import (
    StrictHandling,
    determine_missing_and_unexpected_keys,
    handle_mismatch,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)

_CONTENT_METADATA_KEY = "content_metadata"
# Request layouts that passed validate_access_integrity, with the id all ranks agreed on then.
_VALIDATED_REQUESTS: dict[tuple, str] = {}
CkptShardedMetadata = dict[str, Any]
PathLike = Union[str, "os.PathLike[str]", "Storage"]


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
    *,
    overwrite: bool = False,
    process_group: Any | None = None,
) -> AsyncRequest | None:
    """Save a sharded state dict (collective).

    Steps, as in Megatron-Core: apply factories; drop LocalNonPersistentObjects; extract the
    sharded part; the rest is the common state (saved once, by rank 0); ShardedObjects and
    ShardedTensors are written by the ranks chosen to balance bytes (each replica once);
    ``metadata.json`` is written last, after every rank succeeded.

    Args:
        sharded_state_dict: nested dict of ShardedTensors, ShardedObjects, factories,
            LocalNonPersistentObjects and common values. Factories are applied in place.
        checkpoint_dir: directory to save to; created if missing.
        sharded_strategy: a :class:`SaveShardedStrategy` or ``(backend, version)``.
        common_strategy: a :class:`SaveCommonStrategy` or ``(backend, version)``.
        validate_access_integrity: check that every element of every tensor is covered by
            exactly one main replica and that the common state is equal on all ranks.
        async_sharded_save: stage this rank's data into reusable host buffers (the only part
            the caller waits for) and return an :class:`AsyncRequest`; schedule it on an
            :class:`~distckpt.strategies.async_utils.AsyncCallsQueue`, whose
            ``maybe_finalize_async_calls`` commits the checkpoint (collectively) once every
            rank's writes finished. Tensors may be modified as soon as ``save`` returns.
        preprocess_common_before_consistancy_check: maps the common state before the
            cross-rank equality check (e.g. to drop keys expected to differ); must not modify
            its argument.
        content_metadata: JSON-serializable dict identifying the content, stored in
            ``metadata.json`` (readable without unpickling) and in the common state.
        overwrite: replace a checkpoint already in ``checkpoint_dir``. The old one stays
            loadable until the new one is committed.
        process_group: the ranks taking part (default: the whole job). Coordination runs on a
            gloo group with the same ranks (created once if this one is not gloo).

    Returns:
        ``None``, or the :class:`AsyncRequest` of an async save.

    Raises:
        CheckpointExistsError: ``checkpoint_dir`` holds a checkpoint and ``overwrite`` is False.
        ShardingValidationError: the shards or the common state are inconsistent.
    """
    sharded_saver: SaveShardedStrategy = _resolve(StrategyAction.SAVE_SHARDED, sharded_strategy, ("distckpt", 1))
    common_saver: SaveCommonStrategy = _resolve(StrategyAction.SAVE_COMMON, common_strategy, ("torch", 1))
    options = SaveOptions(
        validate_access_integrity=validate_access_integrity,
        preprocess_common=preprocess_common_before_consistancy_check,
        content_metadata=content_metadata,
        overwrite=overwrite,
        block_bytes=getattr(sharded_saver, "block_bytes", DEFAULT_BLOCK_BYTES),
        thread_count=sharded_saver.thread_count,
        sharded_backend=(sharded_saver.backend, sharded_saver.version),
        common_backend=(common_saver.backend, common_saver.version),
    )

    def collect() -> tuple:
        # Megatron's steps 1-5: factories, drop non-persistent objects, split sharded/common.
        apply_factories(sharded_state_dict)
        _, state = extract_matching_values(
            sharded_state_dict, lambda x: isinstance(x, LocalNonPersistentObject)
        )
        sharded_part, common = extract_matching_values(state, lambda x: isinstance(x, ShardedBase))
        if isinstance(common, list):
            raise CheckpointingException("the state dict must be a dict, not a list")
        if content_metadata is not None:
            _check_json(content_metadata)
            common[_CONTENT_METADATA_KEY] = content_metadata
        leaves = list(nested_values(sharded_part)) if sharded_part else []
        return (
            [x for x in leaves if isinstance(x, ShardedTensor)],
            [x for x in leaves if isinstance(x, ShardedObject)],
            common,
        )

    job = prepare_save(
        open_storage(checkpoint_dir), Coordinator(process_group), collect, common_saver.serialize, options
    )
    if not async_sharded_save:
        job.finalize(job.write)
        return None

    # Async: the caller waits only for the copy into host buffers; writing happens when the
    # request is scheduled, and finalize (collective) commits or raises on every rank.
    outcome: dict[str, Any] = {}
    try:
        job.stage()
    except Exception as exc:  # noqa: BLE001 - reported on every rank at finalize
        outcome["error"] = exc

    def write_in_background() -> None:
        if "error" in outcome:
            return
        try:
            outcome["records"] = job.write()
        except Exception as exc:  # noqa: BLE001 - reported on every rank at finalize
            outcome["error"] = exc

    def result() -> tuple:
        if "error" in outcome:
            raise outcome["error"]
        if "records" not in outcome:
            raise StorageError(
                f"{job.storage.root}: the background write of this rank did not finish in time "
                "(stuck storage?); the checkpoint was not committed"
            )
        return outcome["records"]

    return AsyncRequest(write_in_background, (), [lambda: job.finalize(result)])


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    strict: str | bool | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    allow_pickle: bool = False,
    process_group: Any | None = None,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load a checkpoint into the layout described by ``sharded_state_dict`` (collective).

    Any saved layout loads into any requested layout. ShardedTensor data is filled in place
    (allocated on CPU if it is None or on the meta device).

    Steps, as in Megatron-Core: load the common state (the base of the result); apply
    factories; add LocalNonPersistentObjects unwrapped; load ShardedObjects and ShardedTensors;
    apply factory merges.

    Args:
        sharded_state_dict: the requested layout (non-sharded leaves are ignored).
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: a :class:`LoadShardedStrategy` or ``(backend, version)``; by default
            the one matching the checkpoint's ``metadata.json``.
        common_strategy: a :class:`LoadCommonStrategy` or ``(backend, version)``.
        validate_access_integrity: check that the requests of all ranks cover every tensor
            exactly once with main replicas.
        strict: a :class:`StrictHandling` mode (or its string value, or a bool: True is
            ``assume_ok_unexpected``, False is ``log_unexpected``).
        allow_pickle: let the common state and ShardedObjects use full pickle (runs code from
            the checkpoint: only for checkpoints you trust).
        process_group: the ranks taking part (default: the whole job).

    Returns:
        The loaded state dict, or ``(state_dict, missing_keys, unexpected_keys)`` for the
        ``RETURN_*`` strict modes.
    """
    strict = parse_strict_flag(strict)
    coordinator = Coordinator(process_group)
    local: dict[str, Any] = {}
    need_global_keys = StrictHandling.requires_global_app_metadata(strict)

    def prepare() -> tuple:
        reader = CheckpointReader(checkpoint_dir)
        sharded = _resolve_load_sharded(sharded_strategy, reader.metadata)
        common_loader = _resolve_load_common(common_strategy, reader.metadata, allow_pickle)
        common_state = common_loader.load_common(reader)
        factories, _ = extract_matching_values(
            sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
        )
        apply_factories(sharded_state_dict)
        nonpersistent, state = extract_matching_values(
            sharded_state_dict, lambda x: isinstance(x, LocalNonPersistentObject)
        )
        sharded_part, _ = extract_matching_values(state, lambda x: isinstance(x, ShardedBase))
        leaves = list(nested_values(sharded_part)) if sharded_part else []
        local_keys = {_key_of(x) for x in leaves}
        unexpected: set[str] = set()
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            checkpoint_keys = _checkpoint_keys(reader)
            _, unexpected = determine_missing_and_unexpected_keys(checkpoint_keys, local_keys)
            handle_mismatch(strict, set(), unexpected, reader.path)
            if unexpected:
                sharded_part, _ = extract_matching_values(
                    sharded_part, lambda x: _key_of(x) not in unexpected
                )
                leaves = [x for x in leaves if _key_of(x) not in unexpected]
        local.update(
            reader=reader,
            sharded=sharded,
            common_loader=common_loader,
            common=common_state,
            factories=factories,
            nonpersistent=dict_list_map_inplace(lambda x: x.unwrap(), nonpersistent),
            sharded_part=sharded_part,
            unexpected=unexpected,
        )
        validated_id = None
        if validate_access_integrity:
            local["descriptors"] = _describe_request(leaves)
            local["request_key"] = (coordinator.world_size, coordinator.rank) + tuple(
                map(tuple, local["descriptors"])
            )
            validated_id = _VALIDATED_REQUESTS.get(local["request_key"])
        proposal = uuid.uuid4().hex if coordinator.is_coordinator else None
        return (local_keys if need_global_keys else None), validated_id, reader.metadata.save_id, proposal

    gathered = coordinator.exchange("load preparation", prepare)
    missing: set[str] = set()
    reader: CheckpointReader = local["reader"]
    save_ids = {g[2] for g in gathered}
    if len(save_ids) > 1:
        # An overwrite committed while the ranks were opening the checkpoint.
        raise ConcurrentModificationError(
            f"{reader.path}: ranks opened different checkpoints ({sorted(save_ids)}): it was "
            "overwritten during the load; load again"
        )
    if need_global_keys:
        requested = set().union(*(g[0] for g in gathered))
        missing, _ = determine_missing_and_unexpected_keys(
            _checkpoint_keys(reader), (), requested
        )
        handle_mismatch(strict, missing, set(), reader.path)
    validated_ids = {g[1] for g in gathered}
    if validate_access_integrity and (None in validated_ids or len(validated_ids) > 1):
        # A request layout not validated before on every rank: gather and check it. Requests
        # repeated unchanged (e.g. every resume of a job) skip this all-gather.
        described = coordinator.exchange("load validation", lambda: local["descriptors"])
        validate_sharding_integrity([d[0] for d in described], [d[1] for d in described])
        _VALIDATED_REQUESTS[local["request_key"]] = gathered[0][3]
        while len(_VALIDATED_REQUESTS) > 8:
            _VALIDATED_REQUESTS.pop(next(iter(_VALIDATED_REQUESTS)))

    def read() -> None:
        if local["sharded_part"]:
            try:
                local["loaded"] = local["sharded"].load(
                    local["sharded_part"], reader, local["common_loader"]
                )
            except (OSError, CheckpointingException) as exc:
                if _overwritten(reader):
                    raise ConcurrentModificationError(
                        f"{reader.path} was overwritten while it was being read ({exc}); load again"
                    ) from exc
                raise

    sharded = local["sharded"]
    if getattr(sharded, "collective", False) and coordinator.world_size > 1:
        # The strategy runs its own exchanges (e.g. fully parallel load); every rank calls it.
        local["loaded"] = sharded.load(
            local["sharded_part"] or {}, reader, local["common_loader"], coordinator=coordinator
        )
    else:
        coordinator.exchange("loading", read)
    result = local["common"]
    merge(result, local["nonpersistent"])
    if "loaded" in local:
        merge(result, local["loaded"])
    result = apply_factory_merges(result, local["factories"])
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, local["unexpected"]
    return result


def _overwritten(reader: CheckpointReader) -> bool:
    """Whether the checkpoint ``reader`` opened has since been replaced (or removed)."""
    try:
        return read_metadata(reader.storage).save_id != reader.metadata.save_id
    except (OSError, CheckpointingException):
        return True


def _key_of(x: ShardedBase) -> str:
    """The key strict handling compares: for ShardedObjects the base key, as in Megatron, so a
    grid of another shape is reported as such rather than as missing and unexpected keys."""
    return x.key


def _checkpoint_keys(reader: CheckpointReader) -> set[str]:
    return set(reader.index.tensors) | {o.key for o in reader.index.objects.values()}


def _describe_request(leaves: list) -> tuple[list[TensorShard], list[ObjectShard]]:
    tensors = [
        TensorShard(
            x.key,
            dtype_name(x.dtype),
            itemsize(x.dtype),
            x.global_shape,
            Box(x.global_offset, x.box_shape),
            None if x.flattened_range is None else (x.flattened_range.start, x.flattened_range.stop),
            is_main_replica(x.replica_id),
        )
        for x in leaves
        if isinstance(x, ShardedTensor)
    ]
    objects = [
        ObjectShard(x.unique_key, x.key, x.global_shape, x.global_offset, 0, is_main_replica(x.replica_id))
        for x in leaves
        if isinstance(x, ShardedObject)
    ]
    return tensors, objects


def load_common_state_dict(checkpoint_dir: PathLike, *, allow_pickle: bool = False) -> StateDict:
    """Load the common (non-sharded) state of the checkpoint, on this process only."""
    reader = CheckpointReader(checkpoint_dir)
    return _resolve_load_common(None, reader.metadata, allow_pickle).load_common(reader)


def load_tensors_metadata(
    checkpoint_dir: PathLike, sharded_strategy: LoadShardedStrategy | None = None
) -> CkptShardedMetadata:
    """``{key: ShardedTensor}`` with meta-device data of the global shape and dtype."""
    reader = CheckpointReader(checkpoint_dir)
    return _resolve_load_sharded(sharded_strategy, reader.metadata).load_tensors_metadata(reader)


def load_sharded_metadata(
    checkpoint_dir: PathLike,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
) -> CkptShardedMetadata:
    """Like :func:`load_tensors_metadata`, plus ShardedObjects keyed by their unique key."""
    del common_strategy  # the index describes objects too; kept for API compatibility
    reader = CheckpointReader(checkpoint_dir)
    return _resolve_load_sharded(sharded_strategy, reader.metadata).load_sharded_metadata(reader)


def load_plain_tensors(checkpoint_dir: PathLike) -> StateDict:
    """Every tensor of the checkpoint, whole, keyed by its key (common state not included).

    Runs on this process only, without collectives, so it works in a single process.
    """
    reader = CheckpointReader(checkpoint_dir)
    strategy = _resolve_load_sharded(None, reader.metadata)
    requests = strategy.load_tensors_metadata(reader)
    for sh_ten in requests.values():
        sh_ten.data = None
    return strategy.load(requests, reader)


def load_content_metadata(
    checkpoint_dir: PathLike | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The ``content_metadata`` given to ``save`` (None if there was none).

    Read from ``metadata.json`` (no unpickling), or from an already loaded state dict.
    """
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(_CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise ValueError("pass checkpoint_dir or preloaded_state_dict")
    return CheckpointReader(checkpoint_dir).metadata.content_metadata


def remove_sharded_tensors(checkpoint_dir: PathLike, key_prefix: str) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` from the checkpoint.

    Collective when ``torch.distributed`` is initialized (rank 0 does the work).
    """
    coordinator = Coordinator()

    def remove() -> None:
        if coordinator.is_coordinator:
            reader = CheckpointReader(checkpoint_dir)
            _resolve_load_sharded(None, reader.metadata).remove_sharded_tensors(reader, key_prefix)

    coordinator.exchange("removing tensors", remove)


def get_default_save_sharded_strategy(backend: str = "distckpt", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: PathLike) -> LoadShardedStrategy:
    metadata = CheckpointReader(checkpoint_dir).metadata
    return get_default_strategy(
        StrategyAction.LOAD_SHARDED, metadata.sharded_backend, metadata.sharded_backend_version
    )


def _resolve(action: StrategyAction, strategy: Any, default: tuple[str, int]) -> Any:
    if strategy is None:
        return get_default_strategy(action, *default)
    if isinstance(strategy, tuple):
        return get_default_strategy(action, *strategy)
    return strategy


def _resolve_load_sharded(strategy: Any, metadata: CheckpointMetadata) -> LoadShardedStrategy:
    resolved = _resolve(
        StrategyAction.LOAD_SHARDED, strategy, (metadata.sharded_backend, metadata.sharded_backend_version)
    )
    resolved.check_backend_compatibility(metadata.sharded_backend)
    resolved.check_version_compatibility(metadata.sharded_backend_version)
    return resolved


def _resolve_load_common(strategy: Any, metadata: CheckpointMetadata, allow_pickle: bool) -> LoadCommonStrategy:
    if strategy is None and metadata.common_backend == "torch":
        resolved = TorchLoadCommonStrategy(allow_pickle=allow_pickle)
        resolved.check_version_compatibility(metadata.common_backend_version)
        return resolved
    resolved = _resolve(
        StrategyAction.LOAD_COMMON, strategy, (metadata.common_backend, metadata.common_backend_version)
    )
    resolved.check_backend_compatibility(metadata.common_backend)
    resolved.check_version_compatibility(metadata.common_backend_version)
    return resolved


def _check_json(content_metadata: Any) -> None:
    if not isinstance(content_metadata, dict):
        raise CheckpointingException(
            f"content_metadata must be a dict, got {type(content_metadata).__name__}"
        )
    try:
        round_trip = json.loads(json.dumps(content_metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointingException(
            f"content_metadata must be JSON-serializable (it is stored in metadata.json): {exc}"
        ) from None
    if round_trip != content_metadata:
        raise CheckpointingException(
            "content_metadata must survive a JSON round trip unchanged (string keys, lists "
            "rather than tuples); it is stored in metadata.json"
        )
