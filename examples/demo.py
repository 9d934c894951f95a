"""distckpt demo: save on 4 ranks (TP=2 x DP=2, distributed optimizer), resume on 3 ranks
(TP=1 x DP=3) with every value checked, then inspect and verify the checkpoint; then a real
FSDP2 training loop checkpointed on 4 processes, resumed on 2, and exported to safetensors
(examples/train_fsdp.py).

Run with ``./dev demo`` (or ``python examples/demo.py [checkpoint_dir]``).
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distckpt
from distckpt import ShardedObject, ShardedTensor

HIDDEN, VOCAB, LAYERS = 48, 96, 2


def global_params() -> dict[str, torch.Tensor]:
    """The full (unsharded) model, generated deterministically so every rank can check."""
    gen = torch.Generator().manual_seed(1234)
    params = {"embedding.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i in range(LAYERS):
        params[f"layers.{i}.qkv.weight"] = torch.randn(3 * HIDDEN, HIDDEN, generator=gen)
        params[f"layers.{i}.proj.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen)
        params[f"layers.{i}.norm.weight"] = torch.randn(HIDDEN, generator=gen)
    return params


# Tensor-parallel axis of each parameter (None: replicated across TP ranks).
def tp_axis(name: str) -> int | None:
    if name.endswith("norm.weight"):
        return None
    return 1 if name.endswith("proj.weight") else 0


def exp_avg(name: str, full: torch.Tensor) -> torch.Tensor:
    """A stand-in for Adam's first moment: any deterministic function of the parameter."""
    return (full * 0.5 + len(name)).to(torch.float32)


def sharded_state(tp: int, dp: int, rank: int, fill: bool) -> dict:
    """This rank's sharded state dict for layout TP x DP (rank = dp_rank * tp + tp_rank).

    Model weights are split along their TP axis and replicated across DP. The optimizer state
    is a distributed optimizer's: this TP rank's weights are flattened into one buffer whose
    contiguous ranges are owned by the DP ranks (ranges cut across parameter boundaries).
    With ``fill=False`` the tensors are empty buffers to load into.
    """
    tp_rank, dp_rank = rank % tp, rank // tp
    full = global_params()
    state: dict = {"model": {}, "optimizer": {}}
    local_params = {}
    for name, tensor in full.items():
        axis = tp_axis(name)
        local = tensor if axis is None else tensor.chunk(tp, dim=axis)[tp_rank]
        local_params[name] = local
        data = local.clone() if fill else torch.empty_like(local)
        if axis is None:
            st = ShardedTensor.from_rank_offsets(name, data, replica_id=(tp_rank, dp_rank))
        else:
            st = ShardedTensor.from_rank_offsets(name, data, (axis, tp_rank, tp), replica_id=dp_rank)
        state["model"][name] = st

    # Distributed optimizer: DP rank owns [start, stop) of the flat buffer of local params.
    total = sum(p.numel() for p in local_params.values())
    start, stop = dp_rank * total // dp, (dp_rank + 1) * total // dp
    position = 0
    for name, local in local_params.items():
        lo, hi = max(start, position), min(stop, position + local.numel())
        position += local.numel()
        if lo >= hi:
            continue
        flat = slice(lo - (position - local.numel()), hi - (position - local.numel()))
        axis = tp_axis(name)
        values = exp_avg(name, local).reshape(-1)[flat]
        data = values.clone() if fill else torch.empty_like(values)
        key = f"optimizer.exp_avg.{name}"
        if axis is None:
            st = ShardedTensor.from_rank_offsets_flat(
                key, data, local.shape, flattened_range=flat, replica_id=(tp_rank, 0)
            )
        else:
            st = ShardedTensor.from_rank_offsets_flat(
                key, data, local.shape, (axis, tp_rank, tp), flattened_range=flat
            )
        state["optimizer"][name] = st
    state["iteration"] = 100
    state["config"] = {"hidden": HIDDEN, "vocab": VOCAB, "layers": LAYERS, "lr": 3e-4}
    return state


def expected_values(state: dict) -> dict[str, torch.Tensor]:
    """What each requested shard must contain after loading, computed from the global model."""
    full = global_params()
    expected = {}
    for group in ("model", "optimizer"):
        for name, st in state[group].items():
            source = full[name] if group == "model" else exp_avg(name, full[name])
            box = source[st.global_slice()] if st.global_shape else source
            if st.flattened_range is not None:
                box = box.reshape(-1)[st.flattened_range]
            expected[f"{group}/{name}"] = box
    return expected


def worker(rank: int, world: int, port: int, phase: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        if phase == "save":
            state = sharded_state(tp=2, dp=2, rank=rank, fill=True)
            state["rng"] = ShardedObject("rng_state", torch.get_rng_state(), (world,), (rank,))
            distckpt.save(state, ckpt, content_metadata={"iteration": 100, "layout": "tp2-dp2"})
        else:
            request = sharded_state(tp=1, dp=3, rank=rank, fill=False)
            loaded = distckpt.load(request, ckpt)
            checked = 0
            for key, want in expected_values(sharded_state(tp=1, dp=3, rank=rank, fill=False)).items():
                group, name = key.split("/", 1)
                got = loaded[group][name]
                assert torch.equal(got, want), f"rank {rank}: {key} differs"
                checked += got.numel()
            assert loaded["iteration"] == 100 and loaded["config"]["hidden"] == HIDDEN
            print(f"  rank {rank}: {checked} values checked bit-exact", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, phase: str, ckpt: str) -> float:
    start = time.perf_counter()
    mp.start_processes(worker, args=(world, free_port(), phase, ckpt), nprocs=world, start_method="spawn")
    return time.perf_counter() - start


def main() -> None:
    ckpt = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "distckpt-demo")
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"1) 4 ranks (TP=2 x DP=2, distributed optimizer) save to {ckpt}")
    seconds = launch(4, "save", ckpt)
    print(f"   saved in {seconds:.1f} s (including process start-up)")
    print("2) 3 ranks (TP=1 x DP=3) load the same checkpoint in their own layout")
    seconds = launch(3, "load", ckpt)
    print(f"   loaded and checked in {seconds:.1f} s")
    cli = [sys.executable, "-m", "distckpt.cli"]
    print(f"3) distckpt inspect {ckpt}\n")
    subprocess.run(cli + ["inspect", ckpt], check=True)
    print(f"\n4) distckpt verify {ckpt}")
    subprocess.run(cli + ["verify", ckpt], check=True)
    total = sum(p.numel() for p in global_params().values())
    print(f"\ndemo OK: {total} parameters + optimizer state, saved by 4 ranks, resharded to 3 ranks, "
          f"{math.ceil(sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) / 1024)} KiB on disk")
    print("\n5) Training with FSDP2 and distckpt.checkpoint (examples/train_fsdp.py)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_fsdp

    train_fsdp.main(ckpt + "-train")


if __name__ == "__main__":
    main()
