"""From a nested state dict of DTensors, tensors and Python values to the engine's description.

A state dict as training code has it (``model.state_dict()`` of an FSDP2, DDP or plain module;
an optimizer's state keyed by parameter name) is flattened into ``{"a.b.c": leaf}`` and each
leaf becomes a sharded description the engine saves and loads in any topology:

- a **DTensor** is this rank's box of the global tensor. The box follows from the mesh
  coordinate and the placements: ``Shard(d)`` cuts dimension ``d`` as ``torch.chunk`` does
  (chunks of ``ceil(n / parts)``, trailing ranks possibly empty: FSDP2's uneven shards), and
  ``Replicate()`` makes the ranks along that mesh dimension replicas (coordinate 0 is the main
  one). ``Partial`` placements hold unreduced values and are refused.
- a **plain tensor** is the whole tensor, replicated over the ranks holding the key;
- any other value is a **Python object**, replicated likewise.

Plain tensors and objects carry no layout, so the ranks agree on who writes each (the lowest
rank holding the key) with one all-gather of their keys. On save the same gather checks that
replicas agree: an object whose value differs between ranks, or a tensor whose shape or dtype
does, is an error naming the key and the ranks (``torch.distributed.checkpoint`` keeps one of
them silently).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.collective import Coordinator
from ..errors import CheckpointingException, ShardingValidationError
from ..mapping import ShardedBase, ShardedObject, ShardedTensor

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore[no-redef]
    from torch.distributed._tensor.placement_types import Partial  # type: ignore[no-redef]

SEPARATOR = "."


@dataclass
class Leaf:
    """One value of a nested state dict: where it lives and the key it is saved under."""

    key: str
    path: tuple[str | int, ...]  # the keys and list indices leading to it
    container: dict | list
    slot: Any
    value: Any


def flatten(state_dict: dict[str, Any]) -> list[Leaf]:
    """The leaves of nested dicts and lists, keyed by their path joined with ``'.'``.

    Raises:
        CheckpointingException: a key is not a string, or two paths give the same key (e.g.
            ``{"a.b": 1, "a": {"b": 2}}``).
    """
    leaves: list[Leaf] = []
    seen: set[str] = set()

    def walk(container: dict | list, path: str, parts: tuple[str | int, ...]) -> None:
        items: Iterator[tuple[Any, Any]] = (
            iter(container.items()) if isinstance(container, dict) else enumerate(container)
        )
        for slot, value in items:
            if isinstance(container, dict) and not isinstance(slot, str):
                raise CheckpointingException(
                    f"state dict keys must be strings; {path or '<root>'} has key {slot!r}"
                )
            key = f"{path}{SEPARATOR}{slot}" if path else str(slot)
            # Dicts are containers; lists only when they hold tensors (as in DCP): a list of
            # plain values is one value, loaded whole whatever the length of the list it replaces.
            if (isinstance(value, dict) and value) or (isinstance(value, list) and _holds_tensor(value)):
                walk(value, key, parts + (slot,))
                continue
            if key in seen:
                raise CheckpointingException(
                    f"two entries of the state dict flatten to the same key {key!r}; rename one "
                    "(keys are nested names joined with '.')"
                )
            seen.add(key)
            leaves.append(Leaf(key, parts + (slot,), container, slot, value))

    if not isinstance(state_dict, dict):
        raise CheckpointingException(f"the state dict must be a dict, got {type(state_dict).__name__}")
    walk(state_dict, "", ())
    return leaves


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def dtensor_box(tensor: "DTensor") -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``(global_offset, local_shape, replica_id)`` of this rank's part of ``tensor``, or None
    when this rank is not in its mesh."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    offset = [0] * tensor.ndim
    shape = list(tensor.shape)
    replica: list[int] = []
    for mesh_dim, placement in enumerate(tensor.placements):
        position, parts = coordinate[mesh_dim], mesh.size(mesh_dim)
        if isinstance(placement, Replicate):
            replica.append(position)
        elif type(placement) is Shard:
            dim = placement.dim % tensor.ndim
            chunk = -(-shape[dim] // parts)
            start = min(chunk * position, shape[dim])
            shape[dim] = min(shape[dim], start + chunk) - start
            offset[dim] += start
            replica.append(0)
        elif isinstance(placement, Partial):
            raise CheckpointingException(
                f"a DTensor with a Partial placement holds unreduced values; reduce it first "
                f"(e.g. tensor.redistribute(placements=[Replicate()])). Placements: {tensor.placements}"
            )
        else:
            return _box_from_torch(tensor, coordinate)
    local = tuple(tensor.to_local().shape)
    if tuple(shape) != local:
        raise CheckpointingException(
            f"DTensor of shape {tuple(tensor.shape)} with placements {tensor.placements}: the "
            f"local tensor has shape {local}, expected {tuple(shape)} (non-standard sharding)"
        )
    return tuple(offset), local, tuple(replica)


def _box_from_torch(tensor: "DTensor", coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Placements other than Shard/Replicate (e.g. FSDP2+TP's ``_StridedShard``): torch's own
    computation of the local box."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover
        raise CheckpointingException(f"unsupported DTensor placements {tensor.placements}") from None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(tensor.to_local().shape):
        raise CheckpointingException(
            f"unsupported DTensor placements {tensor.placements}: the local tensor is not one box"
        )
    replica = tuple(c if isinstance(p, Replicate) else 0 for c, p in zip(coordinate, tensor.placements))
    return tuple(offset), tuple(shape), replica


def _canonical(value: Any) -> Any:
    """Equal values in one form: sets sorted, dict items sorted (their pickles otherwise depend
    on insertion order and on per-process string hashing)."""
    if isinstance(value, dict):
        return ("dict", sorted(((repr(k), _canonical(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, (set, frozenset)):
        return ("set", sorted((_canonical(v) for v in value), key=repr))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canonical(v) for v in value])
    return value


def _digest(value: Any) -> str:
    try:
        raw = pickle.dumps(_canonical(value), protocol=4)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        raise CheckpointingException(f"cannot serialize {type(value).__name__}: {exc}") from exc
    return hashlib.sha256(raw).hexdigest()


def describe(
    leaves_of: Callable[[], list[Leaf]], coordinator: Coordinator, *, check_replicas: bool
) -> tuple[dict[str, ShardedBase], list[tuple[str | int, ...]]]:
    """The engine's description of every leaf (``leaves_of()``, called inside the exchange so
    that its errors reach every rank), keyed by its flat key, and the paths of the leaves of
    all ranks (collective: one exchange).

    Leaves of DTensors whose mesh excludes this rank are left out. With ``check_replicas``
    (save), replicated tensors and objects must agree between ranks.
    """
    described: dict[str, ShardedBase] = {}
    replicated: list[tuple[Leaf, tuple]] = []

    def local_part() -> tuple[list, list]:
        leaves = leaves_of()
        for leaf in leaves:
            value = leaf.value
            if isinstance(value, DTensor):
                box = dtensor_box(value)
                if box is not None:
                    offset, _, replica = box
                    described[leaf.key] = ShardedTensor.from_global_offset(
                        leaf.key, value.to_local(), tuple(value.shape), offset, replica_id=replica
                    )
            elif isinstance(value, torch.Tensor):
                replicated.append((leaf, ("tensor", tuple(value.shape), str(value.dtype))))
            else:
                replicated.append((leaf, ("object", _digest(value) if check_replicas else "")))
        return [(leaf.key, sig) for leaf, sig in replicated], [leaf.path for leaf in leaves]

    gathered = coordinator.exchange("describing the state dict", local_part)
    first_holder: dict[str, tuple[int, tuple]] = {}
    for rank, (entries, _) in enumerate(gathered):
        for key, sig in entries:
            if key not in first_holder:
                first_holder[key] = (rank, sig)
            elif check_replicas and first_holder[key][1] != sig:
                other, other_sig = first_holder[key]
                raise ShardingValidationError(_disagreement(key, other, other_sig, rank, sig))
    for leaf, sig in replicated:
        main = first_holder[leaf.key][0] == coordinator.rank
        value = leaf.value
        if sig[0] == "tensor":
            described[leaf.key] = ShardedTensor.from_global_offset(
                leaf.key, value, tuple(value.shape), (0,) * value.ndim, replica_id=0 if main else 1
            )
        else:
            described[leaf.key] = ShardedObject(leaf.key, value, (1,), (0,), replica_id=0 if main else 1)
    paths = {tuple(path) for _, rank_paths in gathered for path in rank_paths}
    return described, sorted(paths, key=lambda p: tuple((isinstance(x, int), str(x)) for x in p))


def _disagreement(key: str, rank_a: int, sig_a: tuple, rank_b: int, sig_b: tuple) -> str:
    if sig_a[0] != sig_b[0]:
        what = f"is a {sig_a[0]} on rank {rank_a} but a {sig_b[0]} on rank {rank_b}"
    elif sig_a[0] == "tensor":
        what = (f"has shape {sig_a[1]} and dtype {sig_a[2]} on rank {rank_a} but shape {sig_b[1]} "
                f"and dtype {sig_b[2]} on rank {rank_b}")
    else:
        what = f"has different values on ranks {rank_a} and {rank_b}"
    return (
        f"state dict entry {key!r} {what}. Values that are not DTensors are saved once, as "
        "replicas of each other; give per-rank values distinct keys (e.g. include the rank), "
        "or use DTensors for sharded tensors"
    )
