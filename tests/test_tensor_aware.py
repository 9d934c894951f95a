"""TensorAwareStateDict over real gloo groups: fully parallel dedupe, pop/insert, hollow JSON,
to_state_dict fetching dropped shards from their keepers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

from distckpt import ShardedObject, ShardedTensor
from distckpt.errors import CheckpointingException
from distckpt.tensor_aware import MCoreTensorAwareStateDict, TensorAwareStateDict


def layout(rank: int, world: int, fill: bool) -> dict:
    """TP=2 x DP=world/2: weight split over TP and replicated over DP; a norm replicated
    everywhere; a distributed-optimizer flat range per DP rank; a per-rank object."""
    tp, dp = 2, world // 2
    tp_rank, dp_rank = rank % tp, rank // tp
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    norm = torch.linspace(0, 1, 6)
    weight = full.chunk(tp)[tp_rank]
    flat_len = weight.numel()
    start, stop = dp_rank * flat_len // dp, (dp_rank + 1) * flat_len // dp
    exp_avg = (weight * 3).reshape(-1)[start:stop]

    def data(t):
        return t.clone() if fill else torch.zeros_like(t)

    return {
        "iteration": 11,
        "weight": ShardedTensor.from_rank_offsets("weight", data(weight), (0, tp_rank, tp), replica_id=dp_rank),
        "norm": ShardedTensor.from_rank_offsets("norm", data(norm), replica_id=rank),
        "exp_avg": ShardedTensor.from_rank_offsets_flat(
            "exp_avg", data(exp_avg), weight.shape, (0, tp_rank, tp), flattened_range=slice(start, stop)),
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
    }


def _roundtrip(algo: str) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    tasd = TensorAwareStateDict.from_state_dict(layout(rank, world, fill=True), algo=algo)
    kept = len(list(tasd.tensors))
    data = tasd.pop_tensors()
    assert tasd.is_hollow
    with pytest.raises(CheckpointingException, match="hollow"):
        tasd.pop_tensors()
    raw = tasd.hollow_to_bytes()
    restored = TensorAwareStateDict.from_hollow_bytes(raw)  # JSON, no unpickling
    assert restored.is_hollow and restored.common_state_dict == {"iteration": 11}
    restored.insert_tensors([t.clone() for t in data])
    # a second save reuses the distribution: no gather of descriptions
    again = TensorAwareStateDict.from_state_dict(
        layout(rank, world, fill=True), algo=algo, cached_metadata=tasd.distribution)
    assert again.distribution is tasd.distribution or algo == "atomic"
    state = restored.to_state_dict(layout(rank, world, fill=False))
    expected = layout(rank, world, fill=True)
    for key in ("weight", "norm", "exp_avg"):
        assert torch.equal(state[key], expected[key].data), key
    assert state["iteration"] == 11 and state["rng"] == {"seed": rank}
    return {"kept": kept, "bytes": sum(t.numel() * t.element_size() for t in data)}


def test_fully_parallel_keeps_each_shard_once(dist):
    stats = dist.run(4, _roundtrip, "fully_parallel")
    # unique shards: 2 weight halves, 1 norm, 4 flat ranges -> 7, spread over 4 ranks
    assert sum(s["kept"] for s in stats) == 7
    assert max(s["bytes"] for s in stats) - min(s["bytes"] for s in stats) <= 4 * 24
    atomic = dist.run(4, _roundtrip, "atomic")
    assert [s["kept"] for s in atomic] == [3, 3, 3, 3]


def test_pop_insert_init_and_devices():
    tasd = MCoreTensorAwareStateDict.from_state_dict(layout(0, 2, fill=True), algo="atomic")
    originals = [t.clone() for t in tasd.tensors]
    popped = tasd.pop_tensors()
    with pytest.raises(CheckpointingException, match="3 ShardedTensors"):
        tasd.insert_tensors(popped[:2])
    with pytest.raises(CheckpointingException, match="needs shape"):
        tasd.insert_tensors([torch.zeros(1)] * 3)
    tasd.init_tensors()
    assert not tasd.is_hollow and [t.shape for t in tasd.tensors] == [t.shape for t in originals]
    tasd.pop_tensors()
    tasd.insert_tensors(popped)
    tasd.copy_tensors_to_cpu(non_blocking=True)
    tasd.restore_tensor_device()
    assert all(torch.equal(a, b) for a, b in zip(tasd.tensors, originals))
    with pytest.raises(CheckpointingException, match="unknown algo"):
        TensorAwareStateDict.from_state_dict({}, algo="fastest")


def test_hollow_bytes_refuse_what_needs_pickle():
    class Custom:
        pass

    state = layout(0, 2, fill=True)
    state["custom"] = Custom()
    tasd = TensorAwareStateDict.from_state_dict(state, algo="atomic")
    tasd.pop_tensors()
    with pytest.raises(CheckpointingException, match="without pickle"):
        tasd.hollow_to_bytes()
