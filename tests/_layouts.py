"""Random shardings of a global tensor, shared by property tests and multi-rank tests.

A layout is a list (one entry per rank) of shard specs ``(offset, shape, flat, replica_id)``
where ``flat`` is ``None`` or a ``(start, stop)`` range of the box's row-major flattening.
"""

from __future__ import annotations

import math
import random

import torch

from distckpt import ShardedTensor

Spec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None, int]


def grid_cells(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cells of the (possibly uneven) grid with interior cut points ``cuts[axis]``."""
    bounds = [[0] + sorted(set(c)) + [n] for c, n in zip(cuts, shape)]
    cells: list = [((), ())]
    for b in bounds:
        cells = [(o + (lo,), s + (hi - lo,)) for o, s in cells for lo, hi in zip(b, b[1:]) if hi > lo]
    return cells


def random_layout(rng: random.Random, shape: tuple[int, ...], world: int,
                  flat_prob: float = 0.3, replica_prob: float = 0.3) -> list[list[Spec]]:
    """Cover ``shape`` exactly once with main replicas spread over ``world`` ranks, plus
    optional extra replicas; some cells are split into flat ranges."""
    cuts = [sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))) if n > 1 else [] for n in shape]
    layout: list[list[Spec]] = [[] for _ in range(world)]
    for offset, box in grid_cells(shape, cuts):
        numel = math.prod(box)
        if numel > 1 and rng.random() < flat_prob:
            points = sorted(rng.sample(range(1, numel), rng.randint(1, min(3, numel - 1))))
            ranges = list(zip([0] + points, points + [numel]))
        else:
            ranges = [None]
        for flat in ranges:
            owner = rng.randrange(world)
            layout[owner].append((offset, box, flat, 0))
            if world > 1 and rng.random() < replica_prob:
                other = rng.choice([r for r in range(world) if r != owner])
                layout[other].append((offset, box, flat, 1))
    return layout


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def shard_of(full: torch.Tensor, spec: Spec) -> torch.Tensor:
    offset, box, flat, _ = spec
    region = full[tuple(slice(o, o + s) for o, s in zip(offset, box))]
    if flat is None:
        return region.clone()
    return region.reshape(-1)[flat[0] : flat[1]].clone()


def make_sharded(key: str, full: torch.Tensor, spec: Spec, empty: bool = False) -> ShardedTensor:
    """The ShardedTensor for ``spec`` (data copied from ``full`` unless ``empty``)."""
    offset, box, flat, replica = spec
    data = shard_of(full, spec)
    if empty:
        data = torch.zeros_like(data)
    if flat is None:
        return ShardedTensor.from_global_offset(key, data, tuple(full.shape), offset, replica_id=replica)
    meta = torch.empty(box, dtype=full.dtype, device="meta")
    st = ShardedTensor.from_global_offset(key, meta, tuple(full.shape), offset, replica_id=replica)
    st.data, st.flattened_range = data, slice(*flat)
    st.validate_metadata_integrity()
    return st
