"""Scale of planning: the pure planning and index code at 4096 ranks x 1000 tensors.

Simulates the shard descriptors of every rank in one process (no tensors, no I/O, no process
group) and times each step the coordinator runs during a save, as the engine runs them:

    validate   distckpt.validation.validate_sharding_integrity (every rank runs it)
    plan_save  distckpt.planning.save_plan.plan_save            (every rank runs it)
    index      distckpt.engine.save.build_index                 (coordinator)
    to_json    CheckpointIndex.to_json                          (coordinator; the bytes on disk)

then, on the load side, CheckpointIndex.from_json (every rank, once per checkpoint) and
distckpt.planning.load_plan.plan_reads for one rank of another layout.

The data written by each rank is not simulated; its write records (file, data offset, one
crc32c per checksum block) are fabricated with the sizes the reference writer would produce, and
their construction is timed separately ("records": in a real save each rank builds its own).
Each rank's descriptions and records go through a pickle round trip, as they do when the engine
gathers them (``all_gather_object``): the objects then lie in memory as they would on a real
coordinator, one rank's after the other.

    python benchmarks/planning_scale.py                       # 4096 ranks x 1000 tensors, fsdp
    python benchmarks/planning_scale.py --layout tp_dp
    python benchmarks/planning_scale.py --ranks 512 --tensors 200 --profile validate

Layouts:

- fsdp: every tensor split by rows over all ranks as FSDP2 does (``torch.chunk``: chunks of
  ``ceil(rows / ranks)`` rows, so the last ranks may hold fewer or no rows; empty shards are
  zero-size boxes at the end of the tensor). All main replicas.
- tp_dp: Megatron style TP=8 x PP=4 x DP=ranks/32. Half the keys are parameters (column- or
  row-parallel over TP, or replicated over TP for norms; replicated over DP with only DP rank 0
  main); the other half are distributed-optimizer states: on each (TP, PP) group the flat buffer
  of that stage's parameters is cut into DP contiguous ranges, one per DP rank
  (``from_rank_offsets_flat`` style flat ranges).

The load side plans the reads of rank ``--load-rank`` of ``--load-ranks`` ranks that request
every tensor split by rows (FSDP style) -- a layout different from the saved one.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import pickle
import pstats
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from distckpt.engine.save import build_index
from distckpt.format.index import DEFAULT_BLOCK_BYTES, CheckpointIndex, ChunkEntry
from distckpt.planning.boxes import Box
from distckpt.planning.load_plan import plan_reads
from distckpt.planning.save_plan import RankWritePlan, plan_save
from distckpt.planning.shards import TensorShard
from distckpt.validation import validate_sharding_integrity

DTYPE, ITEMSIZE = "bfloat16", 2

# One transformer layer of a 7B-class model, plus a small tensor (fewer rows than ranks).
LAYER = [
    ("attn.q.weight", (4096, 4096), 0),  # (name, shape, TP axis or None)
    ("attn.k.weight", (4096, 4096), 0),
    ("attn.v.weight", (4096, 4096), 0),
    ("attn.o.weight", (4096, 4096), 1),
    ("mlp.gate.weight", (11008, 4096), 0),
    ("mlp.up.weight", (11008, 4096), 0),
    ("mlp.down.weight", (4096, 11008), 1),
    ("input_norm.weight", (4096,), None),
    ("post_norm.weight", (4096,), None),
    ("router.bias", (1024,), None),
]


def tensor_specs(count: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    return [
        (f"layers.{i // len(LAYER):03d}.{LAYER[i % len(LAYER)][0]}",) + LAYER[i % len(LAYER)][1:]
        for i in range(count)
    ]


def row_split(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """FSDP2 / torch.chunk: chunks of ceil(rows / ranks) rows; trailing ranks may be empty."""
    step = -(-rows // ranks)
    start = min(rank * step, rows)
    return start, min(start + step, rows)


def shard(key: str, shape: tuple[int, ...], offset: tuple[int, ...], box_shape: tuple[int, ...],
          flat: tuple[int, int] | None = None, main: bool = True) -> TensorShard:
    return TensorShard(key, DTYPE, ITEMSIZE, shape, Box(offset, box_shape), flat, main)


def gathered(local: Any) -> Any:
    """What the coordinator holds of one rank's payload after all_gather_object."""
    return pickle.loads(pickle.dumps(local, protocol=pickle.HIGHEST_PROTOCOL))


