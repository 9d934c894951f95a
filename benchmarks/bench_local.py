"""Node-local tier vs global checkpoint: how long training is blocked, and how long until the
checkpoint is safe, for the same state.

    python benchmarks/bench_local.py            # 4 ranks (2 "nodes"), 256 MiB, 3 repeats
    python benchmarks/bench_local.py --quick    # 32 MiB, 1 repeat

Per repeat and rank, alternating: the local tier (LocalCheckpointManager, node-local root on a
RAM disk, replication factor 2 across the 2 simulated nodes) sync and async; a global
checkpoint (``distckpt.save``) on the disk, sync and async; and a global checkpoint on a real S3
server (SeaweedFS on this machine), sync and async. "Blocking" is what the training loop waits
for; "total" is until the checkpoint is durable and, for the local tier, replicated. Results go
to the section "Local tier vs global checkpoint" of docs/benchmarks.md unless --no-docs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from _report import replace_section  # noqa: E402

from _s3 import S3Server  # noqa: E402

BEGIN, END = "<!-- bench_local.py:begin -->", "<!-- bench_local.py:end -->"
SECTION = "## Local tier vs global checkpoint"
WORLD, RANKS_PER_NODE = 4, 2
MODES = ["local sync", "local async", "global disk sync", "global disk async", "global S3 sync", "global S3 async"]


def state_for(rank: int, total_bytes: int, tensors: int) -> dict:
    from distckpt import ShardedTensor

    cols = 1024
    rows = max(WORLD, total_bytes // 4 // tensors // cols // WORLD * WORLD)
    state: dict = {"iteration": 0}
    for i in range(tensors):
        local = torch.full((rows // WORLD, cols), float(i + rank))
        state[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", local, (0, rank, WORLD))
    return state


def worker(rank: int, port: int, args: dict, out) -> None:
    import distckpt
    from distckpt.local import LocalCheckpointManager
    from distckpt.strategies.async_utils import AsyncCallsQueue
    from distckpt.tensor_aware import TensorAwareStateDict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    state = state_for(rank, args["total_bytes"], args["tensors"])
    manager = LocalCheckpointManager(
        os.path.join(args["local_root"], f"node{rank // RANKS_PER_NODE}"), replication_factor=2,
        replication_stride=RANKS_PER_NODE, keep_last=1,
    )
    queue = AsyncCallsQueue()
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    step = 0

    def timed(mode: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        wait = fn()
        t_block = time.perf_counter()
        wait()
        dist.barrier()
        samples[mode].append((t_block - t0, time.perf_counter() - t0))

    for rep in range(args["repeats"]):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            step += 1
            if mode.startswith("local"):
                tasd = TensorAwareStateDict.from_state_dict(state, algo="fully_parallel")
                if mode == "local sync":
                    timed(mode, lambda tasd=tasd, step=step: (manager.save(tasd, step), manager.wait_for_replication)[1])
                else:
                    def start(tasd=tasd, step=step):
                        queue.schedule_async_request(manager.save(tasd, step, is_async=True))
                        return lambda: queue.maybe_finalize_async_calls(blocking=True)
                    timed(mode, start)
                continue
            target = (os.path.join(args["global_dir"], f"s{step}") if "disk" in mode
                      else f"s3://{args['bucket']}/s{step}-{uuid.uuid4().hex[:6]}")
            if mode.endswith("sync") and not mode.endswith("async"):
                timed(mode, lambda target=target: (distckpt.save(state, target), lambda: None)[1])
            else:
                def start_global(target=target):
                    queue.schedule_async_request(distckpt.save(state, target, async_sharded_save=True))
                    return lambda: queue.maybe_finalize_async_calls(blocking=True)
                timed(mode, start_global)
            if rank == 0 and "disk" in mode:
                shutil.rmtree(target, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        out.put(samples)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local-root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--global-dir", default=tempfile.gettempdir())
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.repeats = 32, 1
    local_root = os.path.join(args.local_root, f"distckpt-bench-local-{uuid.uuid4().hex[:6]}")
    global_dir = os.path.join(args.global_dir, f"distckpt-bench-global-{uuid.uuid4().hex[:6]}")
    server = S3Server().start()
    os.environ.update(server.env())
    try:
        bucket = server.create_bucket()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        config = {"total_bytes": args.total_mib << 20, "tensors": args.tensors, "repeats": args.repeats,
                  "local_root": local_root, "global_dir": global_dir, "bucket": bucket}
        mp.start_processes(worker, args=(port, config, out), nprocs=WORLD, start_method="spawn")
        samples = out.get()
    finally:
        server.close()
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(global_dir, ignore_errors=True)
    lines = ["| save | blocking (median) | total (median) | total vs local sync |", "|---|---:|---:|---:|"]
    base = statistics.median(t for _, t in samples["local sync"])
    for mode in MODES:
        block = statistics.median(b for b, _ in samples[mode])
        total = statistics.median(t for _, t in samples[mode])
        lines.append(f"| {mode} | {block:.3f} s | {total:.3f} s | {total / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        generated = "\n".join([
            BEGIN,
            f"Command: `python benchmarks/bench_local.py{' --quick' if args.quick else ''}` — run "
            f"{datetime.date.today().isoformat()} on commit `{commit}`, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}. {WORLD} ranks as 2 nodes of {RANKS_PER_NODE}, {args.total_mib} MiB "
            f"in {args.tensors} tensors (rows split over the ranks), medians of {args.repeats} alternating "
            f"runs. Local root: `{args.local_root}`; global: `{args.global_dir}` and a SeaweedFS S3 server "
            "on this machine.",
            "",
            table,
            END,
        ])
        replace_section(os.path.join(REPO, "docs", "benchmarks.md"), SECTION, BEGIN, END, generated)


if __name__ == "__main__":
    main()
