"""The disk's own bandwidth, measured on the benchmark directory: the physical limit.

O_DIRECT bypasses the page cache (what the device sustains); buffered write + fsync is what a
checkpoint writer that fsyncs can hope for; buffered cold read follows a page-cache drop.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 16 << 20


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False when not permitted (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _aligned_random_block() -> mmap.mmap:
    block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    block.write(os.urandom(BLOCK))  # random: no device-side compression or zero detection
    return block


def _write(path: str, nbytes: int, direct: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    block = _aligned_random_block()
    fd = os.open(path, flags, 0o644)
    try:
        for _ in range(nbytes // BLOCK):
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: str, direct: bool) -> int:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    block = mmap.mmap(-1, BLOCK)
    fd = os.open(path, flags)
    total, offset = 0, 0
    try:
        while True:
            n = os.preadv(fd, [block], offset)
            if n == 0:
                return total
            total += n
            offset += n
    finally:
        os.close(fd)


def _timed_parallel(fn, args_list) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(args_list)) as pool:
        list(pool.map(lambda a: fn(*a), args_list))
    return time.perf_counter() - start


def measure_disk(directory: str, mib: int, rounds: int) -> dict:
    """GB/s (1e9 bytes per second) of each access pattern, median over ``rounds``.

    Patterns: O_DIRECT write/read with 1 and 4 streams (4 = the save world size), buffered
    write + fsync, and buffered read after dropping the page cache (when permitted).
    """
    os.makedirs(directory, exist_ok=True)
    nbytes = max(BLOCK, (mib << 20) // BLOCK * BLOCK)
    samples: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(nbytes / seconds / 1e9)

    dropped = False
    for r in range(rounds):
        one = [os.path.join(directory, f"disk-probe-{r}")]
        four = [os.path.join(directory, f"disk-probe-{r}-{i}") for i in range(4)]
        record("direct_write_1", _timed_parallel(_write, [(one[0], nbytes, True)]))
        record("direct_read_1", _timed_parallel(_read, [(one[0], True)]))
        record("direct_write_4", _timed_parallel(_write, [(p, nbytes // 4, True) for p in four]))
        record("direct_read_4", _timed_parallel(_read, [(p, True) for p in four]))
        for p in one + four:
            os.unlink(p)
        record("buffered_write_fsync_1", _timed_parallel(_write, [(one[0], nbytes, False)]))
        dropped = drop_page_cache()
        if dropped:
            record("buffered_cold_read_1", _timed_parallel(_read, [(one[0], False)]))
        os.unlink(one[0])
        os.sync()
    result: dict = {name: statistics.median(v) for name, v in samples.items()}
    result["samples"] = samples
    result["bytes"] = nbytes
    result["write_limit"] = max(result["direct_write_1"], result["direct_write_4"])
    result["read_limit"] = max(result["direct_read_1"], result["direct_read_4"])
    return result
