"""Multi-process save and load over real gloo process groups (workers reused across tests)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.distributed as tdist

import distckpt
from distckpt import ShardedObject, ShardedTensor

from _dist import RankFailure
from _layouts import full_tensor, make_sharded, random_layout, shard_of

# Tensors of a model-like state: (key, global shape, dtype).
TENSORS = [
    ("embedding", (12, 8), torch.float32),
    ("qkv", (9, 6), torch.bfloat16),
    ("proj", (6, 10), torch.float16),
    ("norm", (10,), torch.float64),
    ("step_count", (), torch.int64),
    ("mask", (4, 3, 5), torch.bool),
    ("ids", (7, 7), torch.int32),
]


def layout_for(key: str, shape, world: int, seed: int):
    return random_layout(random.Random(f"{key}-{seed}-{world}"), shape, world)


def state_for(world: int, seed: int, rank: int, empty: bool) -> dict:
    state = {}
    for n, (key, shape, dtype) in enumerate(TENSORS):
        full = full_tensor(shape, dtype, seed=n)
        specs = layout_for(key, shape, world, seed)[rank]
        state[key] = [make_sharded(key, full, spec, empty=empty) for spec in specs]
    return state


def save_random(path: str, seed: int) -> int:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    state = state_for(world, seed, rank, empty=False)
    state["meta"] = {"iteration": 42}
    distckpt.save(state, path)
    return rank


def load_random_and_check(path: str, seed: int) -> int:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    request = state_for(world, seed, rank, empty=True)
    loaded = distckpt.load(request, path)
    checked = 0
    for n, (key, shape, dtype) in enumerate(TENSORS):
        full = full_tensor(shape, dtype, seed=n)
        specs = layout_for(key, shape, world, seed)[rank]
        got_list = loaded.get(key, [])  # a rank requesting no shard of a key gets none back
        assert len(got_list) == len(specs)
        for spec, got in zip(specs, got_list):
            want = shard_of(full, spec)
            assert got.dtype == dtype and torch.equal(got, want), (key, spec)
            checked += got.numel()
    assert loaded["meta"] == {"iteration": 42}
    return checked


@pytest.mark.parametrize("save_world,load_world", [(4, 2), (4, 3), (4, 1), (1, 4), (2, 8)])
def test_resharding_between_world_sizes(dist, tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    dist.run(save_world, save_random, path, seed=save_world)
    # The load layout is drawn independently: other cuts, other flat ranges, other replicas.
    counts = dist.run(load_world, load_random_and_check, path, seed=1000 + load_world)
    assert sum(counts) >= sum(math.prod(shape) for _, shape, _ in TENSORS)


def test_resharding_single_process_reads_a_multi_rank_checkpoint(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    dist.run(3, save_random, path, seed=7)
    plain = distckpt.load_plain_tensors(path)
    for n, (key, shape, dtype) in enumerate(TENSORS):
        assert torch.equal(plain[key], full_tensor(shape, dtype, seed=n)), key


# --- structured layouts: tensor parallel on one axis, resumed on another --------------------

def save_tp(path: str, axis: int) -> None:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    local = full.chunk(world, dim=axis)[rank].clone()
    distckpt.save({"w": ShardedTensor.from_rank_offsets("w", local, (axis, rank, world))}, path)


def load_tp(path: str, axis: int) -> bool:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    want = full.chunk(world, dim=axis)[rank]
    got = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(want), (axis, rank, world))}, path)
    return torch.equal(got["w"], want)


def test_rows_to_columns(dist, tmp_path):
    dist.run(4, save_tp, str(tmp_path), 0)
    assert all(dist.run(2, load_tp, str(tmp_path), 1))


def save_dp_replicated(path: str) -> None:
    rank = tdist.get_rank()
    state = {f"p{i}": ShardedTensor.from_rank_offsets(f"p{i}", torch.full((64, 16), float(i)), replica_id=rank)
             for i in range(8)}
    distckpt.save(state, path)


def test_replicas_are_written_once_with_balanced_writers(dist, tmp_path):
    dist.run(4, save_dp_replicated, str(tmp_path))
    data_files = sorted(f for f in os.listdir(tmp_path) if f.startswith("data-"))
    assert len(data_files) == 4  # every rank wrote a share
    sizes = [os.path.getsize(tmp_path / f) for f in data_files]
    assert max(sizes) - min(sizes) < 1024  # each wrote 2 of the 8 tensors
    plain = distckpt.load_plain_tensors(tmp_path)
    assert all(torch.equal(plain[f"p{i}"], torch.full((64, 16), float(i))) for i in range(8))


# --- sharded objects -------------------------------------------------------------------------

def save_objects(path: str) -> None:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    distckpt.save({"rng": ShardedObject("rng", {"rank": rank, "state": torch.tensor([rank] * 3)}, (world,), (rank,))}, path)


def load_objects(path: str):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    try:
        out = distckpt.load({"rng": ShardedObject("rng", None, (world,), (rank,))}, path)
    except distckpt.MismatchError as exc:
        return "mismatch: " + str(exc)
    return out["rng"]["rank"]


def test_sharded_objects_per_rank(dist, tmp_path):
    dist.run(4, save_objects, str(tmp_path))
    assert dist.run(4, load_objects, str(tmp_path)) == [0, 1, 2, 3]
    outcomes = dist.run(2, load_objects, str(tmp_path))
    assert all("'rng' was saved as a grid of shape (4,)" in o for o in outcomes)


# --- errors reach every rank -------------------------------------------------------------------

def expect_error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except distckpt.CheckpointingException as exc:
        return type(exc).__name__, str(exc)
    return None


def save_overlapping(path: str):
    rank = tdist.get_rank()
    # Both ranks claim rows 0..3 as main replica; rows 4..7 uncovered.
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), (0, 0, 2))
    del rank
    return expect_error(distckpt.save, {"w": st}, path)


def test_validation_error_is_raised_on_every_rank(dist, tmp_path):
    outcomes = dist.run(2, save_overlapping, str(tmp_path))
    assert all(o is not None and o[0] == "ShardingValidationError" for o in outcomes)
    assert all("[0:4, 0:2]" in o[1] and "rank 0" in o[1] and "rank 1" in o[1] for o in outcomes)
    assert not (tmp_path / "metadata.json").exists()


def save_with_rank_common(path: str, use_hook: bool):
    rank = tdist.get_rank()
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, 2)), "seed": rank, "lr": 0.1}
    hook = (lambda common: {k: v for k, v in common.items() if k != "seed"}) if use_hook else None
    return expect_error(distckpt.save, state, path, preprocess_common_before_consistancy_check=hook)


def test_common_state_must_agree_unless_preprocessed(dist, tmp_path):
    outcomes = dist.run(2, save_with_rank_common, str(tmp_path / "a"), False)
    assert all(o[0] == "ShardingValidationError" and "seed" in o[1] for o in outcomes)
    assert dist.run(2, save_with_rank_common, str(tmp_path / "b"), True) == [None, None]
    assert distckpt.load_common_state_dict(tmp_path / "b") == {"seed": 0, "lr": 0.1}


def load_with_ghost_on_rank1(path: str):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 12), (0, rank, world))}
    if rank == 1:
        request["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.zeros(1))
    return expect_error(distckpt.load, request, path)


def test_missing_key_on_one_rank_fails_every_rank(dist, tmp_path):
    dist.run(4, save_tp, str(tmp_path), 0)
    outcomes = dist.run(4, load_with_ghost_on_rank1, str(tmp_path))
    assert all(o is not None and o[0] == "MissingKeyError" and "ghost" in o[1] for o in outcomes)
    assert "rank 1 failed" in outcomes[0][1]


def save_with_write_failure_on_rank(path: str, failing_rank: int):
    import distckpt.engine.save_job as serialization

    rank = tdist.get_rank()
    original = serialization.write_rank_files
    if rank == failing_rank:
        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")
        serialization.write_rank_files = broken
    try:
        st = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, rank, tdist.get_world_size()))
        return expect_error(distckpt.save, {"w": st}, path, overwrite=True)
    finally:
        serialization.write_rank_files = original


def test_write_failure_on_one_rank_fails_every_rank_and_keeps_previous(dist, tmp_path):
    dist.run(3, save_tp, str(tmp_path), 1)  # a previous checkpoint in the same directory
    outcomes = dist.run(3, save_with_write_failure_on_rank, str(tmp_path), 2)
    assert all(o is not None and "No space left on device" in o[1] for o in outcomes)
    assert "rank 2 failed during writing data" in outcomes[0][1]
    assert all(dist.run(3, load_tp, str(tmp_path), 1))  # the previous checkpoint still loads


def save_existing(path: str):
    st = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, tdist.get_rank(), 2))
    return expect_error(distckpt.save, {"w": st}, path)


def test_existing_checkpoint_refused_on_every_rank(dist, tmp_path):
    assert dist.run(2, save_existing, str(tmp_path)) == [None, None]
    outcomes = dist.run(2, save_existing, str(tmp_path))
    assert all(o[0] == "CheckpointExistsError" and "overwrite=True" in o[1] for o in outcomes)


def load_corrupt(path: str):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8 // world, 12), (0, rank, world))}
    return expect_error(distckpt.load, request, path)


def test_checksum_error_on_one_rank_reaches_all(dist, tmp_path):
    dist.run(2, save_tp, str(tmp_path), 0)
    victim = sorted(f for f in os.listdir(tmp_path) if f.startswith("data-"))[1]  # rank 1's rows
    with open(tmp_path / victim, "r+b") as f:
        f.seek(os.path.getsize(tmp_path / victim) - 3)
        f.write(b"\xff\xff\xff")
    outcomes = dist.run(4, load_corrupt, str(tmp_path))
    assert all(o is not None and o[0] == "ChecksumError" and victim in o[1] and "'w'" in o[1] for o in outcomes)


def test_harness_reports_unexpected_exceptions(dist):
    with pytest.raises(RankFailure):
        dist.run(2, _raise_on_rank_1)


def _raise_on_rank_1():
    if tdist.get_rank() == 1:
        raise RuntimeError("boom")


def save_with_set_in_common(path: str):
    st = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, tdist.get_rank(), 2))
    return expect_error(distckpt.save, {"w": st, "args": {"tags": {"alpha", "beta", "gamma", "delta"}}}, path)


def test_equal_sets_in_common_state_agree_across_hash_seeds(dist, tmp_path):
    # Workers share one hash seed here; the digest must not depend on it anyway.
    from distckpt.validation import common_digests

    assert common_digests({"s": {"alpha", "beta"}}) == common_digests({"s": {"beta", "alpha"}})
    import subprocess
    import sys

    code = "from distckpt.validation import common_digests; print(common_digests({'s': {'alpha','beta','gamma'}}))"
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                           capture_output=True, text=True, check=True).stdout for seed in (1, 2, 3)}
    assert len(outs) == 1
    assert dist.run(2, save_with_set_in_common, str(tmp_path)) == [None, None]


def load_from_rank_specific_dir(paths: list):
    rank = tdist.get_rank()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 12), (0, rank, 2))}
    return expect_error(distckpt.load, request, paths[rank], strict="raise_all")


def test_ranks_reading_different_checkpoints_fail_together(dist, tmp_path):
    # Simulates an overwrite committed between the ranks' reads of metadata.json.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dist.run(2, save_tp, a, 0)
    dist.run(2, save_tp, b, 0)
    outcomes = dist.run(2, load_from_rank_specific_dir, [a, b], timeout=60)
    assert all(o is not None and o[0] == "ConcurrentModificationError" for o in outcomes)


def load_twice_recording_steps(path: str) -> list:
    from distckpt import serialization
    from distckpt.engine import collective

    serialization._VALIDATED_REQUESTS.clear()  # workers are reused: forget earlier tests' loads
    steps: list = []
    original = collective.Coordinator.exchange

    def spy(self, step, fn):
        steps.append(step)
        return original(self, step, fn)

    collective.Coordinator.exchange = spy
    try:
        runs = []
        for _ in range(2):
            steps.clear()
            assert load_tp(path, 1)
            runs.append(list(steps))
        return runs
    finally:
        collective.Coordinator.exchange = original


def test_repeated_load_skips_the_validation_gather(dist, tmp_path):
    dist.run(2, save_tp, str(tmp_path), 0)
    first, second = dist.run(2, load_twice_recording_steps, str(tmp_path))[0]
    assert first == ["load preparation", "load validation", "loading"]
    assert second == ["load preparation", "loading"]


# --- fully parallel load --------------------------------------------------------------------

def save_many(path: str) -> None:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    state = {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)[rank * 64 // world:(rank + 1) * 64 // world] + i,
        (0, rank, world)) for i in range(6)}
    distckpt.save(state, path)


def load_replicated(path: str, fully_parallel: bool):
    from distckpt.strategies import DistCkptLoadShardedStrategy

    rank = tdist.get_rank()
    strategy = DistCkptLoadShardedStrategy(thread_count=2, fully_parallel=fully_parallel)
    request = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(64, 32), replica_id=rank) for i in range(6)}
    try:
        out = distckpt.load(request, path, sharded_strategy=strategy)
    except distckpt.CheckpointingException as exc:
        return type(exc).__name__, str(exc)
    ok = all(torch.equal(out[f"t{i}"], torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) + i) for i in range(6))
    return ok, strategy.last_bytes


def test_fully_parallel_load_reads_each_byte_once(dist, tmp_path):
    dist.run(4, save_many, str(tmp_path))
    total = 6 * 64 * 32 * 4
    plain = dist.run(4, load_replicated, str(tmp_path), False)
    assert all(ok for ok, _ in plain) and all(b["read"] == total for _, b in plain)
    parallel = dist.run(4, load_replicated, str(tmp_path), True)
    assert all(ok for ok, _ in parallel)
    assert sum(b["read"] for _, b in parallel) == total  # storage read once in all
    assert all(b["read"] <= total / 2 and b["read"] + b["received"] == total for _, b in parallel)


def test_fully_parallel_load_reports_corruption_on_every_rank(dist, tmp_path):
    dist.run(2, save_many, str(tmp_path))
    victim = sorted(f for f in os.listdir(tmp_path) if f.startswith("data-"))[0]
    with open(tmp_path / victim, "r+b") as f:
        f.seek(os.path.getsize(tmp_path / victim) - 5)
        f.write(b"\x00\xff")
    outcomes = dist.run(4, load_replicated, str(tmp_path), True)
    assert all(o[0] == "ChecksumError" and victim in o[1] for o in outcomes)
