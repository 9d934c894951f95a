"""Save and load nested state dicts, models and optimizers (OLMo-core's checkpoint API)."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from .. import serialization
from ..engine.checkpoint import CheckpointReader
from ..engine.collective import Coordinator
from ..errors import CheckpointExistsError, CheckpointingException, MismatchError, MissingKeyError
from ..mapping import ShardedTensor
from ..storage import Storage, open_storage, storage_for
from ..strategies.distckpt import DistCkptLoadShardedStrategy, DistCkptSaveShardedStrategy
from .adapters import Leaf, describe, flatten

logger = logging.getLogger(__name__)

# Nested path of every saved leaf, in the common state: lets single-process readers rebuild
# nested dicts whose keys contain dots (parameter names) and lists.
PATHS_KEY = "_distckpt_paths"


# ---------------------------------------------------------------------------------------------
# State dicts


def save_state_dict(
    dir: str | os.PathLike[str] | Storage,
    state_dict: dict[str, Any],
    *,
    process_group: Any | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    process_count: int | None = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> None:
    """Save a nested dict of DTensors, tensors and Python values (collective).

    It loads again in any topology with :func:`load_state_dict`. DTensors are saved by the
    ranks holding each part; other tensors and values once, and must be equal on every rank
    holding them (see :mod:`distckpt.checkpoint.adapters`).

    Args:
        dir: checkpoint directory (created if missing).
        state_dict: the state to save; not modified.
        process_group: the ranks taking part (default: all).
        save_overwrite: replace what ``dir`` holds. The previous checkpoint stays loadable
            until the new one is committed.
        thread_count: files written in parallel per rank (default 1).
        process_count: accepted for compatibility; distckpt writes from threads without
            serializing tensors (no process pool needed), so it has no effect.
        throttle_uploads: with an object-store URL, the ranks of one host upload one at a time
            (no effect on a filesystem).
        enable_plan_caching: accepted for compatibility; plans of an unchanged layout are
            always cached.

    Raises:
        FileExistsError: ``dir`` is not empty and ``save_overwrite`` is False.
    """
    _check_counts(thread_count, process_count)
    _wait_for_async_save(process_group)
    location = storage_for(dir, throttle_uploads=throttle_uploads)
    coordinator = Coordinator(process_group)
    sharded = _describe_for_save(location, state_dict, coordinator, save_overwrite)
    serialization.save(
        sharded,
        location,
        sharded_strategy=DistCkptSaveShardedStrategy(thread_count or 1),
        overwrite=save_overwrite,
        process_group=process_group,
    )


def async_save_state_dict(
    dir: str | os.PathLike[str] | Storage,
    state_dict: dict[str, Any],
    *,
    process_group: Any | None = None,
    save_overwrite: bool = False,
    thread_count: int | None = None,
    process_count: int | None = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> Future[None]:
    """Like :func:`save_state_dict`, but returns once the data is staged in host memory.

    Writing and the collective commit run in a background thread, with their collectives on a
    dedicated gloo group so they never interleave with training's. Tensors may be modified as
    soon as this returns. The future's ``result()`` raises if the save failed on any rank
    (then nothing was committed); call it before ``destroy_process_group()``, since the commit
    is collective. A new save on the same group first waits for the previous one.
    """
    _check_counts(thread_count, process_count)
    _wait_for_async_save(process_group)
    group = _background_group(process_group)
    location = storage_for(dir, throttle_uploads=throttle_uploads)
    coordinator = Coordinator(group)
    sharded = _describe_for_save(location, state_dict, coordinator, save_overwrite)
    request = serialization.save(
        sharded,
        location,
        sharded_strategy=DistCkptSaveShardedStrategy(thread_count or 1),
        async_sharded_save=True,
        overwrite=save_overwrite,
        process_group=group,
    )
    assert request is not None
    future: Future[None] = Future()

    def run() -> None:
        try:
            request.execute_sync()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        else:
            future.set_result(None)

    # Not a daemon: the interpreter waits for it at exit, so a save nobody waited for is still
    # committed (or fails loudly) instead of vanishing. Call ``result()`` before
    # ``destroy_process_group()``: the commit is collective.
    threading.Thread(target=run, name="distckpt-async-save").start()
    _PENDING[_group_key(process_group)] = future
    return future


def load_state_dict(
    dir: str | os.PathLike[str] | Storage,
    state_dict: dict[str, Any],
    *,
    process_group: Any | None = None,
    pre_download: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    thread_count: int | None = None,
    allow_pickle: bool = False,
) -> None:
    """Load a checkpoint into ``state_dict`` in place (collective).

    Tensors and DTensors are filled in place (any saved layout into any requested one);
    other values are replaced in their containers. Every entry of ``state_dict`` must be in the
    checkpoint (:class:`~distckpt.errors.MissingKeyError` names those that are not); entries
    of the checkpoint not in ``state_dict`` are not loaded.

    Args:
        pre_download: fetch the whole files this rank reads from an object store into a local
            cache first (reused by later loads of the same checkpoint; every chunk is still
            checked against its checksum); no effect on a local directory.
        work_dir: where that cache lives (default: the system temp directory).
        thread_count: reads in flight per rank (default 1).
        allow_pickle: let Python values use full pickle (runs code from the checkpoint: only
            for checkpoints you trust). By default only plain types, tensors and containers
            load.
    """
    _check_counts(thread_count, None)
    _wait_for_async_save(process_group)
    location = storage_for(dir, pre_download=pre_download, work_dir=work_dir)
    _load_leaves(location, state_dict, process_group, thread_count, allow_pickle, strict=True)


def _describe_for_save(
    dir: Storage, state_dict: dict[str, Any], coordinator: Coordinator, overwrite: bool
) -> dict[str, Any]:
    def check_destination() -> None:
        if coordinator.is_coordinator and not overwrite:
            storage = open_storage(dir)
            if storage.list():
                raise CheckpointExistsError(
                    f"{storage.root} is not empty; pass save_overwrite=True to replace what it "
                    "holds, or save to another directory"
                )

    coordinator.exchange("checking the destination", check_destination)
    described, paths = describe(lambda: flatten(state_dict), coordinator, check_replicas=True)
    sharded: dict[str, Any] = dict(described)
    if PATHS_KEY in sharded:
        raise CheckpointingException(f"{PATHS_KEY!r} is reserved; rename that state dict entry")
    sharded[PATHS_KEY] = [list(p) for p in paths]
    return sharded


def _load_leaves(
    dir: Storage,
    state_dict: dict[str, Any],
    process_group: Any | None,
    thread_count: int | None,
    allow_pickle: bool,
    *,
    strict: bool,
) -> set[str]:
    """Load the leaves of ``state_dict`` from ``dir``; returns the keys the checkpoint lacks
    (only with ``strict=False``, which skips them)."""
    coordinator = Coordinator(process_group)
    local: dict[str, Any] = {}

    def check_keys() -> None:
        leaves = local["leaves"] = flatten(state_dict)  # (errors reach every rank)
        reader = CheckpointReader(dir)
        index = reader.index
        objects = {key.rpartition("/")[0] for key in index.objects}
        kinds = {leaf.key: isinstance(leaf.value, torch.Tensor) for leaf in leaves}
        for key, is_tensor in kinds.items():
            if is_tensor and key in objects:
                raise MismatchError(f"{reader.path}: {key!r} was saved as a Python value, the state dict has a tensor")
            if not is_tensor and key in index.tensors:
                raise MismatchError(f"{reader.path}: {key!r} was saved as a tensor, the state dict has a "
                                    f"{type(_value_of(leaves, key)).__name__}")
        missing = set(kinds) - set(index.tensors) - objects
        if missing and strict:
            shown = ", ".join(map(repr, sorted(missing)[:10])) + (" ..." if len(missing) > 10 else "")
            hint = ""
            if any(k.startswith("optim.") for k in missing):
                hint = ("; if the optimizer state was saved with another flatten_optimizer_state "
                        "setting, load with the same one")
            raise MissingKeyError(
                f"{reader.path} has no entry for {len(missing)} key(s) of the state dict: {shown}"
                f" (load with strict=False to skip them, or key_mapping to rename them{hint})"
            )
        local["missing"] = missing

    coordinator.exchange("checking keys", check_keys)
    missing: set[str] = local["missing"]
    present = [leaf for leaf in local["leaves"] if leaf.key not in missing]
    sharded, _ = describe(lambda: present, coordinator, check_replicas=False)
    loaded: Any = serialization.load(
        sharded,
        dir,
        sharded_strategy=DistCkptLoadShardedStrategy(thread_count or 1),
        allow_pickle=allow_pickle,
        process_group=process_group,
    )
    for leaf in present:
        if leaf.key in sharded and not isinstance(sharded[leaf.key], ShardedTensor):
            leaf.container[leaf.slot] = loaded[leaf.key]
    return missing


def _value_of(leaves: list[Leaf], key: str) -> Any:
    return next(leaf.value for leaf in leaves if leaf.key == key)


# ---------------------------------------------------------------------------------------------
# Models and optimizers


def save_model_and_optim_state(
    dir: str | os.PathLike[str] | Storage,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: Any | None = None,
    save_overwrite: bool = False,
    flatten_optimizer_state: bool = False,
    thread_count: int | None = None,
    process_count: int | None = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> None:
    """Save a model's (FSDP2, DDP or plain) and optionally an optimizer's state (collective).

    The state is saved as ``{"model": ..., "optim": ...}`` with parameters and optimizer state
    keyed by parameter name (DDP's ``module.`` prefix removed), so it loads into another
    topology with :func:`load_model_and_optim_state`.

    Args:
        flatten_optimizer_state: save the optimizer state flattened to one entry per parameter
            and hyperparameter (``optim.state.<param>.<name>``,
            ``optim.param_groups.<param>.<hyperparameter>``): needed when ranks hold different
            parameters (pipeline parallelism). Load with the same setting.

    Other arguments as in :func:`save_state_dict`.

    Raises:
        FileExistsError: ``dir`` is not empty and ``save_overwrite`` is False.
    """
    state = _model_and_optim_state(model, optim, flatten_optimizer_state)
    save_state_dict(
        dir, state, process_group=process_group, save_overwrite=save_overwrite,
        thread_count=thread_count, process_count=process_count,
        throttle_uploads=throttle_uploads, enable_plan_caching=enable_plan_caching,
    )


def async_save_model_and_optim_state(
    dir: str | os.PathLike[str] | Storage,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: Any | None = None,
    save_overwrite: bool = False,
    flatten_optimizer_state: bool = False,
    thread_count: int | None = None,
    process_count: int | None = None,
    throttle_uploads: bool = False,
    enable_plan_caching: bool = False,
) -> Future[None]:
    """An async :func:`save_model_and_optim_state` (see :func:`async_save_state_dict`)."""
    state = _model_and_optim_state(model, optim, flatten_optimizer_state)
    return async_save_state_dict(
        dir, state, process_group=process_group, save_overwrite=save_overwrite,
        thread_count=thread_count, process_count=process_count,
        throttle_uploads=throttle_uploads, enable_plan_caching=enable_plan_caching,
    )


def load_model_and_optim_state(
    dir: str | os.PathLike[str] | Storage,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    process_group: Any | None = None,
    key_mapping: dict[str, str] | None = None,
    pre_download: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    strict: bool = True,
    flatten_optimizer_state: bool = False,
    thread_count: int | None = None,
    allow_pickle: bool = False,
) -> None:
    """Load model and optimizer state in place from a :func:`save_model_and_optim_state`
    checkpoint saved in any topology (collective).

    Args:
        key_mapping: ``{current parameter name: name in the checkpoint}`` for renamed
            parameters (applies to their optimizer state too).
        strict: every parameter, buffer and optimizer state entry must be in the checkpoint;
            with ``strict=False`` those that are not keep their current values.
        flatten_optimizer_state: must match the setting used when saving.

    Other arguments as in :func:`load_state_dict`. Hyperparameters come from the checkpoint
    only for the keys the current optimizer's param groups have (as with
    ``torch.distributed.checkpoint``).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _check_counts(thread_count, None)
    _wait_for_async_save(process_group)
    state = _model_and_optim_state(model, optim, flatten_optimizer_state)
    renamed, restore = _apply_key_mapping(state, key_mapping or {}, flatten_optimizer_state)
    location = storage_for(dir, pre_download=pre_download, work_dir=work_dir)
    _load_leaves(location, renamed, process_group, thread_count, allow_pickle, strict=strict)
    restore()
    options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=flatten_optimizer_state)
    with torch.no_grad():
        set_model_state_dict(model, state["model"], options=options)
        if optim is not None:
            set_optimizer_state_dict(model, optim, state["optim"], options=options)


