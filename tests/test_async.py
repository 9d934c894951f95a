"""Async save (AsyncRequest / AsyncCallsQueue) and cached save plans."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist

import distckpt
import distckpt.engine.save_job as save_job
from distckpt import ShardedObject, ShardedTensor
from distckpt.engine.staging import POOL
from distckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest


def state(value: float, rank: int = 0, world: int = 1) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 8), value) + rank, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((16,), value), replica_id=rank),
        "rng": ShardedObject("rng", torch.tensor([rank, int(value)]), (world,), (rank,)),
        "step": int(value),
    }


def request(rank: int = 0, world: int = 1) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 8), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(16), replica_id=rank),
        "rng": ShardedObject("rng", None, (world,), (rank,)),
    }


def test_async_save_commits_at_finalize_and_ignores_later_mutation(tmp_path):
    sd = state(1.0)
    tensors = (sd["w"].data, sd["b"].data)
    req = distckpt.save(sd, tmp_path, async_sharded_save=True)
    assert isinstance(req, AsyncRequest)
    for t in tensors:  # training goes on and updates the parameters in place
        t.fill_(-5.0)
    queue = AsyncCallsQueue()
    assert queue.schedule_async_request(req) == 0
    assert queue.get_num_unfinalized_calls() == 1
    assert not (tmp_path / "metadata.json").exists()
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert queue.get_num_unfinalized_calls() == 0
    loaded = distckpt.load(request(), tmp_path)
    assert torch.equal(loaded["w"], torch.full((4, 8), 1.0)) and torch.equal(loaded["b"], torch.full((16,), 1.0))
    assert loaded["step"] == 1 and loaded["rng"].tolist() == [0, 1]
    queue.close()


def test_async_request_execute_sync_and_non_blocking_polling(tmp_path):
    distckpt.save(state(2.0), tmp_path / "a", async_sharded_save=True).execute_sync()
    assert distckpt.load(request(), tmp_path / "a")["step"] == 2
    queue = AsyncCallsQueue()
    queue.schedule_async_request(distckpt.save(state(3.0), tmp_path / "b", async_sharded_save=True))
    finalized: list[int] = []
    while not finalized:
        finalized = queue.maybe_finalize_async_calls(blocking=False)
    assert finalized == [0] and distckpt.load(request(), tmp_path / "b")["step"] == 3
    queue.close()


def test_frozen_request_refuses_more_finalizers(tmp_path):
    req = distckpt.save(state(1.0), tmp_path, async_sharded_save=True)
    req.add_finalize_fn(lambda: None)
    frozen = req.freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        frozen.add_finalize_fn(lambda: None)
    req.execute_sync()


def test_staging_buffers_are_reused_across_saves(tmp_path):
    POOL._free.clear()
    queue = AsyncCallsQueue()
    pointers = set()
    for i in range(3):
        req = distckpt.save(state(float(i)), tmp_path, async_sharded_save=True, overwrite=True)
        queue.schedule_async_request(req)
        queue.maybe_finalize_async_calls(blocking=True)
        pointers.update(b.data_ptr() for b in POOL._free)
    assert len(pointers) == 1  # one buffer allocated, reused by the next saves
    queue.close()


def test_unchanged_layout_reuses_the_plan(tmp_path, monkeypatch):
    calls = []
    original = save_job.plan_save
    monkeypatch.setattr(save_job, "plan_save", lambda *a: calls.append(1) or original(*a))
    save_job._PLAN_CACHE.clear()
    distckpt.save(state(1.0), tmp_path / "1")
    distckpt.save(state(2.0), tmp_path / "2")  # same layout, new values
    assert len(calls) == 1
    assert torch.equal(distckpt.load(request(), tmp_path / "2")["w"], torch.full((4, 8), 2.0))
    changed = state(3.0)
    changed["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(3))
    distckpt.save(changed, tmp_path / "3")
    assert len(calls) == 2


# --- multi-rank --------------------------------------------------------------------------

def async_save_and_mutate(path: str, value: float) -> list:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    sd = state(value, rank, world)
    req = distckpt.save(sd, path, async_sharded_save=True, overwrite=True)
    sd["w"].data.mul_(0)  # mutation right after save returns
    queue = AsyncCallsQueue()
    queue.schedule_async_request(req)
    finalized = []
    while not finalized:
        finalized = queue.maybe_finalize_async_calls(blocking=False)
    queue.close()
    return finalized


def load_and_check(path: str, value: float) -> bool:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    out = distckpt.load(request(rank, world), path)
    return (torch.equal(out["w"], torch.full((4, 8), value) + rank) and torch.equal(out["b"], torch.full((16,), value))
            and out["rng"].tolist() == [rank, int(value)])


def test_async_save_on_four_ranks(dist, tmp_path):
    assert dist.run(4, async_save_and_mutate, str(tmp_path), 4.0) == [[0]] * 4
    assert all(dist.run(4, load_and_check, str(tmp_path), 4.0))


def async_save_failing_on_rank(path: str, failing_rank: int):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    original = save_job.write_rank_files
    if rank == failing_rank:
        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")
        save_job.write_rank_files = broken
    try:
        req = distckpt.save(state(9.0, rank, world), path, async_sharded_save=True, overwrite=True)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(req)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
        except distckpt.CheckpointingException as exc:
            return type(exc).__name__, str(exc)
        finally:
            queue.close(abort=True)
        return None
    finally:
        save_job.write_rank_files = original


def test_background_failure_on_one_rank_raises_on_every_rank(dist, tmp_path):
    assert dist.run(3, async_save_and_mutate, str(tmp_path), 1.0) == [[0]] * 3  # previous checkpoint
    outcomes = dist.run(3, async_save_failing_on_rank, str(tmp_path), 1, timeout=60)
    assert all(o is not None and o[0] == "StorageError" and "No space left" in o[1] for o in outcomes)
    assert all(dist.run(3, load_and_check, str(tmp_path), 1.0))  # still the previous checkpoint
    assert not [f for f in os.listdir(tmp_path) if f.startswith("data-") and f not in _committed(tmp_path)]


def _committed(path) -> set:
    reader = distckpt.engine.checkpoint.CheckpointReader(path)
    return set(reader.index.files)


def save_with_layout(path: str, change_on_rank: int):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    sd = state(1.0, rank, world)
    if rank == change_on_rank:  # this rank's replica of "b" becomes a second main replica
        sd["b"] = ShardedTensor.from_rank_offsets("b", torch.full((16,), 1.0), replica_id=0)
    job_flags = []
    original = save_job.SaveJob.finalize

    def spy(self, outcome):
        job_flags.append(self.plan_cached)
        return original(self, outcome)

    save_job.SaveJob.finalize = spy
    try:
        distckpt.save(sd, path, overwrite=True, validate_access_integrity=False)
    finally:
        save_job.SaveJob.finalize = original
    return job_flags[0]


def test_plan_cache_is_used_only_when_every_rank_is_unchanged(dist, tmp_path):
    path = str(tmp_path)
    dist.run(2, save_with_layout, path, -1)
    assert dist.run(2, save_with_layout, path, -1) == [True, True]
    assert dist.run(2, save_with_layout, path, 1) == [False, False]  # rank 1 changed: all replan
    assert all(dist.run(2, load_and_check, path, 1.0))


def async_save_with_stuck_writer(path: str, stuck_rank: int):
    import threading

    rank, world = tdist.get_rank(), tdist.get_world_size()
    release = threading.Event()
    original = save_job.write_rank_files
    if rank == stuck_rank:
        def stuck(*args, **kwargs):
            release.wait(30)  # a storage call that never returns (released after the test)
            return original(*args, **kwargs)
        save_job.write_rank_files = stuck
    try:
        req = distckpt.save(state(5.0, rank, world), path, async_sharded_save=True, overwrite=True)
        queue = AsyncCallsQueue(timeout=2.0)
        queue.schedule_async_request(req)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
            return None
        except distckpt.CheckpointingException as exc:
            return type(exc).__name__, str(exc)
        finally:
            release.set()
            queue.close(abort=True)
    finally:
        save_job.write_rank_files = original


def test_stuck_background_writer_fails_every_rank_instead_of_hanging(dist, tmp_path):
    outcomes = dist.run(2, async_save_with_stuck_writer, str(tmp_path), 1, timeout=60)
    assert all(o is not None and o[0] == "StorageError" for o in outcomes)
    assert "did not finish in time" in outcomes[1][1] and "rank 1" in outcomes[0][1]
    assert not (tmp_path / "metadata.json").exists()
