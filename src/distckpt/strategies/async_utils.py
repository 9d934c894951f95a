"""Async save requests and the queue that runs them (Megatron-Core's ``async_utils`` API).

``save(..., async_sharded_save=True)`` stages this rank's data into host memory and returns an
:class:`AsyncRequest`; :meth:`AsyncCallsQueue.schedule_async_request` runs its writes in a
background thread (no process is spawned), and
:meth:`AsyncCallsQueue.maybe_finalize_async_calls` runs the collective finalization — which
writes ``metadata.json`` only if every rank's writes succeeded, and raises on every rank
otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..engine.collective import Coordinator

logger = logging.getLogger(__name__)


class AsyncRequest(NamedTuple):
    """A save split into a background part and collective finalization functions.

    Attributes:
        async_fn: runs in the background (``None``: nothing to run).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run on every rank, in order, once every rank's ``async_fn`` finished.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: run synchronously when the request is scheduled (distckpt stages data
            inside ``save`` already, so its requests leave this ``None``).
        is_frozen: a frozen request accepts no more finalize functions.
        call_idx: the index the queue assigned.
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict = {}
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        if self.is_frozen:
            raise RuntimeError("cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the whole request in the calling thread (a synchronous save)."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        return self._replace(is_frozen=True)


class AsyncCallsQueue:
    """Runs scheduled requests one after the other in a background thread and finalizes them
    collectively, oldest first.

    ``persistent`` is accepted for Megatron compatibility; the worker thread always persists
    across requests (a thread costs nothing to keep). With ``timeout`` (seconds), a request
    whose background part has not finished that long after it was scheduled is finalized
    anyway: distckpt's finalize then raises on every rank (a stuck writer must not hang the
    job) and the checkpoint is not committed.
    """

    def __init__(self, persistent: bool = True, timeout: float | None = None) -> None:
        self.persistent = persistent
        self.timeout = timeout
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, AsyncRequest, Future, float]] = []
        self._next_idx = 0
        self._lock = threading.Lock()

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; returns its call index."""
        request = async_request._replace(call_idx=self._next_idx).freeze()
        self._next_idx += 1
        if request.preload_fn is not None:
            request.preload_fn()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distckpt-async-save")
        if request.async_fn is not None:
            future = self._executor.submit(request.async_fn, *request.async_fn_args, **request.async_fn_kwargs)
        else:
            future = Future()
            future.set_result(None)
        with self._lock:
            self._pending.append((request.call_idx, request, future, time.monotonic()))
        return request.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the requests that finished on every rank; returns their call indices.

        Collective unless ``no_dist``: the ranks agree on which requests are done, so they run
        the (collective) finalize functions together. With ``blocking`` it waits for all.
        """
        coordinator = None if no_dist else Coordinator()
        finalized = []
        while True:
            with self._lock:
                if not self._pending:
                    break
                call_idx, request, future, started = self._pending[0]
            if blocking:
                remaining = None if self.timeout is None else max(0.0, started + self.timeout - time.monotonic())
                _wait(future, remaining)
            expired = self.timeout is not None and time.monotonic() > started + self.timeout
            done = future.done() or expired
            if coordinator is not None and coordinator.distributed and coordinator.world_size > 1:
                flag = torch.tensor([int(done)], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=coordinator.group)
                done = bool(flag.item())
            if not done:
                break
            with self._lock:
                self._pending.pop(0)
            error = future.exception() if future.done() else None
            if error is not None:
                # A user-built request failed in the background; distckpt's own requests carry
                # their errors into the collective finalize functions instead.
                raise error
            for fn in request.finalize_fns:
                fn()
            finalized.append(call_idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self, abort: bool = False) -> None:
        """Finalize everything (unless ``abort``) and stop the background thread."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        if self._executor is not None:
            self._executor.shutdown(wait=not abort)
            self._executor = None


def _wait(future: Future, timeout: float | None) -> None:
    try:
        future.result(timeout=timeout)
    except BaseException:  # noqa: BLE001 - errors and timeouts are reported at finalization
        pass
