"""Tests for the multi-process harness in tests/_dist.py (the ``dist`` fixture)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as tdist

from _dist import RankFailure

# --- functions run on the workers (module level, so they pickle by reference) ---------


def _sum_ranks(offset=0):
    t = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(t)
    return tdist.get_rank(), tdist.get_world_size(), int(t.item()) + offset


def _raise_on_rank_1():
    if tdist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return "fine"


def _hang_rank_0():
    if tdist.get_rank() == 0:
        tdist.barrier()  # rank 1 never joins
    return "returned"


def _die_on_rank_1():
    if tdist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return tdist.get_rank()


def _pid():
    return os.getpid()


def _chatty():
    print(f"hello from rank {tdist.get_rank()}", flush=True)
    return None


class _Unpicklable(Exception):
    def __init__(self):
        super().__init__("cannot be rebuilt")
        self.lock = __import__("threading").Lock()


def _raise_unpicklable():
    raise _Unpicklable()


def _wait_until_dead(pid, timeout=10.0):
    """Wait until a worker pid is gone, so the next run surely sees it dead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # spawn: our child; don't reap it (WNOWAIT), the pool owns it
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # forkserver: not our child; gone once the server reaped it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still alive")


# --- tests -----------------------------------------------------------------------------


def test_all_reduce_across_world_sizes(dist):
    for ws in (2, 4, 3, 8, 1, 4):
        expected = sum(range(ws)) + 10
        assert dist.run(ws, _sum_ranks, offset=10) == [(r, ws, expected) for r in range(ws)]


def test_exception_reports_rank_and_traceback(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _raise_on_rank_1)
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.failed_ranks == [1]
    assert err.errors[1].type_name == "ValueError"
    assert "boom from rank one" in err.errors[1].traceback
    assert "_raise_on_rank_1" in err.errors[1].traceback  # the remote frame is there
    assert err.results == {0: "fine"}
    assert "rank 1 raised ValueError" in str(err)
    # the pool is still usable
    assert dist.run(2, _sum_ranks) == [(0, 2, 1), (1, 2, 1)]


def test_unpicklable_exception_is_reported_as_text(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _raise_unpicklable)
    assert {e.type_name for e in info.value.errors.values()} == {"_Unpicklable"}


def test_hang_is_detected_and_pool_recovers(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _hang_rank_0, timeout=3)
    err = info.value
    assert list(err.missing) == [0]
    assert "no answer" in err.missing[0]
    assert err.results == {1: "returned"}
    assert dist.run(3, _sum_ranks) == [(r, 3, 3) for r in range(3)]


def test_dead_worker_is_detected_and_pool_recovers(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _die_on_rank_1, timeout=60)
    assert list(info.value.missing) == [1]
    assert "died" in info.value.missing[1]
    assert dist.run(2, _sum_ranks) == [(0, 2, 1), (1, 2, 1)]


def test_worker_killed_while_idle_is_respawned(dist):
    pids = dist.run(2, _pid)
    os.kill(pids[1], signal.SIGKILL)
    _wait_until_dead(pids[1])  # else the next run may race the kill and see rank 1 die mid-run
    assert dist.run(2, _sum_ranks) == [(0, 2, 1), (1, 2, 1)]
    new_pids = dist.run(2, _pid)
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]


def test_worker_output_is_echoed_with_rank_prefix(dist, capfd):
    dist.run(2, _chatty)
    err = capfd.readouterr().err
    assert "[rank 0] hello from rank 0" in err and "[rank 1] hello from rank 1" in err


def test_workers_are_reused(dist):
    assert dist.run(2, _pid) == dist.run(2, _pid)


def test_lambda_is_rejected_in_parent(dist):
    with pytest.raises(Exception, match="pickle|Pickl|lambda"):
        dist.run(2, lambda: 1)
