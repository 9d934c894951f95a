"""Write the golden checkpoints of the current format version into a new directory (run only
when a format version is added; existing goldens must never be rewritten: they prove old
checkpoints stay readable).

    python tests/golden/make_golden.py tests/golden/v2    # format version 2 (index with grids)

``tests/golden/v1`` was written the same way by the release that introduced format version 1.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import distckpt  # noqa: E402

from golden_content import grid_state, single_state, two_rank_state  # noqa: E402


def _two_rank_worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    distckpt.save(two_rank_state(rank, empty=False), path, content_metadata={"golden": "two_ranks"})
    dist.destroy_process_group()


def main(out: str) -> None:
    single = os.path.join(out, "single")
    if any(os.path.exists(os.path.join(out, name)) for name in ("single", "two_ranks", "grid")):
        raise SystemExit(f"{out} already holds goldens; never rewrite them")
    distckpt.save(single_state(empty=False), single, content_metadata={"golden": "single"})
    distckpt.save(grid_state(empty=False), os.path.join(out, "grid"), content_metadata={"golden": "grid"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_rank_worker, args=(port, os.path.join(out, "two_ranks")), nprocs=2,
                       start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
