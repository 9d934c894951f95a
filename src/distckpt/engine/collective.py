"""Coordination across ranks: gathering descriptions and agreeing on failures.

Every fallible step of a save or load runs inside :meth:`Coordinator.exchange`, which gathers
either the step's result or its error from every rank. If any rank failed, every rank raises,
so no rank is ever left waiting in a later collective (Megatron raises validation errors on
rank 0 only and the other ranks hang).

Coordination uses a CPU (gloo) group even when training uses NCCL, and works without
``torch.distributed`` at all (one process).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from .. import errors

logger = logging.getLogger(__name__)

_GLOO_GROUPS: dict[Any, Any] = {}


def _cpu_group(group: Any) -> Any:
    """A gloo group with the ranks of ``group`` (the group itself if it already is gloo)."""
    if dist.get_backend(group) == "gloo":
        return group
    # Keyed by the group object: a re-initialized default group is a new object, so nothing
    # cached for a destroyed one is reused. Only the group's own ranks take part in creating
    # the gloo group (a save on a subgroup must not desynchronize the job's other groups).
    cache_key = group if group is not None else dist.group.WORLD
    if cache_key not in _GLOO_GROUPS:
        ranks = dist.get_process_group_ranks(cache_key)
        _GLOO_GROUPS[cache_key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return _GLOO_GROUPS[cache_key]


class Coordinator:
    """The ranks taking part in one collective save or load."""

    def __init__(self, group: Any | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = _cpu_group(group)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            self.group = None
            self.rank = 0
            self.world_size = 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any, step: str = "a collective") -> list[Any]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._collective(step):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any, step: str = "a collective") -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (``None`` elsewhere)."""
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        with self._collective(step):
            dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                               group=self.group)
        return out

    @contextlib.contextmanager
    def _collective(self, step: str) -> Iterator[None]:
        """Failures of the collective itself (a dead peer, the group's timeout) become a
        :class:`CollectiveError` naming the step, instead of a bare backend error."""
        try:
            yield
        except errors.CheckpointingException:
            raise
        except (RuntimeError, ConnectionError) as exc:
            raise errors.CollectiveError(
                f"rank {self.rank}: the collective of {step} failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                "another rank died or did not take part within the process group's timeout "
                "(set by init_process_group(timeout=...) or the process_group passed in)"
            ) from exc

    def broadcast(self, obj: Any, step: str = "a collective") -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        with self._collective(step):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        return box[0]

    def exchange(self, step: str, fn: Callable[[], Any], to_coordinator: bool = False) -> list[Any]:
        """Run ``fn`` here, then gather every rank's result; raise on every rank if any failed.

        With ``to_coordinator`` only the coordinator receives the results (others get ``[]``).

        The rank that failed re-raises its own exception (with its traceback); the others raise
        an error of the same distckpt type (or :class:`RemoteRankError`) naming that rank.
        """
        local_error: BaseException | None = None
        try:
            payload: Any = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
            local_error = exc
            if isinstance(exc, OSError) and not isinstance(exc, errors.CheckpointingException):
                # I/O failures become StorageError (still an OSError) on every rank alike.
                local_error = errors.StorageError(f"rank {self.rank} failed during {step}: {exc}")
                local_error.__cause__ = exc
            payload = ("error", type(local_error).__name__, str(exc))
        if to_coordinator:
            # Only the coordinator needs the results (e.g. write records for the index): gather
            # them there and broadcast just the verdict, instead of sending everything to all.
            gathered = self.gather(payload, step)
            verdict = None
            if gathered is not None:
                verdict = [(rank, r) for rank, r in enumerate(gathered) if r[0] == "error"]
            failures = self.broadcast(verdict, step)
            if not failures:
                return [r[1] for r in gathered] if gathered is not None else []
        else:
            results = self.all_gather(payload, step)
            failures = [(rank, r) for rank, r in enumerate(results) if r[0] == "error"]
            if not failures:
                return [r[1] for r in results]
        if local_error is not None:
            raise local_error
        rank, (_, type_name, message) = failures[0]
        error_type = getattr(errors, type_name, None)
        if not (isinstance(error_type, type) and issubclass(error_type, errors.CheckpointingException)):
            error_type = errors.RemoteRankError
            message = f"{type_name}: {message}"
        others = f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        raise error_type(f"rank {rank} failed during {step}{others}: {message}")
