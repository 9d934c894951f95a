"""The content of the golden checkpoints: deterministic, so tests can recompute it."""

from __future__ import annotations

import torch

from distckpt import ShardedObject, ShardedTensor

DTYPES = {
    "f32": (torch.float32, (5, 4)),
    "bf16": (torch.bfloat16, (3, 7)),
    "f16": (torch.float16, (6,)),
    "f64": (torch.float64, (2, 2, 2)),
    "i64_scalar": (torch.int64, ()),
    "i32": (torch.int32, (4, 3)),
    "i8": (torch.int8, (9,)),
    "u8": (torch.uint8, (2, 5)),
    "mask": (torch.bool, (3, 3)),
}


def value(name: str) -> torch.Tensor:
    dtype, shape = DTYPES[name]
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64).reshape(shape) * 1.25 - 3
    if dtype == torch.bool:
        return (torch.arange(n).reshape(shape) % 3) == 0
    return base.to(dtype)


def single_state(empty: bool) -> dict:
    state: dict = {
        name: ShardedTensor.from_rank_offsets(name, torch.zeros_like(value(name)) if empty else value(name))
        for name in DTYPES
    }
    state["obj"] = ShardedObject("obj", None if empty else {"a": [1, 2], "t": torch.tensor([7])}, (1,), (0,))
    if not empty:
        state["common"] = {"iteration": 10, "name": "golden"}
    return state


W = torch.arange(32, dtype=torch.float32).reshape(8, 4)
OPT = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8
NORM = torch.tensor([1.0, 2.0, 3.0, 4.0])


def two_rank_state(rank: int, empty: bool) -> dict:
    """Rows of w split over 2 ranks; opt stored as two flat ranges (7 and 17 elements) of one
    box; norm replicated (rank 1 holds a non-main replica)."""
    w = W.chunk(2)[rank].clone()
    flat = slice(0, 7) if rank == 0 else slice(7, 24)
    opt = OPT.reshape(-1)[flat].clone()
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(w) if empty else w, (0, rank, 2)),
        "opt": ShardedTensor.from_rank_offsets_flat(
            "opt", torch.zeros_like(opt) if empty else opt, (4, 6), flattened_range=flat
        ),
        "norm": ShardedTensor.from_rank_offsets("norm", torch.zeros(4) if empty else NORM.clone(), replica_id=rank),
        "rng": ShardedObject("rng", None if empty else torch.tensor([rank, rank]), (2,), (rank,)),
    }
    if not empty:
        state["iteration"] = 20
    return state


# Format v2 only: rows of G split FSDP-style in chunks of 3 over 25 shards (the last ones
# shorter or empty), saved from one process: the index stores them as one grid of packed arrays.
G = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3) / 4
G_SHARDS = 25


def grid_state(empty: bool) -> dict:
    shards = []
    for i in range(G_SHARDS):
        start = min(3 * i, 70)
        stop = min(start + 3, 70)
        rows = G[start:stop].clone()
        shards.append(ShardedTensor.from_global_offset("g", torch.zeros_like(rows) if empty else rows,
                                                       (70, 3), (start, 0)))
    return {"g": shards}
