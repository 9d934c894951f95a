"""Host staging buffers for async save: the only copy the training loop waits for.

Buffers are reused across saves (a save's buffer returns to the pool once its background write
finished), so a steady training loop allocates host memory once. Sources on an accelerator are
copied into pinned buffers with non-blocking copies, synchronised once at the end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..planning.save_plan import ChunkWrite

_ALIGN = 64  # every staged chunk starts aligned, so it can be viewed as its dtype


@dataclass
class StagedChunks:
    """Copies of this rank's chunks: ``chunks[i]`` reads all of ``tensors[i]``."""

    chunks: list[ChunkWrite]
    tensors: list[torch.Tensor]
    buffer: torch.Tensor


class StagingPool:
    """Reusable uint8 host buffers, one per in-flight save."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.is_pinned() == pinned:
                    return self._free.pop(i)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            # Keep the two largest: enough for one save in flight while the next one stages.
            self._free.sort(key=lambda b: -b.numel())
            del self._free[2:]


POOL = StagingPool()


def stage(chunks: list[ChunkWrite], shard_data: list[torch.Tensor]) -> StagedChunks:
    """Copy the bytes of ``chunks`` into one reusable host buffer and return views of it."""
    layout = []
    total = 0
    for write in chunks:
        dtype = shard_data[write.shard_index].dtype
        nbytes = write.box.volume * dtype.itemsize
        layout.append((total, nbytes, dtype))
        total += -(-nbytes // _ALIGN) * _ALIGN
    on_device = any(t.device.type != "cpu" for t in shard_data)
    buffer = POOL.acquire(total, pinned=on_device and torch.cuda.is_available())
    flats: dict[int, torch.Tensor] = {}
    staged = []
    for write, (offset, nbytes, dtype) in zip(chunks, layout):
        flat = flats.get(write.shard_index)
        if flat is None:
            source = shard_data[write.shard_index].detach().resolve_conj().resolve_neg()
            flat = flats[write.shard_index] = source.reshape(-1)
        target = buffer[offset : offset + nbytes].view(dtype)
        target.copy_(flat[write.data_start : write.data_start + write.box.volume], non_blocking=on_device)
        staged.append(target)
    if on_device:
        torch.cuda.synchronize()
    rewritten = [
        ChunkWrite(write.key, i, write.box, 0) for i, write in enumerate(chunks)
    ]
    return StagedChunks(rewritten, staged, buffer)
