"""Pause Python's cyclic garbage collector while planning code builds millions of objects.

Planning at scale (thousands of ranks x thousands of tensors) allocates millions of small,
acyclic objects (tuples, shard and chunk descriptions). Each allocation burst triggers the
cyclic collector, whose full passes traverse every live object: in measurements this more than
doubled the time of validation, planning and index parsing. None of these functions creates
reference cycles, so nothing is lost by deferring collection until they return; the collector
runs normally afterwards.

Pauses nest and may overlap between threads: the collector is re-enabled when the last pause
ends, and only if it was enabled when the first one began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