def fsdp_layout(ranks: int, tensors: int) -> list[list[TensorShard]]:
    specs = tensor_specs(tensors)
    out: list[list[TensorShard]] = []
    for rank in range(ranks):
        local = []
        for key, shape, _ in specs:
            start, stop = row_split(shape[0], ranks, rank)
            local.append(shard(key, shape, (start,) + (0,) * (len(shape) - 1),
                               (stop - start,) + shape[1:]))
        out.append(gathered(local))
    return out


def tp_dp_layout(ranks: int, tensors: int, tp: int = 8, pp: int = 4) -> list[list[TensorShard]]:
    if ranks % (tp * pp):
        raise SystemExit(f"--ranks must be a multiple of TP x PP = {tp * pp} for tp_dp")
    dp = ranks // (tp * pp)
    params = tensor_specs(max(1, tensors // 2))
    n_opt = tensors - len(params)
    stage_of = [i * pp // len(params) for i in range(len(params))]
    out: list[list[TensorShard]] = [[] for _ in range(ranks)]

    def tp_box(shape: tuple[int, ...], axis: int | None, t: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if axis is None:
            return (0,) * len(shape), shape
        size = shape[axis] // tp
        offset = tuple(t * size if a == axis else 0 for a in range(len(shape)))
        return offset, tuple(size if a == axis else n for a, n in enumerate(shape))

    for p in range(pp):
        members = [i for i in range(len(params)) if stage_of[i] == p]
        for t in range(tp):
            # Parameters: replicated over DP (main on DP rank 0), TP-sharded or TP-replicated.
            boxes = {}
            for i in members:
                key, shape, axis = params[i]
                boxes[i] = tp_box(shape, axis, t)
                for d in range(dp):
                    rank = (d * pp + p) * tp + t
                    main = d == 0 and (axis is not None or t == 0)
                    out[rank].append(shard(key, shape, *boxes[i], main=main))
            # Distributed optimizer: this (TP, PP) group's flat buffer cut into DP ranges.
            with_opt = [i for i in members if i < n_opt]
            total = sum(math.prod(boxes[i][1]) for i in with_opt)
            per_dp = -(-total // dp)
            position = 0
            for i in with_opt:
                key, shape, axis = params[i]
                numel = math.prod(boxes[i][1])
                first, last = position // per_dp, (position + numel - 1) // per_dp
                for d in range(first, min(last, dp - 1) + 1):
                    lo = max(d * per_dp, position) - position
                    hi = min((d + 1) * per_dp, position + numel) - position
                    rank = (d * pp + p) * tp + t
                    out[rank].append(shard("optimizer.exp_avg." + key, shape, *boxes[i], flat=(lo, hi),
                                           main=axis is not None or t == 0))
                position += numel
    return [gathered(local) for local in out]


def load_request(index: CheckpointIndex, ranks: int, rank: int) -> list[TensorShard]:
    """What ``rank`` of ``ranks`` asks for when it loads every tensor split by rows."""
    requests = []
    for key, entry in index.tensors.items():
        start, stop = row_split(entry.shape[0], ranks, rank)
        requests.append(shard(key, entry.shape, (start,) + (0,) * (len(entry.shape) - 1),
                              (stop - start,) + entry.shape[1:]))
    return requests


def fabricate_records(plans: list[RankWritePlan], block_bytes: int) -> list[tuple[list, list]]:
    """The write records each rank would return: one data file per rank, chunks in order,
    the data offset after a safetensors header of realistic size, a crc32c per block."""
    rng = random.Random(0)
    written = []
    for rank, plan in enumerate(plans):
        name = f"data-0123456789abcdef-r{rank:05d}-0.safetensors"
        header = 8 + 40 + sum(len(c.key) + 60 for c in plan.chunks)
        position = header + (-header % 8)
        records = []
        for write in plan.chunks:
            nbytes = write.box.volume * ITEMSIZE
            crcs = tuple(rng.getrandbits(32) for _ in range(-(-nbytes // block_bytes)))
            records.append((write.key, ChunkEntry(write.box.offset, write.box.shape, name, position,
                                                  nbytes, crcs)))
            position += nbytes
        written.append(gathered((records, [])))
    return written


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Stop(Exception):
    pass


class Stages:
    """Times each stage (time.perf_counter) and records the peak RSS after it."""

    def __init__(self, profile: str | None, until: str | None) -> None:
        self.profile, self.until = profile, until
        self.seconds: dict[str, float] = {}
        self.peak_mib: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        profiler = cProfile.Profile() if self.profile == name else None
        start = time.perf_counter()
        result = profiler.runcall(fn) if profiler is not None else fn()
        self.seconds[name] = time.perf_counter() - start
        self.peak_mib[name] = peak_rss_mib()
        if profiler is not None:
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        print(f"  {name}: {self.seconds[name]:.3f} s", file=sys.stderr, flush=True)
        if name == self.until:
            raise _Stop
        return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--layout", choices=["fsdp", "tp_dp"], default="fsdp")
    parser.add_argument("--load-ranks", type=int, default=2048)
    parser.add_argument("--load-rank", type=int, default=777)
    parser.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    parser.add_argument("--profile", metavar="STAGE", default=None,
                        help="run STAGE under cProfile and print the top functions")
    parser.add_argument("--until", metavar="STAGE", default=None,
                        help="stop after STAGE (for profiling the save side alone)")
    parser.add_argument("--index-out", metavar="FILE", default=None, help="also write the index there")
    args = parser.parse_args(argv)
    stage = Stages(args.profile, args.until)
    try:
        return run(args, stage)
    except _Stop:
        return {"seconds": stage.seconds}


def run(args: argparse.Namespace, stage: Stages) -> dict[str, Any]:
    timings, peaks = stage.seconds, stage.peak_mib
    make = fsdp_layout if args.layout == "fsdp" else tp_dp_layout
    all_tensors = stage("describe", lambda: make(args.ranks, args.tensors))
    shards = sum(len(s) for s in all_tensors)
    stage("validate", lambda: validate_sharding_integrity(all_tensors))
    plans = stage("plan_save", lambda: plan_save(all_tensors))
    written = stage("records", lambda: fabricate_records(plans, args.block_bytes))
    index = stage("index", lambda: build_index(all_tensors, written, args.block_bytes))
    chunks = sum(len(t.chunks) for t in index.tensors.values())
    written = plans = None  # free what a coordinator no longer holds
    raw = stage("to_json", index.to_json)
    if args.index_out:
        with open(args.index_out, "wb") as f:
            f.write(raw)
    index = all_tensors = None
    gc.collect()
    loaded = stage("from_json", lambda: CheckpointIndex.from_json(raw, "index.json"))
    requests = load_request(loaded, args.load_ranks, args.load_rank)
    reads = stage("plan_reads", lambda: plan_reads(requests, loaded.tensors, loaded.block_bytes))

    save_total = sum(timings[s] for s in ("validate", "plan_save", "index", "to_json"))
    result = {
        "layout": args.layout,
        "ranks": args.ranks,
        "tensors": args.tensors,
        "shards": shards,
        "chunks": chunks,
        "index_bytes": len(raw),
        "seconds": {k: round(v, 3) for k, v in timings.items()},
        "save_planning_seconds": round(save_total, 3),
        "load_rank": [args.load_rank, args.load_ranks],
        "load_requests": len(requests),
        "load_reads": len(reads),
        "peak_rss_mib": round(max(peaks.values()), 1),
        "python": sys.version.split()[0],
    }
    rows = [
        ("describe (simulated input)", "describe"),
        ("validate_sharding_integrity", "validate"),
        ("plan_save", "plan_save"),
        ("write records (simulated)", "records"),
        ("build_index", "index"),
        ("CheckpointIndex.to_json", "to_json"),
        ("CheckpointIndex.from_json", "from_json"),
        (f"plan_reads (rank {args.load_rank} of {args.load_ranks})", "plan_reads"),
    ]
    print(f"{args.layout}: {args.ranks} ranks x {args.tensors} tensors, {shards} shards, {chunks} chunks")
    print(f"{'stage':<40} {'seconds':>9} {'peak RSS MiB':>13}")
    for label, name in rows:
        print(f"{label:<40} {timings[name]:>9.3f} {peaks[name]:>13.0f}")
    print(f"{'save planning (validate+plan+index+json)':<40} {save_total:>9.3f}")
    print(f"index size: {len(raw):,} bytes ({len(raw) / 1e6:.1f} MB); rank {args.load_rank} reads "
          f"{len(reads)} chunks for {len(requests)} requests")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
