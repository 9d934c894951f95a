"""LocalCheckpointManager over real gloo groups, with "nodes" simulated as rank groups sharing
a local root directory (2 ranks per node)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as tdist

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt.local import LocalCheckpointManager, NotRecoverableLocallyError
from distckpt.strategies.async_utils import AsyncCallsQueue
from distckpt.tensor_aware import TensorAwareStateDict

RANKS_PER_NODE = 2


def node_root(base: str, rank: int) -> str:
    return os.path.join(base, f"node{rank // RANKS_PER_NODE}")


def full(key: str, step: int) -> torch.Tensor:
    return torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6) * (1 + len(key)) + step


def layout(rank: int, world: int, step: int, fill: bool = True) -> dict:
    """Row-split weight, a per-DP-rank flat optimizer range, a replicated norm, a per-rank object."""
    weight = full("weight", step).chunk(world)[rank]
    flat = full("exp_avg", step).reshape(-1)
    n = flat.numel()
    rng = slice(rank * n // world, (rank + 1) * n // world)

    def data(t):
        return t.clone() if fill else torch.zeros_like(t)

    return {
        "step": step,
        "weight": ShardedTensor.from_rank_offsets("weight", data(weight), (0, rank, world)),
        "exp_avg": ShardedTensor.from_rank_offsets_flat("exp_avg", data(flat[rng]), (12, 6), flattened_range=rng),
        "norm": ShardedTensor.from_rank_offsets("norm", data(torch.full((6,), float(step))), replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
    }


def check(state: dict, rank: int, world: int, step: int) -> None:
    expected = layout(rank, world, step)
    for key in ("weight", "exp_avg", "norm"):
        assert torch.equal(state[key], expected[key].data), key
    assert state["step"] == step and state["rng"] == {"rank": rank, "step": step}


def manager(base: str, factor: int, **kwargs) -> LocalCheckpointManager:
    return LocalCheckpointManager(node_root(base, tdist.get_rank()), replication_factor=factor,
                                  replication_stride=RANKS_PER_NODE, **kwargs)


def _save(base: str, factor: int, steps: list[int], is_async: bool = False, keep_last: int = 2) -> None:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    m = manager(base, factor, keep_last=keep_last)
    queue = AsyncCallsQueue()
    for step in steps:
        state = layout(rank, world, step)
        tasd = TensorAwareStateDict.from_state_dict(state, algo="fully_parallel")
        request = m.save(tasd, step, is_async=is_async)
        if is_async:
            state["weight"].data.fill_(-1)  # training goes on: must not reach the checkpoint
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
    m.wait_for_replication()
    tdist.barrier()


def _load(base: str, factor: int) -> int:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    m = manager(base, factor)
    latest = m.find_latest()
    if latest < 0:
        with pytest.raises(NotRecoverableLocallyError, match="global checkpoint"):
            m.load()
        return latest
    tasd = m.load()
    state = tasd.to_state_dict(layout(rank, world, latest, fill=False))
    check(state, rank, world, latest)
    return latest


def test_save_find_latest_load_and_retention(dist, tmp_path):
    base = str(tmp_path)
    dist.run(4, _save, base, 2, [10, 20, 30])
    assert sorted(os.listdir(os.path.join(base, "node0"))) == ["iter_0000020", "iter_0000030"]  # keep_last=2
    # each node holds its own ranks' pieces and a replica of the other node's
    holder0 = os.path.join(base, "node0", "iter_0000030", "holder_00000")
    assert sorted(f for f in os.listdir(holder0) if f.endswith(".json")) == ["piece-r00000.json", "piece-r00002.json"]
    assert dist.run(4, _load, base, 2) == [30] * 4


def test_async_save(dist, tmp_path):
    dist.run(4, _save, str(tmp_path), 2, [5], True)
    assert dist.run(4, _load, str(tmp_path), 2) == [5] * 4


@pytest.mark.parametrize("factor", [1, 2])
def test_node_loss(dist, tmp_path, factor):
    base = str(tmp_path)
    dist.run(4, _save, base, factor, [7])
    shutil.rmtree(os.path.join(base, "node1"))  # node 1 (ranks 2 and 3) lost its disk
    latest = dist.run(4, _load, base, factor)
    assert latest == ([7] * 4 if factor == 2 else [-1] * 4)
    if factor == 2:  # the lost pieces were fetched back: node 1 holds them again
        holder = os.path.join(base, "node1", "iter_0000007", "holder_00002")
        assert "piece-r00002.json" in os.listdir(holder)


def test_corrupted_copy_is_read_from_another_holder(dist, tmp_path):
    base = str(tmp_path)
    dist.run(4, _save, base, 2, [3])
    own = os.path.join(base, "node0", "iter_0000003", "holder_00001")
    (data,) = [f for f in os.listdir(own) if f.startswith("data-") and "-r00001-" in f]
    path = os.path.join(own, data)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    assert dist.run(4, _load, base, 2) == [3] * 4


def test_crash_leftovers_are_ignored_and_cleaned(dist, tmp_path):
    base = str(tmp_path)
    dist.run(4, _save, base, 2, [1])
    holder = os.path.join(base, "node0", "iter_0000002", "holder_00000")
    os.makedirs(holder)
    # a crash during iteration 2: a temp file and a data file without its record
    open(os.path.join(holder, "data-dead-r00000-0.safetensors.1234.partial"), "wb").write(b"x" * 100)
    open(os.path.join(holder, "data-dead-r00000-0.safetensors"), "wb").write(b"x" * 100)
    assert dist.run(4, _load, base, 2) == [1] * 4  # iteration 2 is incomplete: 1 is the latest
    dist.run(4, _save, base, 2, [2])
    assert not [f for f in os.listdir(holder) if "dead" in f]
    assert dist.run(4, _load, base, 2) == [2] * 4


def _load_resharded(base: str) -> bool:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    m = LocalCheckpointManager(node_root(base, rank * RANKS_PER_NODE), replication_factor=1)
    request = {
        "weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(12, 6 // world), (1, rank, world)),
        "exp_avg": ShardedTensor.from_rank_offsets("exp_avg", torch.zeros(12 // world, 6), (0, rank, world)),
        "norm": ShardedTensor.from_rank_offsets("norm", torch.zeros(6), replica_id=rank),
    }
    state = m.load_resharded(request)
    assert torch.equal(state["weight"], full("weight", 9).chunk(world, dim=1)[rank])
    assert torch.equal(state["exp_avg"], full("exp_avg", 9).chunk(world)[rank])
    assert torch.equal(state["norm"], torch.full((6,), 9.0)) and state["step"] == 9
    return True


def test_resharded_load_from_local_pieces(dist, tmp_path):
    """Saved by 4 ranks on 2 nodes; loaded by 2 ranks (one per node) in another layout."""
    base = str(tmp_path)
    dist.run(4, _save, base, 2, [9])
    assert dist.run(2, _load_resharded, base) == [True, True]
    assert distckpt  # the same engine as global checkpoints
