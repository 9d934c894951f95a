"""A reusable pool of worker processes for real multi-process ``torch.distributed`` tests.

Why: spawning N processes (each importing torch) per test costs seconds on a 2-core
machine, so the pool starts its workers once per pytest session and reuses them.
Worker ``i`` is always rank ``i``.  A run with world size ``W`` uses workers ``0..W-1``
in a gloo (CPU) default process group of exactly ``W`` ranks; the others stay idle.

Usage (via the session fixture ``dist`` from conftest.py)::

    import torch.distributed as tdist

    def _body(x):                      # module level, so workers can import it
        t = torch.tensor([tdist.get_rank()])
        tdist.all_reduce(t)
        return t.item() + x

    def test_it(dist):
        assert dist.run(4, _body, 1) == [7, 7, 7, 7]

``run`` raises :class:`RankFailure` (an ``AssertionError``) when any rank raised, died,
or did not answer within ``timeout`` seconds.  Hangs and deaths kill the whole pool;
it respawns on the next run.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection, get_context

__all__ = ["DistPool", "RankFailure", "RemoteError"]

MAX_WORKERS = 8
START_METHOD = os.environ.get("DIST_TEST_START_METHOD", "forkserver")


@dataclass
class RemoteError:
    """An exception raised by ``fn`` on one rank, as text: exceptions may not pickle."""

    rank: int
    type_name: str
    traceback: str


@dataclass(eq=False)
class RankFailure(AssertionError):
    """Some ranks of a ``DistPool.run`` failed.

    ``errors``: rank -> RemoteError for ranks where fn raised.
    ``missing``: rank -> reason ("died ...", "no answer ...") for ranks that never answered.
    ``results``: rank -> return value for the ranks that did succeed (useful in fault tests).
    """

    world_size: int
    errors: dict[int, RemoteError] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)
    results: dict[int, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(str(self))

    @property
    def failed_ranks(self) -> list[int]:
        return sorted({*self.errors, *self.missing})

    def __str__(self) -> str:
        lines = [f"distributed run (world_size={self.world_size}) failed on ranks {self.failed_ranks}"]
        for rank, why in sorted(self.missing.items()):
            lines.append(f"--- rank {rank}: {why}")
        for rank, err in sorted(self.errors.items()):
            lines.append(f"--- rank {rank} raised {err.type_name}:\n{err.traceback.rstrip()}")
        return "\n".join(lines)


def _free_port() -> int:
    """A currently free loopback port; a fresh one per group avoids TIME_WAIT clashes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, conn, log_path: str) -> None:
    """Worker loop: receive run commands, (re)build the process group if needed, run fn.

    Messages in: ("stop",) or ("run", world_size, port, sys_path, payload) where payload
    pickles (fn, args, kwargs).  The payload is unpickled here, inside the try, so an
    unimportable fn is reported like any other error.  Reply: ("ok", pickled_result) or
    ("err", type_name, traceback_text).

    stdout/stderr (Python and C++, e.g. gloo) go to ``log_path``, which the parent echoes
    after each run: inherited fds would land in whatever test was capturing at spawn time.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Keep 8 workers usable on 2 cores; set before torch is imported.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are local: stay on loopback
    # Ctrl-C goes to the whole terminal process group: let the parent handle it and stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    group = None  # (world_size, port) of the current default group
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent went away
            break
        if msg[0] == "stop":
            break
        _, world_size, port, sys_path, payload = msg
        sys.path[:] = sys_path
        try:
            if group != (world_size, port):
                if tdist.is_initialized():
                    tdist.destroy_process_group()
                group = None
                tdist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(seconds=60),
                )
                group = (world_size, port)
            fn, args, kwargs = pickle.loads(payload)
            reply = ("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report everything, incl. SystemExit
            reply = ("err", type(e).__name__, traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    if tdist.is_initialized():
        tdist.destroy_process_group()


class _Worker:
    def __init__(self, ctx, rank: int, log_dir: str) -> None:
        self.rank = rank
        self.log_path = os.path.join(log_dir, f"rank{rank}.log")
        open(self.log_path, "wb").close()  # a respawned worker starts a fresh log
        self.log_offset = 0
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(rank, child_conn, self.log_path), name=f"dist-rank{rank}"
        )
        self.proc.start()
        child_conn.close()  # so the parent sees EOF if the worker dies

    def echo_output(self) -> None:
        """Copy what the worker printed since last time to our stderr (pytest captures it)."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        for line in data.decode(errors="replace").splitlines():
            sys.stderr.write(f"[rank {self.rank}] {line}\n")


