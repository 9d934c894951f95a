"""How a rank describes its part of the global state (names and semantics of Megatron-Core).

A *sharded state dict* is a nested dict whose leaves may be:

* :class:`ShardedTensor` -- this rank's box (or a flat range of a box) of a global tensor;
* :class:`ShardedObject` -- one shard of a grid of Python objects (e.g. per-rank RNG state);
* :class:`ShardedTensorFactory` -- a tensor stored in another form than it is used in;
* :class:`LocalNonPersistentObject` -- a value returned by ``load`` as-is and never saved;
* anything else -- the *common* state, identical on every rank, saved once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .errors import CheckpointingException

ReplicaId = Union[int, tuple[int, ...]]  # noqa: UP007 - a runtime alias, valid on 3.10
StateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
CommonStateDict = dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (replica id 0 or all zeros) is the copy that counts for coverage."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`CheckpointingException` if the fields contradict each other."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy holding only the metadata."""


@dataclass
class ShardedTensor(ShardedBase):
    """This rank's part of a global tensor.

    The part is the box ``global_offset : global_offset + (1,)*prepend_axis_num + local_shape``
    of a tensor of ``global_shape``. With ``flattened_range`` set, ``data`` is 1-D and holds only
    that contiguous range of the row-major flattening of the box (distributed-optimizer style).

    Attributes:
        key: unique identifier of the global tensor.
        data: the local data (``None`` or a meta tensor for metadata-only descriptions).
        dtype: dtype of the global tensor.
        local_shape: shape of the local box, without the prepended axes.
        global_shape: shape of the global tensor, prepended axes included.
        global_offset: offset of the local box in the global tensor, in elements.
        axis_fragmentations: number of chunks per axis of a regular grid (informational: any
            box layout is saved and loaded, including uneven ones).
        replica_id: 0 or all zeros marks the main replica; other replicas hold the same data.
        prepend_axis_num: leading global axes (of length 1 locally) absent from ``data``.
        allow_shape_mismatch: on load, the stored global shape may differ from
            ``global_shape``; the overlapping region is loaded, the rest of ``data`` is left as is.
        flattened_range: a ``slice`` of the flattened local box held in ``data``.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(s) for s in self.axis_fragmentations)
        self.validate_metadata_integrity()

    def _fail(self, what: str) -> CheckpointingException:
        return CheckpointingException(f"ShardedTensor {self.key!r}: {what}")

    def validate_metadata_integrity(self) -> None:
        ndim = len(self.local_shape) + self.prepend_axis_num
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise self._fail(
                f"global_shape {self.global_shape} and global_offset {self.global_offset} must "
                f"have len(local_shape) + prepend_axis_num = {ndim} axes"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != ndim:
            raise self._fail(f"axis_fragmentations {self.axis_fragmentations} must have {ndim} axes")
        for axis, (off, size, total) in enumerate(
            zip(self.global_offset, self.box_shape, self.global_shape)
        ):
            if off < 0 or size < 0 or off + size > total:
                raise self._fail(
                    f"local box [{off}, {off + size}) on axis {axis} lies outside the global "
                    f"shape {self.global_shape}"
                )
        data = self.data
        if self.flattened_range is not None:
            rng = self.flattened_range
            if rng.step not in (None, 1) or rng.start is None or rng.stop is None:
                raise self._fail(f"flattened_range must be a slice(start, stop), got {rng}")
            if not 0 <= rng.start <= rng.stop <= math.prod(self.local_shape):
                raise self._fail(
                    f"flattened_range {rng} lies outside the {math.prod(self.local_shape)} "
                    f"elements of the local shape {self.local_shape}"
                )
            if data is not None and data.device.type != "meta":
                if data.ndim != 1 or data.numel() != rng.stop - rng.start:
                    raise self._fail(
                        f"flattened data must be 1-D with {rng.stop - rng.start} elements, got "
                        f"shape {tuple(data.shape)}"
                    )
        elif data is not None and tuple(data.shape) != self.local_shape:
            raise self._fail(f"data shape {tuple(data.shape)} != local_shape {self.local_shape}")
        if data is not None and data.dtype != self.dtype:
            raise self._fail(f"data dtype {data.dtype} != dtype {self.dtype}")

    @property
    def box_shape(self) -> tuple[int, ...]:
        """Shape of the local box in global coordinates (prepended axes have length 1)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def global_slice(self) -> tuple[slice | int, ...]:
        """Index into the global tensor selecting this box (prepended axes as integers)."""
        return tuple(
            off if axis < self.prepend_axis_num else slice(off, off + size)
            for axis, (off, size) in enumerate(zip(self.global_offset, self.box_shape))
        )

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Index of this chunk in the regular grid given by ``axis_fragmentations``."""
        return tuple(
            off // size if size else 0 for off, size in zip(self.global_offset, self.box_shape)
        )

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Number of chunks per axis of the regular grid."""
        if self.axis_fragmentations is not None:
            return self.axis_fragmentations
        return tuple(
            total // size if size else 1 for total, size in zip(self.global_shape, self.box_shape)
        )

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: str | torch.device, init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` (e.g. for a metadata-only description before loading)."""
        if self.data is not None and self.data.device.type != "meta":
            return
        if self.flattened_range is not None:
            shape: tuple[int, ...] = (self.flattened_range.stop - self.flattened_range.start,)
        else:
            shape = self.local_shape
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Describe ``data`` as chunk ``axis_rank_offset`` of ``axis_fragm`` equal chunks along
        each given axis: ``rank_offsets`` are ``(axis, axis_rank_offset, axis_fragm)`` triples,
        axes counted in the global tensor (prepended axes included)."""
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: cannot build a flat ShardedTensor with "
                "from_rank_offsets; use from_rank_offsets_flat"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen: set[int] = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not (0 <= axis < ndim) or axis_fragm < 1 or not 0 <= axis_rank_offset < axis_fragm:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: invalid rank offset {(axis, axis_rank_offset, axis_fragm)} "
                    f"(need 0 <= axis < {ndim} and 0 <= axis_rank_offset < axis_fragm)"
                )
            if axis in seen:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: axis {axis} given twice in rank offsets {rank_offsets}"
                )
            seen.add(axis)
            local_size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = local_size * axis_fragm
            global_offset[axis] = local_size * axis_rank_offset
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *args: Any,
        flattened_range: slice | None,
        **kwargs: Any,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for 1-D ``data`` holding ``flattened_range`` of a local
        box of shape ``non_flat_local_shape``."""
        if flattened_range is None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets_flat needs a flattened_range; use "
                "from_rank_offsets for non-flat data"
            )
        if data.ndim != 1:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flat data must be 1-D, got shape {tuple(data.shape)}"
            )
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flattened_range {flattened_range} holds "
                f"{flattened_range.stop - flattened_range.start} elements but data has {data.numel()}"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        described = cls.from_rank_offsets(key, meta, *args, **kwargs)
        return replace(described, data=data, flattened_range=flattened_range)

    @classmethod
    def from_global_offset(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: tuple[int, ...],
        global_offset: tuple[int, ...],
        *,
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Describe ``data`` as the box at ``global_offset`` of a tensor of ``global_shape``;
        boxes need not form a regular grid (uneven splits such as FSDP2's)."""
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            None,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )


@dataclass
class ShardedObject(ShardedBase):
    """One shard of a grid of Python objects of shape ``global_shape`` (e.g. per-rank RNG state
    with ``global_shape=(world_size,)`` and ``global_offset=(rank,)``).

    Objects are stored per shard; loading looks the shard up by :attr:`unique_key`, so a grid
    saved with one shape cannot be loaded as a grid of another shape (a clear error says so).
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have the same number of axes"
            )
        for off, total in zip(self.global_offset, self.global_shape):
            if not 0 <= off < total:
                raise CheckpointingException(
                    f"ShardedObject {self.key!r}: offset {self.global_offset} lies outside the "
                    f"grid {self.global_shape}"
                )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Rebuild the metadata of a shard from its :attr:`unique_key`."""
        key, _, shard = unique_key.rpartition("/")
        try:
            if not shard.startswith("shard_"):
                raise ValueError
            offset_str, shape_str = shard[len("shard_") :].split("_")
            offset = tuple(int(s) for s in offset_str.split(".") if s)
            shape = tuple(int(s) for s in shape_str.split(".") if s)
        except ValueError:
            raise CheckpointingException(
                f"{unique_key!r} is not a ShardedObject unique key ('<key>/shard_<offset>_<shape>')"
            ) from None
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], Any]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved in another form than it is used in.

    ``build_fn(key, data, replica_id, flattened_range)`` returns the sharded state dict that is
    saved (or requested on load); after loading, ``merge_fn`` turns the loaded sub-dict back
    into the value placed where the factory was.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Factories are validated through what they build."""

    def without_data(self) -> "ShardedTensorFactory":
        raise CheckpointingException(
            f"ShardedTensorFactory {self.key!r} has no metadata-only form; call build() first"
        )


class LocalNonPersistentObject:
    """A value that ``load`` returns unchanged and ``save`` drops (e.g. a live object)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonPersistentObject({self.obj!r})"


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""

    def _build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(_build, sharded_state_dict)


def apply_factory_merges(
    x1: StateDict, x2: ShardedStateDict, key: tuple[str | int, ...] = ()
) -> StateDict:
    """Apply the ``merge_fn`` of each factory in ``x2`` to the matching sub-dict of ``x1``.

    ``x2`` is the structure of factories extracted before :func:`apply_factories`; ``x1`` is the
    loaded state dict. Returns ``x1`` (merged in place where possible).
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise CheckpointingException(
                    f"factory at {key + (k,)} has no loaded value to merge (loaded keys: "
                    f"{sorted(map(str, x1))})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
        return x1
    raise CheckpointingException(
        f"cannot merge factories at {key}: loaded {type(x1).__name__}, factories "
        f"{type(x2).__name__}"
    )


def is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedBase)


__all__ = [
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "CommonStateDict",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonPersistentObject",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
    "extract_matching_values",
]
