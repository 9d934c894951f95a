"""Worker side of benchmarks/bench.py: one persistent process per rank.

Each worker joins a gloo process group once, then runs the operations the driver sends it
(build a state dict, save, load, clone) with a barrier before and after every timed region.
Nothing here is timed by the driver: every operation returns its own measurements.
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import os
import re
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import distckpt
from distckpt import ShardedTensor

_STATUS = "/proc/self/status"
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


def _status_kb(field: str) -> int:
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else 0


def _reset_peak_rss() -> tuple[int, bool]:
    """Current RSS in kB, after resetting the process's peak RSS (VmHWM) to it if the kernel
    allows (writing 5 to /proc/self/clear_refs, Linux >= 4.0).

    Freed heap memory is first returned to the kernel (malloc_trim), so that an operation
    reusing memory an earlier one freed still shows as growth.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    return _status_kb("VmRSS"), reset


def _io_counters() -> dict[str, int]:
    counters = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, value = line.split(":")
            counters[name] = int(value)
    return counters


def _loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (gloo's traffic, and anything else that
    runs on this machine's loopback at the same time)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


_fsync_calls = 0


def _count_fsyncs() -> None:
    """Wrap os.fsync so that every call (by distckpt or DCP, in any thread) is counted: both
    libraries call ``os.fsync`` through the module attribute."""
    global _fsync_calls
    original = os.fsync

    def counting_fsync(fd):
        global _fsync_calls
        _fsync_calls += 1
        return original(fd)

    os.fsync = counting_fsync  # type: ignore[assignment]


def tensor_key(i: int) -> str:
    return f"layers.{i}.weight"


def global_rows(n: int, rows: int, cols: int, i: int, row_lo: int, row_hi: int) -> torch.Tensor:
    """Rows [row_lo, row_hi) of global tensor i: small integers, exact in fp32, distinct per
    tensor and position, so a load can be checked bit for bit."""
    del n, rows
    start = row_lo * cols
    values = (torch.arange(start, row_hi * cols, dtype=torch.int64) + 7919 * i) % (1 << 20)
    return values.to(torch.float32).view(row_hi - row_lo, cols)


class Worker:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.mesh = init_device_mesh("cpu", (world,))
        # DCP's async save runs its collectives in a background thread: give it its own group so
        # they never interleave with the main thread's barriers.
        self.async_group = dist.new_group(backend="gloo")
        self.tensors: list[torch.Tensor] = []
        self.buffers: dict[str, list[torch.Tensor]] = {}
        self.shape = (0, 0)
        self.async_queue: Any = None

    # -- state -----------------------------------------------------------------------------

    def build(self, n: int, rows: int, cols: int, layouts: list[str]) -> dict:
        """Allocate this rank's row shard of every tensor (for saves) and, for each load layout,
        a destination buffer per tensor (touched, as a model's parameters would be)."""
        self.tensors, self.buffers = [], {}
        gc.collect()
        self.shape = (rows, cols)
        step = rows // self.world
        lo, hi = self.rank * step, (self.rank + 1) * step
        self.tensors = [global_rows(n, rows, cols, i, lo, hi) for i in range(n)]
        for layout in layouts:
            axis, parts = _layout(layout)
            shape = (rows // parts, cols) if axis == 0 else (rows, cols // parts)
            self.buffers[layout] = [torch.zeros(shape) for _ in range(n)]
        return {"state_bytes": sum(t.numel() * 4 for t in self.tensors)}

    def _distckpt_state(self) -> dict:
        return {
            tensor_key(i): ShardedTensor.from_rank_offsets(tensor_key(i), t, (0, self.rank, self.world))
            for i, t in enumerate(self.tensors)
        }

    def _dcp_state(self) -> dict:
        return {
            tensor_key(i): DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False)
            for i, t in enumerate(self.tensors)
        }

    # -- operations --------------------------------------------------------------------------

    def save(
        self,
        lib: str,
        path: str,
        mode: str,
        profile: str | None = None,
        dcp_plan_caching: bool = False,
        mutate_while_writing: bool = False,
    ) -> dict:
        """Save this rank's state with ``lib`` ("distckpt" or "dcp"), ``mode`` "sync" or "async".

        ``mutate_while_writing`` (async only) changes every tensor as soon as the save returns
        control and restores it once committed, as a training step would: a checkpoint that
        then loads bit-exact proves the blocking part really took a snapshot.
        """
        planner = dcp.DefaultSavePlanner(enable_plan_caching=True) if dcp_plan_caching else None
        state = self._distckpt_state() if lib == "distckpt" else self._dcp_state()
        profile = profile if self.rank == 0 else None
        if mode == "async" and lib == "distckpt" and self.async_queue is None:
            try:
                from distckpt.strategies.async_utils import AsyncCallsQueue
            except ImportError as e:
                return _unavailable(e)
            self.async_queue = AsyncCallsQueue()
        rss0, reset = _reset_peak_rss()
        fsyncs0, io0 = _fsync_calls, _io_counters()
        dist.barrier()
        profiler = _start_profile(profile)
        t0 = time.perf_counter()
        error = None
        try:
            if mode == "sync":
                if lib == "distckpt":
                    distckpt.save(state, path)
                else:
                    dcp.save(state, storage_writer=_dcp_writer(path), planner=planner)
                t_block = time.perf_counter()
            else:
                if lib == "distckpt":
                    request = distckpt.save(state, path, async_sharded_save=True)
                    self.async_queue.schedule_async_request(request)
                    wait = lambda: self.async_queue.maybe_finalize_async_calls(blocking=True)  # noqa: E731
                else:
                    future = dcp.async_save(
                        state, storage_writer=_dcp_writer(path), planner=planner,
                        process_group=self.async_group,
                    )
                    wait = future.result
                t_block = time.perf_counter()
                if mutate_while_writing:
                    for t in self.tensors:
                        t.add_(1)
                wait()
                if mutate_while_writing:
                    for t in self.tensors:
                        t.sub_(1)  # exact: the values are small integers
        except Exception as e:  # an unavailable API is a result ("n/a"), not a crash
            error = e
            t_block = time.perf_counter()
        t_done = time.perf_counter()
        _stop_profile(profiler, profile)
        dist.barrier()
        t1 = time.perf_counter()
        if error is not None:
            return _unavailable(error)
        io1 = _io_counters()
        peak = _status_kb("VmHWM")
        state = wait = None  # type: ignore[assignment]
        retained, _ = _reset_peak_rss()  # what the library keeps between saves (e.g. staging buffers)
        return {
            "time": t1 - t0,
            "block": t_block - t0,
            "local_done": t_done - t0,
            "rss_growth_kb": peak - rss0,
            "rss_retained_kb": retained - rss0,
            "peak_reset": reset,
            "fsyncs": _fsync_calls - fsyncs0,
            "wchar": io1["wchar"] - io0["wchar"],
            "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        }

    def clone(self, into_buffers: bool = False) -> dict:
        """The reference for async blocking time: a plain copy of this rank's bytes, into fresh
        memory (``clone``) or into buffers allocated and touched beforehand (``copy_``)."""
        targets = [torch.ones_like(t) for t in self.tensors] if into_buffers else None
        rss0, reset = _reset_peak_rss()
        dist.barrier()
        t0 = time.perf_counter()
        if targets is not None:
            for target, t in zip(targets, self.tensors):
                target.copy_(t)
        else:
            targets = [t.clone() for t in self.tensors]  # held until after the barrier
        t_block = time.perf_counter()
        dist.barrier()
        t1 = time.perf_counter()
        growth = _status_kb("VmHWM") - rss0
        return {"time": t1 - t0, "block": t_block - t0, "rss_growth_kb": growth, "peak_reset": reset}

    def load(self, lib: str, path: str, layout: str, profile: str | None = None) -> dict:
        axis, parts = _layout(layout)
        assert parts == self.world, f"layout {layout} needs {parts} ranks, this pool has {self.world}"
        profile = profile if self.rank == 0 else None
        buffers = self.buffers[layout]
        for b in buffers:
            b.zero_()
        if lib == "distckpt":
            request: dict = {
                tensor_key(i): ShardedTensor.from_rank_offsets(tensor_key(i), b, (axis, self.rank, parts))
                for i, b in enumerate(buffers)
            }
        else:
            request = {
                tensor_key(i): DTensor.from_local(b, self.mesh, [Shard(axis)], run_check=False)
                for i, b in enumerate(buffers)
            }
        rss0, reset = _reset_peak_rss()
        io0 = _io_counters()
        dist.barrier()
        lo0 = _loopback_bytes()
        profiler = _start_profile(profile)
        t0 = time.perf_counter()
        if lib == "distckpt":
            distckpt.load(request, path)
        else:
            dcp.load(request, storage_reader=_dcp_reader(path))
        t_done = time.perf_counter()
        _stop_profile(profiler, profile)
        lo1 = _loopback_bytes()
        dist.barrier()
        t1 = time.perf_counter()
        io1 = _io_counters()
        return {
            "time": t1 - t0,
            "lo_bytes": lo1 - lo0,
            "local_done": t_done - t0,
            "rss_growth_kb": _status_kb("VmHWM") - rss0,
            "peak_reset": reset,
            "rchar": io1["rchar"] - io0["rchar"],
            "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "needed_bytes": sum(b.numel() * 4 for b in buffers),
        }

    def check(self, layout: str) -> dict:
        """Compare the last load into ``layout`` with the global values, bit for bit."""
        axis, parts = _layout(layout)
        rows, cols = self.shape
        n = len(self.buffers[layout])
        bad = []
        for i, b in enumerate(self.buffers[layout]):
            if axis == 0:
                step = rows // parts
                want = global_rows(n, rows, cols, i, self.rank * step, (self.rank + 1) * step)
            else:
                step = cols // parts
                want = global_rows(n, rows, cols, i, 0, rows)[:, self.rank * step : (self.rank + 1) * step]
            if not torch.equal(b, want):
                bad.append(tensor_key(i))
        return {"mismatched": bad[:5], "mismatched_count": len(bad)}

    def close(self) -> dict:
        if self.async_queue is not None and hasattr(self.async_queue, "close"):
            try:
                self.async_queue.close()
            except Exception as e:  # reported, not fatal: every timed result is in already
                return {"warning": f"AsyncCallsQueue.close: {type(e).__name__}: {e}"}
        return {}


def _layout(layout: str) -> tuple[int, int]:
    """'rows2' -> (0, 2), 'cols2' -> (1, 2)."""
    axis = {"rows": 0, "cols": 1}[layout[:4]]
    return axis, int(layout[4:])


def _unavailable(error: BaseException) -> dict:
    return {"unavailable": f"{type(error).__name__}: {error}"}


def _start_profile(path: str | None) -> cProfile.Profile | None:
    if path is None:
        return None
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: cProfile.Profile | None, path: str | None) -> None:
    if profiler is not None and path is not None:
        profiler.disable()
        profiler.dump_stats(path)


def _dcp_writer(path: str):
    """DCP's filesystem writer, or for a URL its fsspec writer (s3fs for s3://)."""
    if "://" in path:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path)
    return dcp.FileSystemWriter(path)


def _dcp_reader(path: str):
    if "://" in path:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path)


def worker_main(rank: int, world: int, port: int, commands, results) -> None:
    """Process entry point: join the group, then serve commands until ('exit',)."""
    torch.set_num_threads(1)
    _count_fsyncs()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=900),
    )
    worker = Worker(rank, world)
    results.put((rank, "ready", None))
    while True:
        name, kwargs = commands.get()
        if name == "exit":
            break
        try:
            results.put((rank, "ok", getattr(worker, name)(**kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    worker.close()
    dist.destroy_process_group()
