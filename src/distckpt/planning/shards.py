"""Plain descriptions of what a rank holds: the input of planning (no tensors, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from .boxes import Box, FlatPiece, flat_range_to_boxes


@dataclass(frozen=True, slots=True)
class TensorShard:
    """This rank's part of global tensor ``key``: ``box`` in global coordinates, or only the
    flat range ``flat`` (start, stop) of the box's row-major flattening."""

    key: str
    dtype: str
    itemsize: int
    global_shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None = None
    main: bool = True
    allow_shape_mismatch: bool = False

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat is not None else self.box.volume

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def identity(self) -> tuple:
        """Equal for all replicas of the same data."""
        return (self.key, self.box, self.flat)

    def pieces(self) -> list[FlatPiece]:
        """The boxes (global coordinates) this shard holds, with their start in ``data``
        (flattened); one piece for a non-flat shard."""
        if self.flat is None:
            return [FlatPiece(self.box, 0)]
        start, stop = self.flat
        out = []
        for piece in flat_range_to_boxes(self.box.shape, start, stop):
            offset = tuple(o + p for o, p in zip(self.box.offset, piece.box.offset))
            out.append(FlatPiece(Box(offset, piece.box.shape), piece.flat_start - start))
        return out


@dataclass(frozen=True, slots=True)
class ObjectShard:
    """One serialized :class:`~distckpt.mapping.ShardedObject` held by this rank."""

    unique_key: str
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    nbytes: int
    main: bool = True
