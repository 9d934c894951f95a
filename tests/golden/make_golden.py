"""Regenerate the golden checkpoints of format v1 (run only when adding a new golden set;
existing goldens must never be rewritten: they prove old checkpoints stay readable).

    python tests/golden/make_golden.py tests/golden/v1
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

from golden_content import single_state, two_rank_state  # noqa: E402


def _two_rank_worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    distckpt.save(two_rank_state(rank, empty=False), path, content_metadata={"golden": "two_ranks"})
    dist.destroy_process_group()


def main(out: str) -> None:
    single = os.path.join(out, "single")
    if os.path.exists(single) or os.path.exists(os.path.join(out, "two_ranks")):
        raise SystemExit(f"{out} already holds goldens; never rewrite them")
    distckpt.save(single_state(empty=False), single, content_metadata={"golden": "single"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_rank_worker, args=(port, os.path.join(out, "two_ranks")), nprocs=2,
                       start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1])