class DistPool:
    """Up to ``max_workers`` persistent worker processes; see the module docstring."""

    #: After a worker dies mid-run, how long the other ranks get to answer before the
    #: pool is killed (they are likely stuck in a collective with the dead rank).
    death_grace: float = 5.0

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        # forkserver: workers are forked from a clean server process (same executable,
        # parent's sys.path) that has imported torch once, so a (re)spawn of 8 workers takes
        # well under a second instead of ~8 s of torch imports on 2 cores.  Plain fork of the
        # pytest process is unsafe (threads, torch state).  "spawn" works too, just slower.
        self._ctx = get_context(START_METHOD)
        if START_METHOD == "forkserver":
            self._ctx.set_forkserver_preload(["torch", "torch.distributed"])
        self._log_dir = tempfile.mkdtemp(prefix="distpool-")
        self.max_workers = max_workers
        self._workers: list[_Worker | None] = [None] * max_workers
        self._group: tuple[int, int] | None = None  # (world_size, port) the workers should use
        atexit.register(self.close)  # backup for the fixture finalizer

    def run(self, world_size: int, fn, *args, timeout: float = 120, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return per-rank results.

        ``fn`` must be importable by reference (a module-level function).
        Raises RankFailure if any rank raised, died, or did not answer within ``timeout`` s.
        """
        __tracebackhide__ = True  # pytest: show the test's frame and the remote tracebacks
        if not 1 <= world_size <= self.max_workers:
            raise ValueError(f"world_size must be in 1..{self.max_workers}, got {world_size}")
        payload = pickle.dumps((fn, args, kwargs))  # fail here, before anything is sent
        workers = [self._ensure_worker(r) for r in range(world_size)]
        if self._group is None or self._group[0] != world_size:
            self._group = (world_size, _free_port())
        msg = ("run", world_size, self._group[1], list(sys.path), payload)
        for w in workers:
            w.conn.send(msg)

        try:
            replies, missing = self._collect(workers, timeout)
        except BaseException:  # e.g. KeyboardInterrupt: workers are mid-run, unusable
            self.kill_workers()
            raise
        finally:
            for w in workers:
                w.echo_output()

        errors = {r: RemoteError(r, rep[1], rep[2]) for r, rep in replies.items() if rep[0] == "err"}
        results = {r: pickle.loads(rep[1]) for r, rep in replies.items() if rep[0] == "ok"}
        if missing:
            self.kill_workers()  # hung or dead ranks: the group is unusable, start afresh
        if missing or errors:
            self._group = None  # half-done collectives may linger: use a fresh group next time
            raise RankFailure(world_size, errors, missing, results)
        return [results[r] for r in range(world_size)]

    def _collect(self, workers: list[_Worker], timeout: float) -> tuple[dict, dict]:
        """Wait for every worker's reply, its death, or the deadline, whichever comes first."""
        replies: dict[int, tuple] = {}
        missing: dict[int, str] = {}
        waiting = {w.conn: w for w in workers} | {w.proc.sentinel: w for w in workers}
        deadline = time.monotonic() + timeout
        while len(replies) + len(missing) < len(workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for obj in connection.wait(list(waiting), remaining):
                w = waiting.get(obj)
                if w is None or w.rank in replies or w.rank in missing:
                    continue
                if obj is w.conn or w.conn.poll():  # a reply sent just before dying still counts
                    try:
                        replies[w.rank] = w.conn.recv()
                        continue
                    except (EOFError, OSError):
                        pass
                w.proc.join(1)
                missing[w.rank] = f"worker process died (exit code {w.proc.exitcode})"
                deadline = min(deadline, time.monotonic() + self.death_grace)
        for w in workers:
            if w.rank not in replies and w.rank not in missing:
                missing[w.rank] = f"no answer within {timeout}s (hang in a collective?)"
        return replies, missing

    def _ensure_worker(self, rank: int) -> _Worker:
        w = self._workers[rank]
        if w is None or not w.proc.is_alive():
            if w is not None:  # died while idle: reap it, and its group is gone too
                self._discard(w)
                self._group = None
            w = self._workers[rank] = _Worker(self._ctx, rank, self._log_dir)
        return w

    def kill_workers(self) -> None:
        """Kill all workers now (SIGKILL); the pool respawns them on the next run."""
        for i, w in enumerate(self._workers):
            if w is not None:
                w.proc.kill()
                self._discard(w)
                self._workers[i] = None
        self._group = None

    def close(self) -> None:
        """Ask workers to exit cleanly; kill those that do not within a few seconds."""
        live = [w for w in self._workers if w is not None]
        for w in live:
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for w in live:
            w.proc.join(max(0.1, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
            self._discard(w)
        self._workers = [None] * self.max_workers
        self._group = None
        shutil.rmtree(self._log_dir, ignore_errors=True)

    @staticmethod
    def _discard(w: _Worker) -> None:
        w.proc.join()  # reap: no zombies
        w.conn.close()
        w.proc.close()