def _model_and_optim_state(
    model: torch.nn.Module, optim: torch.optim.Optimizer | None, flatten_optimizer_state: bool
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer_state)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    if optim is not None:
        # (initializes lazily created optimizer state, so a fresh optimizer can be loaded into)
        state["optim"] = get_optimizer_state_dict(model, optim, options=options)
    return state


def _apply_key_mapping(state: dict[str, Any], mapping: dict[str, str], flattened: bool) -> tuple[dict[str, Any], Any]:
    """``state`` with parameter names replaced by their names in the checkpoint, and a function
    that puts loaded values back under the current names."""
    if not mapping:
        return state, lambda: None

    def rename(name: str) -> str:
        if name in mapping:
            return mapping[name]
        for prefix in ("state.", "param_groups."):  # flattened optimizer keys
            if flattened and name.startswith(prefix):
                for current, saved in mapping.items():
                    if name.startswith(prefix + current + "."):
                        return prefix + saved + name[len(prefix + current):]
        return name

    model = state["model"]
    renamed: dict[str, Any] = {"model": {rename(k): v for k, v in model.items()}}
    optim = state.get("optim")
    if optim is not None:
        if flattened:
            renamed["optim"] = {rename(k): v for k, v in optim.items()}
        else:
            renamed["optim"] = {
                "state": {rename(k): v for k, v in optim["state"].items()},
                "param_groups": optim["param_groups"],
            }

    def restore() -> None:
        for name in model:
            model[name] = renamed["model"][rename(name)]
        if optim is not None:
            if flattened:
                for name in optim:
                    optim[name] = renamed["optim"][rename(name)]
            else:
                for name in optim["state"]:
                    optim["state"][name] = renamed["optim"]["state"][rename(name)]
                reverse = {saved: current for current, saved in mapping.items()}
                groups = renamed["optim"]["param_groups"]
                for group in groups:
                    group["params"] = [reverse.get(p, p) for p in group["params"]]
                optim["param_groups"] = groups

    return renamed, restore


# ---------------------------------------------------------------------------------------------
# Helpers

_PENDING: dict[Any, Future] = {}
_BACKGROUND_GROUPS: dict[Any, Any] = {}


def _group_key(process_group: Any | None) -> Any:
    """The group object itself (the default group's object changes when the job re-initializes
    ``torch.distributed``, so nothing cached for an old one is reused)."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return process_group


def _wait_for_async_save(process_group: Any | None) -> None:
    """Wait for the previous async save of this group (its collectives must not overlap ours);
    its outcome stays with its future."""
    future = _PENDING.pop(_group_key(process_group), None)
    if future is not None:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - reported through the caller's future
            logger.warning("the previous async save failed: %s", exc)


def _background_group(process_group: Any | None) -> Any | None:
    """A gloo group with the ranks of ``process_group``, for background collectives only."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = _group_key(process_group)
    if key not in _BACKGROUND_GROUPS:
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        _BACKGROUND_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return _BACKGROUND_GROUPS[key]


def _check_counts(thread_count: int | None, process_count: int | None) -> None:
    for name, value in (("thread_count", thread_count), ("process_count", process_count)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
