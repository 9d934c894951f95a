"""Checks before a save or load: strict key handling and sharding integrity.

Every check here is a pure function of data all ranks hold after one all-gather, so all ranks
reach the same verdict and raise together.
"""

from __future__ import annotations

import logging
import pickle
from array import array
from collections import defaultdict
from collections.abc import Iterable, Sequence
from enum import Enum
from itertools import compress
from typing import Any

import torch

from . import checksum
from .errors import ShardingValidationError
from .planning.boxes import Box
from .planning.columns import ShardColumns, shard_columns
from .planning.coverage import check_exact_cover, covers_exactly, covers_exactly_columns
from .planning.gcpause import paused_gc
from .planning.shards import ObjectShard, TensorShard

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What ``load`` does when the request and the checkpoint disagree on keys.

    *Unexpected* keys are requested but absent from the checkpoint; *missing* keys are in the
    checkpoint but requested by no rank (finding them needs an all-gather of the requests).

    - ``ASSUME_OK_UNEXPECTED``: no check up front; an unexpected key fails the load with an
      error naming it.
    - ``LOG_UNEXPECTED`` / ``LOG_ALL``: log unexpected (and missing) keys; skip unexpected ones.
    - ``RAISE_UNEXPECTED`` / ``RAISE_ALL``: raise if there are unexpected (or missing) keys.
    - ``RETURN_UNEXPECTED`` / ``RETURN_ALL``: return ``(state_dict, missing, unexpected)``
      (missing is empty for ``RETURN_UNEXPECTED``); skip unexpected keys.
    - ``IGNORE_ALL``: skip unexpected keys silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | bool | StrictHandling) -> StrictHandling:
    """Accept a :class:`StrictHandling`, its value or name (any case), or a bool as documented
    by Megatron-Core: ``True`` is ``ASSUME_OK_UNEXPECTED``, ``False`` is ``LOG_UNEXPECTED``."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    if isinstance(strict, str):
        try:
            return StrictHandling(strict.lower())
        except ValueError:
            pass
    raise ValueError(
        f"invalid strict={strict!r}; use a bool, a StrictHandling member or one of "
        f"{[m.value for m in StrictHandling]}"
    )


def determine_missing_and_unexpected_keys(
    checkpoint_keys: Iterable[str],
    local_keys: Iterable[str],
    global_keys: Iterable[str] | None = None,
) -> tuple[set[str], set[str]]:
    """``(missing, unexpected)``: missing needs ``global_keys`` (else it is empty)."""
    ckpt = set(checkpoint_keys)
    unexpected = set(local_keys) - ckpt
    missing = ckpt - set(global_keys) if global_keys is not None else set()
    return missing, unexpected


def handle_mismatch(strict: StrictHandling, missing: set[str], unexpected: set[str], where: str) -> None:
    """Log or raise for ``strict``; returning and skipping is up to the caller."""
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("%s: requested keys not in the checkpoint (skipped): %s", where, sorted(unexpected))
    if strict == StrictHandling.LOG_ALL and missing:
        logger.warning("%s: checkpoint keys not requested by any rank: %s", where, sorted(missing))
    raise_unexpected = strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)
    if raise_unexpected and unexpected or strict == StrictHandling.RAISE_ALL and missing:
        from .errors import MissingKeyError

        parts = []
        if unexpected:
            parts.append(f"requested but not in the checkpoint: {sorted(unexpected)}")
        if missing and strict == StrictHandling.RAISE_ALL:
            parts.append(f"in the checkpoint but requested by no rank: {sorted(missing)}")
        raise MissingKeyError(
            f"{where}: key mismatch ({'; '.join(parts)}); fix the keys or pick a non-raising "
            "strict mode"
        )


def validate_sharding_integrity(
    all_tensors: Sequence[Sequence[TensorShard]],
    all_objects: Sequence[Sequence[ObjectShard]] = (),
) -> None:
    """Every global tensor (and object grid) is described consistently by all ranks and every
    element is covered by exactly one main replica. Raises :class:`ShardingValidationError`.

    Linear in the number of shards for the common layouts (each tensor's main boxes forming a
    regular grid, e.g. rows split over thousands of ranks); other layouts take the general
    sweep of :func:`~distckpt.planning.coverage.check_exact_cover`.
    """
    with paused_gc():
        problems = _tensor_problems(all_tensors)
        problems.extend(_object_problems(all_objects))
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ShardingValidationError("invalid sharding: " + problems[0] + more)


def _tensor_problems(all_tensors: Sequence[Sequence[TensorShard]]) -> list[str]:
    columns = shard_columns(all_tensors, keep=True)
    general = _irregular_keys(all_tensors) if columns is None else _irregular_keys_columns(columns)
    problems: dict[str, str] = {}
    if general:
        # General path (flat ranges, irregular layouts, errors): boxes with their ranks.
        holders: dict[str, list[tuple[int, TensorShard]]] = {key: [] for key in general}
        for rank, shards in enumerate(all_tensors):
            for shard in shards:
                found = holders.get(shard.key)
                if found is not None:
                    found.append((rank, shard))
        for key in general:
            message = _general_check(key, holders[key])
            if message:
                problems[key] = message
    return [problems[key] for key in sorted(problems)]


def _irregular_keys_columns(columns: ShardColumns) -> list[str]:
    """Keys whose main boxes are not proven to cover the tensor exactly (fast path)."""
    general = []
    for key in columns.slots:
        if not columns.consistent(key):
            general.append(key)
            continue
        (shape, _, _), starts, sizes, mains, _ = columns.key_columns(key)
        if mains.count(1) != len(mains):
            starts = [array("q", compress(column, mains)) for column in starts]
            sizes = [array("q", compress(column, mains)) for column in sizes]
        if shape:
            exact = covers_exactly_columns(shape, starts, sizes)
        else:
            exact = mains.count(1) == 1
        if not exact:
            general.append(key)
    return general


def _irregular_keys(all_tensors: Sequence[Sequence[TensorShard]]) -> list[str]:
    """Keys whose main boxes are not proven to cover the tensor exactly (any descriptions)."""
    # One pass over the shards in the order they lie in memory (rank after rank), gathering per
    # key what the exact-cover test needs: the main boxes' offsets and shapes. Keys whose shards
    # disagree, or hold flat ranges, go to the general (slower) path.
    groups: dict[str, list] = {}  # key -> [global_shape, dtype, offsets, shapes, general]
    for shards in all_tensors:
        for shard in shards:
            key = shard.key
            group = groups.get(key)
            if group is None:
                group = groups[key] = [shard.global_shape, shard.dtype, [], [], False]
            if shard.global_shape != group[0] or shard.dtype != group[1] or shard.flat is not None:
                group[4] = True
            elif shard.main:
                box = shard.box
                group[2].append(box[0])
                group[3].append(box[1])
    return [
        key for key, (shape, _, offsets, shapes, irregular) in groups.items()
        if irregular or not covers_exactly(shape, [Box(o, s) for o, s in zip(offsets, shapes)])
    ]


def _general_check(key: str, holders: list[tuple[int, TensorShard]]) -> str | None:
    rank0, first = holders[0]
    for rank, shard in holders[1:]:
        if (shard.global_shape, shard.dtype) != (first.global_shape, first.dtype):
            return (
                f"tensor {key!r}: rank {rank0} says global shape {first.global_shape} "
                f"{first.dtype}, rank {rank} says {shard.global_shape} {shard.dtype}"
            )
    boxes = []
    owners: list[int] = []
    for rank, shard in holders:
        if shard.main:
            for piece in shard.pieces():
                boxes.append(piece.box)
                owners.append(rank)
    return check_exact_cover(key, first.global_shape, boxes, owners)


def _object_problems(all_objects: Sequence[Sequence[ObjectShard]]) -> list[str]:
    by_key: dict[str, list[tuple[int, ObjectShard]]] = defaultdict(list)
    for rank, objects in enumerate(all_objects):
        for obj in objects:
            by_key[obj.key].append((rank, obj))
    problems = []
    for key, holders in sorted(by_key.items()):
        shapes = {o.global_shape for _, o in holders}
        if len(shapes) > 1:
            problems.append(f"ShardedObject {key!r}: ranks disagree on the grid shape: {sorted(shapes)}")
            continue
        (shape,) = shapes
        mains: dict[tuple, list[int]] = defaultdict(list)
        for rank, obj in holders:
            if obj.main:
                mains[obj.global_offset].append(rank)
        twice = {off: ranks for off, ranks in mains.items() if len(ranks) > 1}
        if twice:
            off, ranks = next(iter(sorted(twice.items())))
            problems.append(
                f"ShardedObject {key!r}: shard {off} has main replicas on ranks {ranks}; give all "
                "but one a non-zero replica_id"
            )
            continue
        expected = 1
        for s in shape:
            expected *= s
        if len(mains) != expected:
            present = set(mains)
            absent = next(
                (o for o in _grid(shape) if o not in present), None
            )
            problems.append(
                f"ShardedObject {key!r}: {expected - len(mains)} of {expected} shards of the grid "
                f"{shape} have no main replica (e.g. shard {absent})"
            )
    return problems


def _grid(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _grid(shape[1:]):
            yield (i,) + rest


def common_digests(common: Any) -> dict[str, int]:
    """A crc32c per leaf path of the common state, to compare ranks without sending it all.

    Empty containers hold no data and are not compared: a rank that holds no shard of a list
    of tensors leaves an empty list behind in its common part, which is harmless.
    """
    out: dict[str, int] = {}

    def visit(x: Any, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                visit(v, f"{path}[{i}]")
        elif isinstance(x, (set, frozenset)):
            # Pickled sets follow the per-process hash seed: compare their sorted element digests.
            parts = sorted(common_digests({"e": e})["e"] for e in x)
            out[path] = checksum.crc32c(repr((type(x).__name__, parts)).encode())
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            head = f"{t.dtype}{tuple(t.shape)}".encode()
            body = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            out[path] = checksum.crc32c(body, checksum.crc32c(head))
        else:
            try:
                raw = pickle.dumps(x, protocol=4)
            except Exception:  # noqa: BLE001 - unpicklable leaves compare by repr
                raw = repr(x).encode()
            out[path] = checksum.crc32c(raw)

    visit(common, "")
    return out


def validate_common_consistency(all_digests: Sequence[dict[str, int]]) -> None:
    """Raise if any rank's common state differs from rank 0's, naming the keys."""
    reference = all_digests[0]
    for rank, digests in enumerate(all_digests[1:], start=1):
        if digests == reference:
            continue
        only_0 = sorted(reference.keys() - digests.keys())
        only_r = sorted(digests.keys() - reference.keys())
        differ = sorted(k for k in reference.keys() & digests.keys() if reference[k] != digests[k])
        details = []
        if differ:
            details.append(f"values differ at {differ[:5]}")
        if only_0:
            details.append(f"only rank 0 has {only_0[:5]}")
        if only_r:
            details.append(f"only rank {rank} has {only_r[:5]}")
        raise ShardingValidationError(
            f"the common (non-sharded) state differs between rank 0 and rank {rank}: "
            f"{'; '.join(details)}. It is saved once, from rank 0: make it equal on all ranks, "
            "wrap per-rank values in ShardedObject, or drop the differing keys from the check "
            "with preprocess_common_before_consistancy_check"
        )
